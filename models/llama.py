"""The Llama family: Llama-2, Llama-3/3.1/3.2, SmolLM2 -- and the layer Mistral, Qwen2, Qwen3 and
Phi-3 share with it (their modules subclass ``LlamaFamily`` and change what differs).

A layer onto the seven ops (axis letters as in ``models.layers``):

  =======  ============================================  ===========================
  op       computes                                      reads -> writes
  =======  ============================================  ===========================
  EMBED    token-embedding lookup                        tokens -> x
  Q        attention RMSNorm, q projection [+ bias],     x -> h, q
           [q RMSNorm,] RoPE(q)
  K        k projection [+ bias], [k RMSNorm,] RoPE(k)   h -> k
  V        v projection [+ bias]                         h -> v
  SCORE    KV-cache append, softmax(q k^T / sqrt(E)) v   q, k, v (+cache) -> o
  OUT      output projection, residual add               o, x -> x
  MLP1     FFN RMSNorm, gate and up projections, SiLU    x -> a
  MLP2     down projection, residual add                 a, x -> x
  HEAD     final RMSNorm, LM head on the last position   x -> logits
  =======  ============================================  ===========================

RoPE's frequencies follow the config's ``rope_scaling`` (``inv_frequencies``): none, ``linear``
(positions divided by the factor) or ``llama3`` (Llama 3.1's: long wavelengths divided by the
factor, short ones kept, a smooth ramp between). Any other scaling is refused at load. A GGUF
carries Llama 3.1's scaling as llama.cpp's converter computed it, one factor per frequency
(``rope_freqs.weight``; ``frequency_factors``), which hx applies as llama.cpp does: each
frequency divided by its factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn

from hx.errors import HxError
from hx.models.family import ROPE_FREQS, ConfigReader, Family, GraphLayer, MetadataReader
from hx.models.layers import (RMSNorm, ScoreOp, Step, WeightedOp, dense, held_dtype,
                              inv_frequencies as base_frequencies, lm_head, lookup, rope)
from hx.models.ops import EMBED, HEAD, SCORE
from hx.models.spec import ModelSpec, MoeShape, feed_forward_fields

ROPE_TYPES = ("default", "linear", "llama3")
# YaRN (Peng et al. 2023, arXiv:2309.00071), read where a family applies its attention factors
# (``yarn_factors``: DeepSeek-V2's), with transformers' defaults of its optional fields
YARN, YARN_DEFAULTS = "yarn", {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0,
                               "mscale_all_dim": 0.0, "truncate": True}


def inv_frequencies(spec: ModelSpec) -> jax.Array:
    """RoPE's inverse frequencies (E/2,) float32 for ``spec``: theta^(-2i/E), scaled by
    ``spec.rope_scaling``. ``linear``: divided by ``factor``. ``llama3`` (Meta's Llama 3.1
    ``apply_scaling``; transformers' ``_compute_llama3_parameters``): with wavelengths
    2 pi / f, those longer than ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, those shorter than ``original / high_freq_factor`` kept, and between
    them f interpolates as (1 - s) f / factor + s f, s = (original / wavelength - low) /
    (high - low). ``frequency_factors`` (a GGUF's, ``gguf_rope_scaling``): f divided by
    ``factors`` (E/2,), llama.cpp's ``ggml_rope_ext`` with frequency factors -- the llama3
    ramp, where the converter computed them from it."""
    inv = base_frequencies(spec.head_dim, spec.rope_theta)
    scaling = dict(spec.rope_scaling)
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor",
                                                   "high_freq_factor"))
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv
        scaled = jnp.where(wavelength > original / low, inv / factor, inv)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return jnp.where(medium, smoothed, scaled)
    if kind == "frequency_factors":
        return inv / jnp.asarray(scaling["factors"], jnp.float32)
    if kind == YARN:
        return yarn_frequencies(inv, spec.head_dim, spec.rope_theta, scaling)
    return inv


def yarn_frequencies(inv: jax.Array, dim: int, theta: float, scaling: dict) -> jax.Array:
    """YaRN's inverse frequencies (Peng et al. 2023, §3.2 "NTK-by-parts"; transformers'
    ``_compute_yarn_parameters``): each of ``inv`` (E/2,) kept where its wavelength turns more
    than ``beta_fast`` times over ``original_max_position_embeddings``, divided by ``factor``
    where it turns fewer than ``beta_slow`` times, and a linear ramp between over the
    dimension index, whose ends are d(r) = E log(original / (2 pi r)) / (2 log theta),
    floored and ceiled where ``truncate``."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(scaling["beta_fast"]), correction(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low)
                    / ((high + 0.001 if high == low else high) - low), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_factors(spec: ModelSpec) -> tuple[float, float]:
    """(rotated-part factor, softmax factor) of ``spec``'s YaRN (1, 1 without): every rotated
    element of q and k is multiplied by the first (transformers' ``attention_factor``:
    m(factor, mscale) / m(factor, mscale_all_dim) where both are set, else m(factor), with
    m(s, c) = 0.1 c ln s + 1 for s > 1, else 1), and the softmax scale by the second (DeepSeek's
    ``yarn_apply_mscale``: m(factor, mscale_all_dim)^2 where that is set)."""
    scaling = dict(spec.rope_scaling)
    if scaling.get("rope_type") != YARN:
        return 1.0, 1.0
    factor, mscale, whole = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]

    def m(c: float) -> float:
        return 0.1 * c * math.log(factor) + 1.0 if factor > 1 else 1.0

    rotated = m(mscale) / m(whole) if mscale and whole else m(1.0)
    return rotated, m(whole) ** 2 if whole else 1.0


def rope_scaling(reader: ConfigReader, kinds: tuple[str, ...] = ROPE_TYPES
                 ) -> tuple[tuple[str, Any], ...]:
    """(rope_theta, ``ModelSpec.rope_scaling``) from a config's ``rope_parameters``
    (transformers 5) or ``rope_theta`` + ``rope_scaling`` (earlier files), of a RoPE type in
    ``kinds`` (``YARN`` only where the family applies ``yarn_factors``).

    Raises:
      HxError: a RoPE type hx does not implement (``kinds``), or a field of it hx does not
        read.
    """
    params = dict(reader.get("rope_parameters", {}))
    legacy = dict(reader.get("rope_scaling", {}))
    theta = float(params.pop("rope_theta", reader.get("rope_theta", 10000.0)))
    params = {**legacy, **params}
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in kinds:
        raise HxError(f"{reader.where}: config.json sets rope_type={kind!r}, which hx does not "
                      f"implement here (it runs {', '.join(kinds)})")
    wanted = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"),
              YARN: ("factor", "original_max_position_embeddings", *YARN_DEFAULTS)}[kind]
    if kind == YARN:
        params = {**YARN_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    missing = [k for k in wanted if k not in params]
    if missing:
        raise HxError(f"{reader.where}: config.json's RoPE {kind} lacks {', '.join(missing)}")
    if params.get("partial_rotary_factor", 1.0) == 1.0:  # every dim rotates: what hx runs
        params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - set(wanted))
    if unknown:
        raise HxError(f"{reader.where}: config.json's RoPE {kind} sets {', '.join(unknown)}, "
                      "which hx does not implement")
    if kind == "default":
        return theta, ()
    return theta, tuple(sorted({"rope_type": kind, **{
        k: params[k] if k == "truncate" else float(params[k]) for k in wanted}}.items()))


def gguf_rope_scaling(reader: MetadataReader, head_dim: int, frequency_factors: bool = False
                      ) -> tuple[tuple[str, Any], ...]:
    """``ModelSpec.rope_scaling`` of a GGUF, as llama.cpp reads it (``llama_model::
    load_hparams``): ``rope.scaling.factor`` (``rope.scale_linear`` in older files) divides the
    positions (linear scaling, for ``rope.scaling.type`` ``linear`` -- its default -- or
    ``none`` alike); with ``frequency_factors`` (llama.cpp's ``llama`` graph), a
    ``rope_freqs.weight`` (E/2,) divides each frequency by its factor (Llama 3.1's scaling as
    the converter computed it, ``inv_frequencies``); elsewhere llama.cpp loads no such tensor,
    and hx refuses it (``MetadataReader.finish``). ``rope.scaling.original_context_length`` is
    read past: llama.cpp passes it to ``ggml_rope_ext`` for YaRN's ramp alone, and hx refuses
    YaRN.

    Raises:
      HxError: another scaling type (YaRN, LongRoPE), factors of another length, or factors
        beside a linear factor.
    """
    reader.expect("rope.scaling.type", ("linear", "none"), "linear")
    reader.get("rope.scaling.original_context_length")
    factor = float(reader.get("rope.scaling.factor", reader.get("rope.scale_linear", 0.0)))
    linear = factor not in (0.0, 1.0)  # llama.cpp: freq_scale = 1 / factor, 0 meaning none
    factors = reader.tensor(ROPE_FREQS) if frequency_factors else None
    if factors is None:
        return (("factor", factor), ("rope_type", "linear")) if linear else ()
    if len(factors) != head_dim // 2 or linear:
        raise HxError(f"{reader.where}: GGUF holds {ROPE_FREQS} of {len(factors)} factors"
                      f"{' beside a linear factor' if linear else ''}; hx implements "
                      f"{head_dim // 2} (one per frequency) alone")
    return (("factors", tuple(map(float, factors))), ("rope_type", "frequency_factors"))


class EmbedOp(WeightedOp):
    """EMBED: tokens (B, T) int32 -> x (B, T, D); in a pipeline stage after the first
    (``ModelSpec.embeds`` False) the previous stage's x (B, T, D), passed on."""

    @nn.compact
    def __call__(self, tokens: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        if not s.embeds:
            return (tokens,)
        return (lookup(self, "embedding", tokens, s.vocab_size, s.embedding_format),)


def project_heads(module: WeightedOp, x: jax.Array, name: str, heads: int, step: Step,
           rotate: bool) -> jax.Array:
    """x (B, T, D) projected by ``name`` into (B, T, heads, E) in float32 -- plus the bias
    where the family has one (Qwen2), RMSNorm over E where it has one (Qwen3's q_norm,
    k_norm), then RoPE where ``rotate``, times YaRN's attention factor (``yarn_factors``; 1
    without) -- in the model's dtype."""
    s, fam = module.spec, module.spec.model_family
    y = dense(module, (heads, s.head_dim), name=f"w{name}", use_bias=fam.qkv_bias)(x)
    if fam.qk_norm and rotate and fam.qk_norm_whole:  # over the whole projection (OLMoE)
        y = RMSNorm(s.norm_eps, held_dtype(module), name=f"{name}_norm")(
            y.reshape(*y.shape[:-2], -1)).reshape(y.shape)
    elif fam.qk_norm and rotate:
        y = RMSNorm(s.norm_eps, held_dtype(module), name=f"{name}_norm")(y)
    if rotate:
        y = rope(y, step.positions, inv_frequencies(s)).astype(jnp.float32) * yarn_factors(s)[0]
    return y.astype(s.dtype)


class QOp(WeightedOp):
    """Q: x (B,T,D) -> h = RMSNorm(x) (B,T,D), q = RoPE(h Wq [+ bq]) (B,T,H,E)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array, jax.Array]:
        s = self.spec
        h = RMSNorm(s.norm_eps, held_dtype(self), name="attn_norm")(x)
        return h, project_heads(self, h, "q", s.n_heads, step, rotate=True)


class KOp(WeightedOp):
    """K: h (B,T,D) -> k = RoPE(h Wk [+ bk]) (B,T,K,E)."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        return (project_heads(self, h, "k", self.spec.n_kv_heads, step, rotate=True),)


class VOp(WeightedOp):
    """V: h (B,T,D) -> v = h Wv [+ bv] (B,T,K,E)."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        return (project_heads(self, h, "v", self.spec.n_kv_heads, step, rotate=False),)


class OutOp(WeightedOp):
    """OUT: o (B,T,H,E), x (B,T,D) -> x + o Wo (B,T,D)."""

    @nn.compact
    def __call__(self, o: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        y = dense(self, self.spec.d_model, axis=(-2, -1), name="wo")(o)  # 'BTHE,DHE->BTD'
        return ((x.astype(jnp.float32) + y).astype(self.spec.dtype),)


class Mlp1Op(WeightedOp):
    """MLP1: x (B,T,D) -> a = SiLU(n Wgate) * (n Wup) (B,T,F), n = RMSNorm(x) (SwiGLU;
    Shazeer 2020)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        n = RMSNorm(s.norm_eps, held_dtype(self), name="ffn_norm")(x)
        gate = dense(self, s.d_ff, name="w_gate")(n)  # 'BTD,FD->BTF'
        up = dense(self, s.d_ff, name="w_up")(n)
        return ((jax.nn.silu(gate) * up).astype(s.dtype),)


class Mlp2Op(WeightedOp):
    """MLP2: a (B,T,F), x (B,T,D) -> x + a Wdown (B,T,D)."""

    @nn.compact
    def __call__(self, a: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        y = dense(self, self.spec.d_model, name="w_down")(a)  # 'BTF,DF->BTD'
        return ((x.astype(jnp.float32) + y).astype(self.spec.dtype),)


class HeadOp(WeightedOp):
    """HEAD: x (B,T,D) -> logits (B,V) float32 of the last position (final RMSNorm, LM head);
    in a pipeline stage before the last (``ModelSpec.heads`` False) x itself, every position,
    for the next stage. ``norm_offset``: the final norm's (``layers.RMSNorm``; Gemma's 1)."""

    norm_offset: ClassVar[float] = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        if not s.heads:
            return (x,)
        n = RMSNorm(s.norm_eps, held_dtype(self), self.norm_offset,
                    name="final_norm")(x[:, -1])  # (B,D)
        return (lm_head(self, n),)


MODULES = {EMBED: EmbedOp, "Q": QOp, "K": KOp, "V": VOp, SCORE: ScoreOp, "OUT": OutOp,
           "MLP1": Mlp1Op, "MLP2": Mlp2Op, HEAD: HeadOp}

HF_LAYER_NAMES = {
    ("Q", "attn_norm/scale"): "input_layernorm.weight",
    ("Q", "wq/kernel"): "self_attn.q_proj.weight", ("Q", "wq/bias"): "self_attn.q_proj.bias",
    ("Q", "q_norm/scale"): "self_attn.q_norm.weight",
    ("K", "wk/kernel"): "self_attn.k_proj.weight", ("K", "wk/bias"): "self_attn.k_proj.bias",
    ("K", "k_norm/scale"): "self_attn.k_norm.weight",
    ("V", "wv/kernel"): "self_attn.v_proj.weight", ("V", "wv/bias"): "self_attn.v_proj.bias",
    ("OUT", "wo/kernel"): "self_attn.o_proj.weight",
    ("MLP1", "ffn_norm/scale"): "post_attention_layernorm.weight",
    ("MLP1", "w_gate/kernel"): "mlp.gate_proj.weight",
    ("MLP1", "w_up/kernel"): "mlp.up_proj.weight",
    ("MLP2", "w_down/kernel"): "mlp.down_proj.weight",
}
HF_MODEL_NAMES = {(EMBED, "embedding"): "model.embed_tokens.weight",
                  (HEAD, "final_norm/scale"): "model.norm.weight",
                  (HEAD, "embedding"): "lm_head.weight"}
GGUF_LAYER_NAMES = {
    ("Q", "attn_norm/scale"): "attn_norm.weight", ("Q", "wq/kernel"): "attn_q.weight",
    ("Q", "wq/bias"): "attn_q.bias", ("Q", "q_norm/scale"): "attn_q_norm.weight",
    ("K", "wk/kernel"): "attn_k.weight", ("K", "wk/bias"): "attn_k.bias",
    ("K", "k_norm/scale"): "attn_k_norm.weight",
    ("V", "wv/kernel"): "attn_v.weight", ("V", "wv/bias"): "attn_v.bias",
    ("OUT", "wo/kernel"): "attn_output.weight", ("MLP1", "ffn_norm/scale"): "ffn_norm.weight",
    ("MLP1", "w_gate/kernel"): "ffn_gate.weight", ("MLP1", "w_up/kernel"): "ffn_up.weight",
    ("MLP2", "w_down/kernel"): "ffn_down.weight",
}
GGUF_MODEL_NAMES = {(EMBED, "embedding"): "token_embd.weight",
                    (HEAD, "final_norm/scale"): "output_norm.weight",
                    (HEAD, "embedding"): "output.weight"}


@dataclass(frozen=True)
class LlamaFamily(Family):
    """Llama's layer (module docstring), with the switches its relatives turn on.

    Attributes:
      qkv_bias: Q, K and V add a bias ((H, E), (K, E), (K, E)) before RoPE (Qwen2).
      qk_norm: q and k are RMS-normed per head before RoPE (Qwen3: ``q_norm``, ``k_norm``,
        (E,) each).
      qk_norm_whole: with ``qk_norm``, each norm is over the whole projection, (H E,) and
        (K E,), not per head (OLMoE).
      rope_freqs: its GGUF may hold ``rope_freqs.weight`` (llama.cpp's ``llama``
        architecture: Llama 3.1's scaling; ``gguf_rope_scaling``).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False
    rope_freqs: bool = False
    # the family a GGUF of this architecture with experts is (llama.cpp's ``llama`` files hold
    # Mixtral's), and whether its graph renormalises the top k (``read_gguf_moe``)
    gguf_moe_family: str | None = None
    gguf_norm_top_k: bool = True
    # ``pretraining_tp`` splits the products of Meta's training into slices whose sums
    # transformers adds back in the same order (tests/test_families.py proves it)
    hf_ignored: ClassVar[frozenset] = frozenset({"pretraining_tp"})
    # the RoPE types its config may set (``rope_scaling``)
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """Llama's weights per op (paths as in ``models.family``): Q holds the attention norm
        and wq (H, E, D), K and V wk, wv (K, E, D), OUT wo (D, H, E), MLP1 the FFN norm, gate
        and up (F, D), MLP2 down (D, F), HEAD the final norm and the table; with ``qkv_bias``
        biases (H, E), (K, E), (K, E), with ``qk_norm`` q_norm and k_norm (E,) (with
        ``qk_norm_whole`` (H E,) and (K E,))."""
        D, H, K, E, F, V = (spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim,
                            spec.d_ff, spec.vocab_size)
        shapes = {
            EMBED: {"embedding": (V, D)},
            "Q": {"attn_norm/scale": (D,), "wq/kernel": (H, E, D)},
            "K": {"wk/kernel": (K, E, D)},
            "V": {"wv/kernel": (K, E, D)},
            SCORE: {},
            "OUT": {"wo/kernel": (D, H, E)},
            "MLP1": {"ffn_norm/scale": (D,), "w_gate/kernel": (F, D), "w_up/kernel": (F, D)},
            "MLP2": {"w_down/kernel": (D, F)},
            HEAD: {"final_norm/scale": (D,), "embedding": (V, D)},
        }
        if self.qkv_bias:
            shapes["Q"]["wq/bias"], shapes["K"]["wk/bias"], shapes["V"]["wv/bias"] = (
                (H, E), (K, E), (K, E))
        if self.qk_norm:
            whole = self.qk_norm_whole
            shapes["Q"]["q_norm/scale"] = (H * E,) if whole else (E,)
            shapes["K"]["k_norm/scale"] = (K * E,) if whole else (E,)
        return shapes

    def modules(self) -> Mapping[str, type]:
        return MODULES

    def graph_layer(self, spec: ModelSpec) -> GraphLayer | None:
        """Llama's layer with this family's switches (``GraphLayer``)."""
        return GraphLayer(self.qkv_bias, self.qk_norm, inv_frequencies, self.qk_norm_whole)

    def read_window(self, reader: ConfigReader) -> int | None:
        """The sliding window a config sets (None: none); the Llama config has none."""
        return None

    def read_attention(self, reader: ConfigReader, n_layers: int) -> dict[str, Any]:
        """The ``ModelSpec`` fields of how the layers attend: ``sliding_window``
        (``read_window``)."""
        return {"sliding_window": self.read_window(reader)}

    def spec_from_hf(self, config: Mapping[str, Any], where: str) -> ModelSpec:
        reader = ConfigReader(config, where, self.hf_ignored)
        d_model, n_heads = reader.need("hidden_size"), reader.need("num_attention_heads")
        reader.expect("hidden_act", ("silu",), "silu")
        reader.expect("attention_bias", (self.qkv_bias,), self.qkv_bias)
        reader.expect("mlp_bias", (False,), False)
        theta, scaling = rope_scaling(reader, self.rope_types)
        n_layers, moe = reader.need("num_hidden_layers"), self.read_moe(reader)
        spec = ModelSpec(
            name=reader.get("_name_or_path") or where.rstrip("/").split("/")[-1],
            n_layers=n_layers, d_model=d_model, n_heads=n_heads,
            **self.read_heads(reader, d_model, n_heads), d_ff=reader.need("intermediate_size"),
            vocab_size=reader.need("vocab_size"),
            context_length=reader.get("max_position_embeddings", 2048), rope_theta=theta,
            norm_eps=float(reader.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(reader.get("tie_word_embeddings", False)),
            family=self.name, rope_scaling=scaling, **self.read_attention(reader, n_layers),
            **feed_forward_fields(n_layers, self.read_dense_layers(reader, n_layers), moe))
        reader.finish()
        return spec

    def read_heads(self, reader: ConfigReader, d_model: int, n_heads: int) -> dict[str, Any]:
        """The ``ModelSpec`` fields of attention's heads: ``num_key_value_heads`` (else the
        query heads) and ``head_dim`` (else D / H)."""
        return {"n_kv_heads": reader.get("num_key_value_heads", n_heads),
                "head_dim": reader.get("head_dim", d_model // n_heads)}

    def read_moe(self, reader: ConfigReader) -> MoeShape | None:
        """The config's Mixture-of-Experts shape (``models.moe``); None: Llama's dense MLP."""
        return None

    def read_dense_layers(self, reader: ConfigReader, n_layers: int) -> tuple[int, ...]:
        """The layers of an MoE model whose feed-forward part is a dense MLP; none here."""
        return ()

    def read_gguf_moe(self, reader: MetadataReader, d_ff: int) -> MoeShape | None:
        """The Mixture-of-Experts shape of a GGUF, as llama.cpp reads it: ``expert_count``
        experts (none: a dense MLP), ``expert_used_count`` of them per token, each of
        ``expert_feed_forward_length`` (else ``d_ff``: Mixtral's, in a ``llama`` file), a shared
        expert of ``expert_shared_feed_forward_length`` (0: none), the top k renormalised as
        the architecture's graph does (``gguf_norm_top_k``: llama.cpp reads no key for it).

        Raises:
          HxError: experts in an architecture hx runs none for (``gguf_moe_family``), or
            ``expert_weights_scale`` other than 1.
        """
        experts = int(reader.get("expert_count", 0))
        if not experts:
            return None
        if self.gguf_moe_family is None:
            raise HxError(f"{reader.where}: GGUF sets {reader.arch}.expert_count={experts}; hx "
                          f"runs no experts in {reader.arch} files")
        reader.expect("expert_weights_scale", (1.0,), 1.0)
        return MoeShape(experts=experts, top_k=int(reader.need("expert_used_count")),
                        d_expert=int(reader.get("expert_feed_forward_length", d_ff)),
                        d_shared=int(reader.get("expert_shared_feed_forward_length", 0)),
                        norm_top_k=self.gguf_norm_top_k)

    def read_gguf_window(self, reader: MetadataReader) -> int | None:
        """The sliding window a GGUF sets (None: none). llama.cpp's ``llama`` architecture
        reads none (its converter writes Mistral's checkpoints as ``llama`` files without their
        window, ``models.mistral``), so ``attention.sliding_window`` is refused here
        (``MetadataReader.finish``)."""
        return None

    def spec_from_gguf(self, meta: Mapping[str, Any], where: str, has_output: bool
                       ) -> ModelSpec:
        """The spec of a ``llama``, ``qwen2``, ``qwen3`` or ``phi3`` GGUF, read as llama.cpp
        reads it: the head dim from ``attention.key_length`` (else D / H), RoPE over all of it,
        the base from ``rope.freq_base`` (10^4 where absent), scaling from
        ``gguf_rope_scaling``, the vocabulary from ``vocab_size`` (else the token list), the
        window from ``read_gguf_window``; the HEAD table tied where the file has no
        ``output.weight``.

        Raises:
          HxError: a key missing, or one hx does not implement (``MetadataReader``).
        """
        reader = MetadataReader(meta, where)
        d_model = int(reader.need("embedding_length"))
        n_heads = int(reader.need("attention.head_count"))
        head_dim = int(reader.get("attention.key_length", d_model // n_heads))
        reader.expect("attention.value_length", (head_dim,), head_dim)
        reader.expect("rope.dimension_count", (head_dim,), head_dim)  # partial RoPE: refused
        vocab = reader.get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        spec = ModelSpec(
            name=str(meta.get("general.name", where.rstrip("/").split("/")[-1])),
            n_layers=int(reader.need("block_count")), d_model=d_model, n_heads=n_heads,
            n_kv_heads=int(reader.get("attention.head_count_kv", n_heads)), head_dim=head_dim,
            d_ff=int(reader.need("feed_forward_length")), vocab_size=int(vocab),
            context_length=int(reader.need("context_length")),
            rope_theta=float(reader.get("rope.freq_base", 10000.0)),
            norm_eps=float(reader.need("attention.layer_norm_rms_epsilon")),
            tie_embeddings=not has_output, family=self.name,
            sliding_window=self.read_gguf_window(reader),
            rope_scaling=gguf_rope_scaling(reader, head_dim, self.rope_freqs))
        moe = self.read_gguf_moe(reader, spec.d_ff)
        if moe is not None:
            spec = spec.replace(family=self.gguf_moe_family, moe=moe)
        reader.finish()
        return spec

    def hf_config(self, spec: ModelSpec) -> dict:
        """``config.json`` of a ``LlamaForCausalLM`` of ``spec``'s shapes (untied)."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": spec.d_model, "intermediate_size": spec.d_ff,
                "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
                "num_key_value_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
                "vocab_size": spec.vocab_size, "max_position_embeddings": spec.context_length,
                "rope_theta": spec.rope_theta, "rms_norm_eps": spec.norm_eps,
                "tie_word_embeddings": False, "torch_dtype": spec.dtype,
                "_name_or_path": f"random {spec.name} shapes"}


FAMILY = LlamaFamily(
    name="llama", hf_model_types=("llama",), gguf_architectures=("llama",),
    hf_layer_names=HF_LAYER_NAMES, hf_model_names=HF_MODEL_NAMES,
    gguf_layer_names=GGUF_LAYER_NAMES, gguf_model_names=GGUF_MODEL_NAMES,
    gguf_rope_permuted=("wq/kernel", "wk/kernel"), rope_freqs=True, gguf_moe_family="mixtral")
