"""The Gemma 3 family, text only (Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786,
§2 "Model Architecture"; transformers' ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``):
a decoder with grouped-query attention, an RMSNorm before *and after* attention and the MLP,
q/k RMSNorm in place of Gemma 2's soft-capping, a GeGLU MLP, and local layers (a sliding
window, their own RoPE base) interleaved with global ones (the whole context; 5 local to 1
global in the released models, the window 1,024 tokens).

A layer onto the seven ops (axis letters as in ``models.layers``; every norm is Gemma's
``RMSNorm``, x / rms(x) * (1 + w), in float32):

  =======  ============================================  ===========================
  op       computes                                      reads -> writes
  =======  ============================================  ===========================
  EMBED    token embedding * sqrt(D) (the scale in the   tokens -> x
           model's dtype, as the checkpoint's)
  Q        input RMSNorm; q = RoPE(RMSNorm_E(h Wq)) *    x -> h, q
           c, c = sqrt(E / query_pre_attn_scalar)
  K        k = RoPE(RMSNorm_E(h Wk))                     h -> k
  V        v = h Wv                                      h -> v
  SCORE    KV-cache append, softmax(q k^T / sqrt(E)) v   q, k, v (+cache) -> o
           over the layer's window
  OUT      x + RMSNorm(o Wo)  (the post-attention norm)  o, x -> x
  MLP1     n = RMSNorm(x) (pre-feedforward);             x -> a
           a = GELU_tanh(n Wgate) * (n Wup)
  MLP2     x + RMSNorm(a Wdown)  (post-feedforward)      a, x -> x
  HEAD     final RMSNorm, LM head (the embedding, tied)  x -> logits
  =======  ============================================  ===========================

Attention's scale is query_pre_attn_scalar^-1/2 (the technical report's; 168 = D / H beside a
head dim of 128 in Gemma 3 27B): every attention kernel divides by sqrt(E), so Q multiplies q
by sqrt(E / query_pre_attn_scalar) (``ModelSpec.attention_scale``), the same product.

Local and global layers differ only in their window and RoPE, never in shapes: each layer's
type (``sliding_attention``, ``full_attention``) is ``ModelSpec.layer_types``, and each type's
``sliding_window``, ``rope_theta`` and ``rope_scaling`` its ``ModelSpec.layer_overrides`` (local:
the config's ``sliding_window`` and ``rope_local_base_freq``, 10,000, unscaled; global: the
whole context and ``rope_theta``, 1,000,000, with the config's scaling: linear, factor 8 in
Gemma 3 4B to 27B). Each op runs with its layer's spec (``ModelSpec.layer_spec``), so the
module here reads one window and one RoPE. Attention-logit and final-logit soft-capping (Gemma
2's), bidirectional attention (EmbeddingGemma's) and a multimodal ``gemma3`` config are
refused.

llama.cpp's ``gemma3`` GGUF files are read as llama.cpp reads them (``Gemma3Family.
spec_from_gguf``): its converter stores every norm (those of the layers, q/k and the final one)
as 1 + w, subtracted again at load (``gguf_offset``), writes no layer types, no
``query_pre_attn_scalar`` and (in older converters) no local RoPE base, which llama.cpp
then takes from its own code: every 6th layer global (``attention.sliding_window_pattern``
where a file sets another period), local layers only where ``attention.sliding_window`` is set,
the local base 10,000 (``rope.freq_base_swa`` where set) unscaled, and the attention scale by
model size -- (D / H)^-1/2 for the 62 layers of Gemma 3 27B, E^-1/2 otherwise, which is
``query_pre_attn_scalar``^-1/2 in every released Gemma 3. A checkpoint whose pattern or scale
differs therefore becomes another model in its GGUF, under llama.cpp and hx alike. The
embedding's sqrt(D) is the architecture's, in either file.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn

from hx.errors import HxError
from hx.models import layers
from hx.models.family import ConfigReader, Family, MetadataReader
from hx.models.layers import (ScoreOp, Step, WeightedOp, dense, held_dtype, lookup,
                              rope)
from hx.models import llama
from hx.models.llama import GGUF_MODEL_NAMES, gguf_rope_scaling, inv_frequencies, rope_scaling
from hx.models.ops import EMBED, HEAD, SCORE
from hx.models.spec import ModelSpec

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer types
# transformers' Gemma3TextConfig defaults, for the fields a config.json leaves out
DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6, "vocab_size": 262_208,
            "max_position_embeddings": 131_072}


# Gemma's RMSNorm: x / rms(x) * (1 + w), w initialised to 0 (transformers' ``Gemma3RMSNorm``)
RMSNorm = functools.partial(layers.RMSNorm, offset=1.0)


def query_factor(spec: ModelSpec) -> float:
    """What Q multiplies q by so that SCORE's 1/sqrt(E) makes ``spec.attention_scale``:
    attention_scale * sqrt(E) (1 where the spec keeps 1/sqrt(E))."""
    if spec.attention_scale is None:
        return 1.0
    return spec.attention_scale * math.sqrt(spec.head_dim)


class EmbedOp(WeightedOp):
    """EMBED: tokens (B, T) int32 -> x = table[tokens] * sqrt(D) (B, T, D), the product in the
    model's dtype with sqrt(D) rounded to it (transformers' ``Gemma3TextScaledWordEmbedding``:
    in bfloat16 sqrt(3840) is 62.0); in a later pipeline stage the previous stage's x."""

    @nn.compact
    def __call__(self, tokens: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        if not s.embeds:
            return (tokens,)
        x = lookup(self, "embedding", tokens, s.vocab_size, s.embedding_format)
        return (x * jnp.asarray(math.sqrt(s.d_model), s.dtype),)


def _heads(module: WeightedOp, h: jax.Array, name: str, heads: int, step: Step) -> jax.Array:
    """h (B, T, D) projected by ``w{name}`` to (B, T, heads, E), RMS-normed over E
    (``{name}_norm``) and rotated by the layer's RoPE (``models.llama.inv_frequencies`` of
    the layer's spec: its theta and scaling), in float32."""
    s = module.spec
    y = dense(module, (heads, s.head_dim), name=f"w{name}")(h)
    y = RMSNorm(s.norm_eps, held_dtype(module), name=f"{name}_norm")(y)
    return rope(y, step.positions, inv_frequencies(s))


class QOp(WeightedOp):
    """Q: x (B,T,D) -> h = RMSNorm(x) (B,T,D), q = RoPE(RMSNorm_E(h Wq)) * sqrt(E / s)
    (B,T,H,E), s = query_pre_attn_scalar (``query_factor``)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array, jax.Array]:
        s = self.spec
        h = RMSNorm(s.norm_eps, held_dtype(self), name="attn_norm")(x)
        q = _heads(self, h, "q", s.n_heads, step) * query_factor(s)
        return h, q.astype(s.dtype)


class KOp(WeightedOp):
    """K: h (B,T,D) -> k = RoPE(RMSNorm_E(h Wk)) (B,T,K,E)."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        return (_heads(self, h, "k", self.spec.n_kv_heads, step).astype(self.spec.dtype),)


class VOp(WeightedOp):
    """V: h (B,T,D) -> v = h Wv (B,T,K,E) (no norm, no RoPE)."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        return (dense(self, (s.n_kv_heads, s.head_dim), name="wv")(h).astype(s.dtype),)


class OutOp(WeightedOp):
    """OUT: o (B,T,H,E), x (B,T,D) -> x + RMSNorm(o Wo) (B,T,D) (the post-attention norm)."""

    @nn.compact
    def __call__(self, o: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        y = dense(self, s.d_model, axis=(-2, -1), name="wo")(o)  # 'BTHE,DHE->BTD'
        y = RMSNorm(s.norm_eps, held_dtype(self), name="post_attn_norm")(y)
        return ((x.astype(jnp.float32) + y).astype(s.dtype),)


class Mlp1Op(WeightedOp):
    """MLP1: x (B,T,D) -> a = GELU_tanh(n Wgate) * (n Wup) (B,T,F), n = RMSNorm(x) (the
    pre-feedforward norm; GeGLU, Shazeer 2020, with GELU's tanh approximation, Hendrycks &
    Gimpel 2016: transformers' ``gelu_pytorch_tanh``)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        n = RMSNorm(s.norm_eps, held_dtype(self), name="ffn_norm")(x)
        gate = dense(self, s.d_ff, name="w_gate")(n)  # 'BTD,FD->BTF'
        up = dense(self, s.d_ff, name="w_up")(n)
        return ((jax.nn.gelu(gate, approximate=True) * up).astype(s.dtype),)


class Mlp2Op(WeightedOp):
    """MLP2: a (B,T,F), x (B,T,D) -> x + RMSNorm(a Wdown) (B,T,D) (the post-feedforward
    norm)."""

    @nn.compact
    def __call__(self, a: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        y = dense(self, s.d_model, name="w_down")(a)  # 'BTF,DF->BTD'
        y = RMSNorm(s.norm_eps, held_dtype(self), name="post_ffn_norm")(y)
        return ((x.astype(jnp.float32) + y).astype(s.dtype),)


class HeadOp(llama.HeadOp):
    """HEAD: Llama's, its final norm Gemma's (x (1 + w))."""

    norm_offset: ClassVar[float] = 1.0


MODULES = {EMBED: EmbedOp, "Q": QOp, "K": KOp, "V": VOp, SCORE: ScoreOp, "OUT": OutOp,
           "MLP1": Mlp1Op, "MLP2": Mlp2Op, HEAD: HeadOp}

HF_LAYER_NAMES = {
    ("Q", "attn_norm/scale"): "input_layernorm.weight",
    ("Q", "wq/kernel"): "self_attn.q_proj.weight",
    ("Q", "q_norm/scale"): "self_attn.q_norm.weight",
    ("K", "wk/kernel"): "self_attn.k_proj.weight",
    ("K", "k_norm/scale"): "self_attn.k_norm.weight",
    ("V", "wv/kernel"): "self_attn.v_proj.weight",
    ("OUT", "wo/kernel"): "self_attn.o_proj.weight",
    ("OUT", "post_attn_norm/scale"): "post_attention_layernorm.weight",
    ("MLP1", "ffn_norm/scale"): "pre_feedforward_layernorm.weight",
    ("MLP1", "w_gate/kernel"): "mlp.gate_proj.weight",
    ("MLP1", "w_up/kernel"): "mlp.up_proj.weight",
    ("MLP2", "w_down/kernel"): "mlp.down_proj.weight",
    ("MLP2", "post_ffn_norm/scale"): "post_feedforward_layernorm.weight",
}
HF_MODEL_NAMES = {(EMBED, "embedding"): "model.embed_tokens.weight",
                  (HEAD, "final_norm/scale"): "model.norm.weight",
                  (HEAD, "embedding"): "lm_head.weight"}
GGUF_LAYER_NAMES = {
    ("Q", "attn_norm/scale"): "attn_norm.weight", ("Q", "wq/kernel"): "attn_q.weight",
    ("Q", "q_norm/scale"): "attn_q_norm.weight", ("K", "wk/kernel"): "attn_k.weight",
    ("K", "k_norm/scale"): "attn_k_norm.weight", ("V", "wv/kernel"): "attn_v.weight",
    ("OUT", "wo/kernel"): "attn_output.weight",
    ("OUT", "post_attn_norm/scale"): "post_attention_norm.weight",
    ("MLP1", "ffn_norm/scale"): "ffn_norm.weight", ("MLP1", "w_gate/kernel"): "ffn_gate.weight",
    ("MLP1", "w_up/kernel"): "ffn_up.weight", ("MLP2", "w_down/kernel"): "ffn_down.weight",
    ("MLP2", "post_ffn_norm/scale"): "post_ffw_norm.weight",
}
# llama.cpp's Gemma 3 (``llama_model::load_hparams``, ``LLM_ARCH_GEMMA3``): every
# ``LLAMA_CPP_PERIOD``-th layer global where the file sets no pattern; the local RoPE base
# where it sets none; the layer count of Gemma 3 27B, whose attention scale is (D / H)^-1/2
LLAMA_CPP_PERIOD, LLAMA_CPP_LOCAL_THETA, LLAMA_CPP_27B_LAYERS = 6, 10_000.0, 62


def _rope(rope: Mapping[str, Any], where: str, kind: str
          ) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(theta, ``ModelSpec.rope_scaling``) of one layer type's RoPE parameters
    (``models.llama.rope_scaling``: default, linear or llama3, anything else refused)."""
    reader = ConfigReader({"rope_parameters": dict(rope)}, f"{where} ({kind} layers)")
    return rope_scaling(reader)


def layer_types(reader: ConfigReader, n_layers: int, family: str = "gemma3",
                period: int | None = None) -> tuple[str, ...]:
    """Each layer's type: the config's ``layer_types``, else transformers' pattern (every
    ``period``-th layer global, the rest local; Gemma 3's period its
    ``sliding_window_pattern``, 6 where unset, read past where ``layer_types`` decides).

    Raises:
      HxError: a type other than local or global, or a count other than the layers'.
    """
    kinds = reader.get("layer_types")
    if period is None:
        pattern = reader.get("sliding_window_pattern")
        period = int(pattern or DEFAULTS["sliding_window_pattern"])
    if kinds is None:
        return tuple(LOCAL if (i + 1) % period else GLOBAL for i in range(n_layers))
    unknown = sorted(set(kinds) - {LOCAL, GLOBAL})
    if unknown:
        raise HxError(f"{reader.where}: config.json's layer_types has {', '.join(unknown)}, "
                      f"which hx does not implement for {family} (it runs {LOCAL}, {GLOBAL})")
    if len(kinds) != n_layers:
        raise HxError(f"{reader.where}: config.json lists {len(kinds)} layer_types for "
                      f"{n_layers} layers")
    return tuple(kinds)


def gguf_layer_types(reader: MetadataReader, n_layers: int) -> tuple[str, ...]:
    """Each layer's type as llama.cpp's Gemma 3 sets it: no window (``attention.sliding_window``
    absent or 0): every layer global; else with the period p of
    ``attention.sliding_window_pattern`` (``LLAMA_CPP_PERIOD`` where unset) layer i local where
    i mod p < p - 1 (every layer where p is 0; ``llama_hparams::set_swa_pattern``).

    Raises:
      HxError: a pattern that is not one period (a list of layers).
    """
    window = int(reader.get("attention.sliding_window", 0))
    period = reader.get("attention.sliding_window_pattern", LLAMA_CPP_PERIOD)
    if not isinstance(period, int):
        raise HxError(f"{reader.where}: GGUF sets {reader.arch}.attention.sliding_window_pattern="
                      f"{period!r}; llama.cpp's gemma3, and hx, read one period")
    if not window:
        return (GLOBAL,) * n_layers
    return tuple(LOCAL if period == 0 or i % period < period - 1 else GLOBAL
                 for i in range(n_layers))


def typed_fields(kinds: tuple[str, ...], fields: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``ModelSpec`` fields of layers of types ``kinds`` whose ``LAYER_FIELDS`` by type are
    ``fields``: ``layer_types``, ``layer_overrides`` and, as the model's own, the global
    layers' fields (else the only type's); layers all of one type: that type's fields, no
    layer types."""
    overrides = tuple((kind, tuple(sorted(fields[kind].items()))) for kind in sorted(set(kinds)))
    model = fields[GLOBAL if GLOBAL in kinds else LOCAL]
    if len(overrides) == 1:  # the layers are alike
        return dict(model)
    return {"layer_types": kinds, "layer_overrides": overrides, **model}


def rope_by_type(reader: ConfigReader) -> dict[str, tuple[float, tuple]]:
    """Layer type -> (theta, scaling), as transformers' ``Gemma3TextConfig`` builds them:
    ``rope_parameters`` by layer type (transformers 5), the legacy ``rope_scaling`` applied to
    the global layers, the global theta from ``rope_theta`` and the local one from
    ``rope_local_base_freq`` where ``rope_parameters`` sets none (1e6 and 1e4 by default).

    Raises:
      HxError: ``rope_parameters`` not by layer type, or a RoPE hx does not implement.
    """
    params = dict(reader.get("rope_parameters", {}))
    unknown = sorted(set(params) - {LOCAL, GLOBAL})
    if unknown:
        raise HxError(f"{reader.where}: config.json's rope_parameters sets {', '.join(unknown)}; "
                      f"hx reads gemma3's RoPE by layer type ({LOCAL}, {GLOBAL})")
    full = dict(params.get(GLOBAL) or {"rope_type": "default"})
    full.update(reader.get("rope_scaling", {}))
    full.setdefault("rope_theta", float(reader.get("rope_theta", DEFAULTS["rope_theta"])))
    local = dict(params.get(LOCAL) or {"rope_type": "default"})
    local.setdefault("rope_theta", float(reader.get("rope_local_base_freq",
                                                     DEFAULTS["rope_local_base_freq"])))
    return {GLOBAL: _rope(full, reader.where, GLOBAL), LOCAL: _rope(local, reader.where, LOCAL)}


@dataclass(frozen=True)
class Gemma3Family(Family):
    """Gemma 3's text decoder (module docstring)."""

    # ``_sliding_window_pattern``: transformers writes it into every config.json it saves
    # and never reads it back (``Gemma3TextConfig.__post_init__`` reads the key without the
    # underscore); ``cache_implementation``: generate()'s cache class
    hf_ignored: ClassVar[frozenset] = frozenset({"_sliding_window_pattern",
                                                 "cache_implementation"})
    norm_identity: ClassVar[float] = 0.0  # x (1 + w)

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """Gemma 3's weights per op: Q the input norm (D,), wq (H, E, D) and q_norm (E,); K
        wk (K, E, D) and k_norm (E,); V wv (K, E, D); OUT wo (D, H, E) and the
        post-attention norm (D,); MLP1 the pre-feedforward norm (D,), gate and up (F, D);
        MLP2 down (D, F) and the post-feedforward norm (D,); HEAD the final norm and the
        table (tied in every released Gemma 3)."""
        D, H, K, E, F, V = (spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim,
                            spec.d_ff, spec.vocab_size)
        return {
            EMBED: {"embedding": (V, D)},
            "Q": {"attn_norm/scale": (D,), "wq/kernel": (H, E, D), "q_norm/scale": (E,)},
            "K": {"wk/kernel": (K, E, D), "k_norm/scale": (E,)},
            "V": {"wv/kernel": (K, E, D)},
            SCORE: {},
            "OUT": {"wo/kernel": (D, H, E), "post_attn_norm/scale": (D,)},
            "MLP1": {"ffn_norm/scale": (D,), "w_gate/kernel": (F, D), "w_up/kernel": (F, D)},
            "MLP2": {"w_down/kernel": (D, F), "post_ffn_norm/scale": (D,)},
            HEAD: {"final_norm/scale": (D,), "embedding": (V, D)},
        }

    def modules(self) -> Mapping[str, type]:
        return MODULES

    def spec_from_hf(self, config: Mapping[str, Any], where: str) -> ModelSpec:
        """The spec of a ``gemma3_text`` config.json (transformers' defaults where a field is
        left out): the global layers' window (none) and RoPE as the model's own fields, each
        layer type's in ``layer_overrides`` (the layers all of one type: that type's fields,
        no layer types).

        Raises:
          HxError: soft-capping, bidirectional attention, attention biases, another
            activation, a layer type or RoPE hx does not implement, or a field it does not
            know.
        """
        reader = ConfigReader(config, where, self.hf_ignored)
        d_model, n_heads = reader.need("hidden_size"), reader.need("num_attention_heads")
        n_layers = reader.need("num_hidden_layers")
        reader.expect("hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
        reader.expect("attention_bias", (False,), False)
        reader.expect("attn_logit_softcapping", (None,))
        reader.expect("final_logit_softcapping", (None,))
        reader.expect("use_bidirectional_attention", (False,), False)
        head_dim = reader.get("head_dim", DEFAULTS["head_dim"])
        scalar = float(reader.get("query_pre_attn_scalar", DEFAULTS["query_pre_attn_scalar"]))
        window = int(reader.get("sliding_window", DEFAULTS["sliding_window"]))
        kinds = layer_types(reader, n_layers)
        ropes = rope_by_type(reader)
        windows = {GLOBAL: None, LOCAL: window}
        fields = {kind: {"rope_theta": ropes[kind][0], "rope_scaling": ropes[kind][1],
                         "sliding_window": windows[kind]} for kind in (GLOBAL, LOCAL)}
        spec = ModelSpec(
            name=reader.get("_name_or_path") or where.rstrip("/").split("/")[-1],
            n_layers=n_layers, d_model=d_model, n_heads=n_heads,
            n_kv_heads=reader.get("num_key_value_heads", DEFAULTS["num_key_value_heads"]),
            head_dim=head_dim, d_ff=reader.need("intermediate_size"),
            vocab_size=reader.get("vocab_size", DEFAULTS["vocab_size"]),
            context_length=reader.get("max_position_embeddings",
                                      DEFAULTS["max_position_embeddings"]),
            norm_eps=float(reader.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])),
            tie_embeddings=bool(reader.get("tie_word_embeddings", True)), family=self.name,
            attention_scale=scalar ** -0.5, **typed_fields(kinds, fields))
        reader.finish()
        return spec

    def spec_from_gguf(self, meta: Mapping[str, Any], where: str, has_output: bool
                       ) -> ModelSpec:
        """The spec of a ``gemma3`` GGUF as llama.cpp reads it (module docstring): the
        global layers' RoPE base from ``rope.freq_base`` (10^4 where absent, as llama.cpp's
        default), their scaling from ``models.llama.gguf_rope_scaling`` (Gemma 3's linear
        factor); local layers (``gguf_layer_types``) with the window, ``rope.freq_base_swa``
        (``LLAMA_CPP_LOCAL_THETA`` where absent), unscaled; the attention scale by size
        (``LLAMA_CPP_27B_LAYERS``).

        Raises:
          HxError: a key missing, final-logit soft-capping, or a key hx does not implement
            (``MetadataReader``).
        """
        reader = MetadataReader(meta, where)
        d_model = int(reader.need("embedding_length"))
        n_heads = int(reader.need("attention.head_count"))
        n_layers = int(reader.need("block_count"))
        head_dim = int(reader.get("attention.key_length", d_model // n_heads))
        reader.expect("attention.value_length", (head_dim,), head_dim)
        reader.expect("rope.dimension_count", (head_dim,), head_dim)  # partial RoPE: refused
        reader.expect("final_logit_softcapping", (0.0,), 0.0)  # llama.cpp: 0 means none
        vocab = reader.get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scale = (d_model / n_heads if n_layers == LLAMA_CPP_27B_LAYERS else head_dim) ** -0.5
        fields = {GLOBAL: {"rope_theta": float(reader.get("rope.freq_base", 10000.0)),
                           "rope_scaling": gguf_rope_scaling(reader, head_dim),
                           "sliding_window": None},
                  LOCAL: {"rope_theta": float(reader.get("rope.freq_base_swa",
                                                         LLAMA_CPP_LOCAL_THETA)),
                          "rope_scaling": (),
                          "sliding_window": int(reader.get("attention.sliding_window", 0))}}
        spec = ModelSpec(
            name=str(meta.get("general.name", where.rstrip("/").split("/")[-1])),
            n_layers=n_layers, d_model=d_model, n_heads=n_heads,
            n_kv_heads=int(reader.get("attention.head_count_kv", n_heads)), head_dim=head_dim,
            d_ff=int(reader.need("feed_forward_length")), vocab_size=int(vocab),
            context_length=int(reader.need("context_length")),
            norm_eps=float(reader.need("attention.layer_norm_rms_epsilon")),
            tie_embeddings=not has_output, family=self.name, attention_scale=scale,
            **typed_fields(gguf_layer_types(reader, n_layers), fields))
        reader.finish()
        return spec

    def gguf_offset(self, path: str) -> float:
        """1 for every norm: llama.cpp's converter adds it to each tensor named
        ``*norm.weight`` (``Gemma3Model.norm_shift``), storing Gemma's x (1 + w) as x w'."""
        return 1.0 if path.endswith("norm/scale") else 0.0


FAMILY = Gemma3Family(name="gemma3", hf_model_types=("gemma3_text",),
                      gguf_architectures=("gemma3",), hf_layer_names=HF_LAYER_NAMES,
                      hf_model_names=HF_MODEL_NAMES, gguf_layer_names=GGUF_LAYER_NAMES,
                      gguf_model_names=GGUF_MODEL_NAMES)
