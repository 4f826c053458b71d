"""The OPT family (Zhang et al. 2022; the models of every FlexGen result): a pre-LayerNorm
decoder with learned positions, biases on every projection and a ReLU MLP of two matrices.

A layer onto the seven ops (axis letters as in ``models.layers``):

  =======  ============================================  ===========================
  op       computes                                      reads -> writes
  =======  ============================================  ===========================
  EMBED    token embedding + learned position            tokens -> x
           embedding (row position + 2: OPT's offset)
  Q        attention LayerNorm, q projection + bias      x -> h, q
  K, V     k, v projections + biases                     h -> k, v
  SCORE    KV-cache append, softmax(q k^T / sqrt(E)) v   q, k, v (+cache) -> o
  OUT      output projection + bias, residual add        o, x -> x
  MLP1     FFN LayerNorm, fc1 + bias, ReLU               x -> a
  MLP2     fc2 + bias, residual add                      a, x -> x
  HEAD     final LayerNorm, LM head (the embedding)      x -> logits
  =======  ============================================  ===========================

OPT scales q by 1/sqrt(E) after its projection; hx scales the scores, the same product. Only
the pre-LayerNorm layout of OPT-125M and OPT-1.3B to 175B runs: OPT-350M's post-LayerNorm layer
and projected embeddings (``do_layer_norm_before`` False, ``word_embed_proj_dim`` != hidden)
are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn

from hx.models.family import ConfigReader, Family
from hx.models.layers import (LayerNorm, ScoreOp, Step, WeightedOp, dense, held_dtype,
                              lm_head, lookup)
from hx.models.ops import EMBED, HEAD, SCORE
from hx.models.spec import ModelSpec

POSITION_OFFSET = 2  # OPT's learned positions start at row 2 (HF OPTLearnedPositionalEmbedding)
NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which OPT keeps


class EmbedOp(WeightedOp):
    """EMBED: tokens (B, T) int32 -> x = table[tokens] + positions[position + 2] (B, T, D);
    in a later pipeline stage the previous stage's x, passed on."""

    @nn.compact
    def __call__(self, tokens: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        if not s.embeds:
            return (tokens,)
        rows = s.context_length + POSITION_OFFSET
        at = jnp.clip(step.positions + POSITION_OFFSET, 0, rows - 1)  # padding: any valid row
        x = (lookup(self, "embedding", tokens, s.vocab_size, s.embedding_format)
             .astype(jnp.float32)
             + lookup(self, "positions", at, rows, s.embedding_format).astype(jnp.float32))
        return (x.astype(s.dtype),)


class QOp(WeightedOp):
    """Q: x (B,T,D) -> h = LayerNorm(x) (B,T,D), q = h Wq + bq (B,T,H,E)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array, jax.Array]:
        s = self.spec
        h = LayerNorm(s.norm_eps, held_dtype(self), name="attn_norm")(x)
        q = dense(self, (s.n_heads, s.head_dim), name="wq", use_bias=True)(h)
        return h, q.astype(s.dtype)


def _kv_heads(module: WeightedOp, h: jax.Array, name: str) -> jax.Array:
    """h (B,T,D) projected by ``name`` (wk or wv) with its bias into (B,T,K,E), the model's
    dtype."""
    s = module.spec
    return dense(module, (s.n_kv_heads, s.head_dim), name=name, use_bias=True)(h).astype(s.dtype)


class KOp(WeightedOp):
    """K: h (B,T,D) -> k = h Wk + bk (B,T,K,E)."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        return (_kv_heads(self, h, "wk"),)


class VOp(WeightedOp):
    """V: h (B,T,D) -> v = h Wv + bv (B,T,K,E)."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        return (_kv_heads(self, h, "wv"),)


class OutOp(WeightedOp):
    """OUT: o (B,T,H,E), x (B,T,D) -> x + o Wo + bo (B,T,D)."""

    @nn.compact
    def __call__(self, o: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        y = dense(self, self.spec.d_model, axis=(-2, -1), name="wo", use_bias=True)(o)
        return ((x.astype(jnp.float32) + y).astype(self.spec.dtype),)


class Mlp1Op(WeightedOp):
    """MLP1: x (B,T,D) -> a = ReLU(LayerNorm(x) W1 + b1) (B,T,F)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        n = LayerNorm(s.norm_eps, held_dtype(self), name="ffn_norm")(x)
        return (jax.nn.relu(dense(self, s.d_ff, name="w_up", use_bias=True)(n))
                .astype(s.dtype),)


class Mlp2Op(WeightedOp):
    """MLP2: a (B,T,F), x (B,T,D) -> x + a W2 + b2 (B,T,D)."""

    @nn.compact
    def __call__(self, a: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        y = dense(self, self.spec.d_model, name="w_down", use_bias=True)(a)
        return ((x.astype(jnp.float32) + y).astype(self.spec.dtype),)


class HeadOp(WeightedOp):
    """HEAD: x (B,T,D) -> logits (B,V) float32 of the last position (final LayerNorm, the
    embedding as LM head); in a pipeline stage before the last, x itself."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        if not s.heads:
            return (x,)
        n = LayerNorm(s.norm_eps, held_dtype(self), name="final_norm")(x[:, -1])
        return (lm_head(self, n),)


MODULES = {EMBED: EmbedOp, "Q": QOp, "K": KOp, "V": VOp, SCORE: ScoreOp, "OUT": OutOp,
           "MLP1": Mlp1Op, "MLP2": Mlp2Op, HEAD: HeadOp}

_LAYER = {"attn_norm": "self_attn_layer_norm", "wq": "self_attn.q_proj",
          "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.out_proj",
          "ffn_norm": "final_layer_norm", "w_up": "fc1", "w_down": "fc2"}
_PARAM = {"kernel": "weight", "scale": "weight", "bias": "bias"}
_MODEL = {(EMBED, "embedding"): "model.decoder.embed_tokens.weight",
          (EMBED, "positions"): "model.decoder.embed_positions.weight",
          (HEAD, "final_norm/scale"): "model.decoder.final_layer_norm.weight",
          (HEAD, "final_norm/bias"): "model.decoder.final_layer_norm.bias",
          (HEAD, "embedding"): "lm_head.weight"}


@dataclass(frozen=True)
class OptFamily(Family):
    """OPT (module docstring)."""

    # dropout rates and the initialiser's deviation: training only
    hf_ignored: ClassVar[frozenset] = frozenset({"dropout", "layerdrop", "init_std"})

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """OPT's weights per op: EMBED the table and the learned positions (context + 2
        rows); Q the attention LayerNorm, wq (H, E, D) and its bias; K, V likewise; OUT wo
        (D, H, E) and bias (D,); MLP1 the FFN LayerNorm, fc1 (F, D) as ``w_up`` and its bias;
        MLP2 fc2 (D, F) as ``w_down`` and bias; HEAD the final LayerNorm and the table (tied
        in every released OPT)."""
        D, H, E, F, V = spec.d_model, spec.n_heads, spec.head_dim, spec.d_ff, spec.vocab_size
        K = spec.n_kv_heads
        norm = lambda name: {f"{name}/scale": (D,), f"{name}/bias": (D,)}  # noqa: E731
        return {
            EMBED: {"embedding": (V, D),
                    "positions": (spec.context_length + POSITION_OFFSET, D)},
            "Q": {**norm("attn_norm"), "wq/kernel": (H, E, D), "wq/bias": (H, E)},
            "K": {"wk/kernel": (K, E, D), "wk/bias": (K, E)},
            "V": {"wv/kernel": (K, E, D), "wv/bias": (K, E)},
            SCORE: {},
            "OUT": {"wo/kernel": (D, H, E), "wo/bias": (D,)},
            "MLP1": {**norm("ffn_norm"), "w_up/kernel": (F, D), "w_up/bias": (F,)},
            "MLP2": {"w_down/kernel": (D, F), "w_down/bias": (D,)},
            HEAD: {**norm("final_norm"), "embedding": (V, D)},
        }

    def modules(self) -> Mapping[str, type]:
        return MODULES

    def hf_name(self, layer: int | None, op: str, path: str) -> str:
        """``model.decoder.layers.{i}.`` + OPT's module and parameter names."""
        if layer is None:
            return _MODEL[(op, path)]
        module, param = path.split("/")
        return f"model.decoder.layers.{layer}.{_LAYER[module]}.{_PARAM[param]}"

    def spec_from_hf(self, config: Mapping[str, Any], where: str) -> ModelSpec:
        reader = ConfigReader(config, where, self.hf_ignored)
        d_model, n_heads = reader.need("hidden_size"), reader.need("num_attention_heads")
        reader.expect("activation_function", ("relu",), "relu")
        reader.expect("do_layer_norm_before", (True,), True)
        reader.expect("enable_bias", (True,), True)
        reader.expect("layer_norm_elementwise_affine", (True,), True)
        reader.expect("_remove_final_layer_norm", (False,), False)
        reader.expect("word_embed_proj_dim", (d_model,), d_model)
        spec = ModelSpec(
            name=reader.get("_name_or_path") or where.rstrip("/").split("/")[-1],
            n_layers=reader.need("num_hidden_layers"), d_model=d_model, n_heads=n_heads,
            n_kv_heads=n_heads, head_dim=d_model // n_heads, d_ff=reader.need("ffn_dim"),
            vocab_size=reader.need("vocab_size"),
            context_length=reader.get("max_position_embeddings", 2048), norm_eps=NORM_EPS,
            tie_embeddings=bool(reader.get("tie_word_embeddings", True)), family=self.name)
        reader.finish()
        return spec


FAMILY = OptFamily(name="opt", hf_model_types=("opt",))
