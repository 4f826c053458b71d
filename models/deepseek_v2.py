"""The DeepSeek-V2 family (DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-Coder-V2; DeepSeek-AI 2024,
arXiv:2405.04434; transformers' ``DeepseekV2ForCausalLM``, ``model_type`` ``deepseek_v2``):
multi-head latent attention (MLA, §2.1) and DeepSeekMoE (§2.2): fine-grained routed experts
beside shared ones.

Attention is computed with the up-projections absorbed (``models.spec.MlaShape``), so the KV
cache holds one latent head: the normed latent c (``kv_lora_rank``) as K and the shared rotated
key k_R (``qk_rope_head_dim``) as V -- (kv_lora_rank + qk_rope_head_dim) elements a token and
layer, against 2 H (d_h + d_h^R) if the keys and values were expanded. kv_b_proj (H (d_h +
d_v), d_c) is split at load into W_UK (H, d_h, d_c), which Q applies to q's unrotated part,
and W_UV (H, d_v, d_c), which OUT applies before o_proj. RoPE pairs adjacent elements
(``models.layers.rope``, ``interleaved``).

  =======  ==============================================================  ===============
  op       computes                                                        reads -> writes
  =======  ==============================================================  ===============
  Q        h = RMSNorm(x); q = h Wq (or RMSNorm(h Wq_a) Wq_b, ``q_lora_rank``)  x -> h, q
           (H, d_h + d_h^R); q = [q_C W_UK | RoPE(q_R)] (H, d_c + d_h^R)
  K        c = RMSNorm(h W_DKV) (1, d_c)                                    h -> k
  V        k_R = RoPE(h W_KR) (1, d_h^R)                                    h -> v
  SCORE    cache append; p = softmax((q_C' . c + q_R . k_R) (d_h +         q, k, v -> o
           d_h^R)^-1/2); o = p . c (H, d_c)
  OUT      x + (o W_UV) Wo                                                 o, x -> x
  MLP1     router: n = RMSNorm(x); softmax(n R^T) in float32, the top k    x -> a
           (of the best ``topk_group`` groups where ``group_limited_greedy``),
           not renormalised, times ``routed_scaling_factor``
  MLP2     x + the routed experts' weighted sum + the shared experts       a, x -> x
           (``n_shared_experts`` x ``moe_intermediate_size``, no gate)
  =======  ==============================================================  ===============

The first ``first_k_dense_replace`` layers are dense: a layer type of their own (``dense``
beside ``moe``; ``ModelSpec.layer_types``) whose ``moe`` is None, so their MLP1 and MLP2 are
Llama's SwiGLU of ``intermediate_size`` (``MoeFamily.module``).

RoPE may be YaRN (DeepSeek-V2's own: ``models.llama.yarn_frequencies``), whose attention
factors multiply the rotated parts of q and k and the softmax scale (``yarn_factors``).

Refused (one line naming the field): every other RoPE hx's Llama does not run,
``norm_topk_prob`` (transformers' DeepSeek-V2 router ignores it; DeepSeek's own code
renormalises), attention biases, scoring other than softmax, MoE layers not every layer after
the dense ones (``moe_layer_freq``), and key/value heads other than the query heads. hx reads
DeepSeek-V2 from Hugging Face folders, not llama.cpp's ``deepseek2`` GGUF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn

from hx.models.family import ConfigReader, GraphLayer
from hx.models.layers import (Cache, RMSNorm, Step, WeightedOp, append_kv, attention_mask, dense,
                              held_dtype, rope)
from hx.models.llama import (HF_MODEL_NAMES, ROPE_TYPES, YARN, EmbedOp, HeadOp, inv_frequencies,
                              yarn_factors)
from hx.models.moe import ExpertsOp, MoeFamily, ROUTER, RouterOp
from hx.models.ops import EMBED, EXPERT_OPS, HEAD, SCORE
from hx.models.qwen3_moe import MOE_TRAINING, QWEN_EXPERTS
from hx.models.spec import MlaShape, ModelSpec, MoeShape

ABSORBED = ("w_uk", "w_uv")  # the halves of kv_b_proj: Q's W_UK, OUT's W_UV (dense)
TOP_K_METHODS = {"greedy": False, "group_limited_greedy": True}  # -> routes by group


def _absorbed(module: nn.Module, name: str, shape: tuple[int, int, int]) -> jax.Array:
    """The (H, out, in) matrix ``name`` (W_UK or W_UV), dense in the op's held dtype."""
    init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
    return module.param(name, init, shape, held_dtype(module))


class QOp(WeightedOp):
    """Q: x (B,T,D) -> h = RMSNorm(x) (B,T,D), q (B,T,H,d_c + d_h^R): the unrotated part
    absorbed through W_UK, the rotated part turned by RoPE (module docstring)."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array, jax.Array]:
        s, m = self.spec, self.spec.mla
        h = RMSNorm(s.norm_eps, held_dtype(self), name="attn_norm")(x)
        heads = (s.n_heads, m.nope_dim + m.rope_dim)
        if m.q_rank:
            low = dense(self, m.q_rank, name="wq_a")(h).astype(s.dtype)
            low = RMSNorm(s.norm_eps, held_dtype(self), name="q_a_norm")(low)
            q = dense(self, heads, name="wq_b")(low).astype(s.dtype)
        else:
            q = dense(self, heads, name="wq")(h).astype(s.dtype)
        w_uk = _absorbed(self, "w_uk", (s.n_heads, m.nope_dim, m.kv_rank))
        absorbed = jnp.einsum("bthn,hnr->bthr", q[..., :m.nope_dim].astype(w_uk.dtype), w_uk,
                              preferred_element_type=jnp.float32)
        turned = rope(q[..., m.nope_dim:], step.positions, inv_frequencies(s),
                      interleaved=m.interleaved)
        turned = turned.astype(jnp.float32) * yarn_factors(s)[0]
        return h, jnp.concatenate([absorbed, turned], -1).astype(s.dtype)


class KOp(WeightedOp):
    """K: h (B,T,D) -> c = RMSNorm(h W_DKV) (B,T,1,d_c), the latent the cache holds as K."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        c = dense(self, (1, s.mla.kv_rank), name="wk")(h).astype(s.dtype)
        return (RMSNorm(s.norm_eps, held_dtype(self), name="k_norm")(c),)


class VOp(WeightedOp):
    """V: h (B,T,D) -> k_R = RoPE(h W_KR) (B,T,1,d_h^R), the shared rotated key the cache
    holds as V."""

    @nn.compact
    def __call__(self, h: jax.Array, step: Step) -> tuple[jax.Array]:
        s = self.spec
        k = dense(self, (1, s.mla.rope_dim), name="wv")(h).astype(s.dtype)
        k = rope(k, step.positions, inv_frequencies(s), interleaved=s.mla.interleaved)
        return ((k.astype(jnp.float32) * yarn_factors(s)[0]).astype(s.dtype),)


def latent_attention(q: jax.Array, cache: Cache, step: Step, spec: ModelSpec) -> jax.Array:
    """Causal attention of absorbed queries over a latent cache (``models.spec.MlaShape``).

    Args:
      q: (B, T, H, d_c + d_h^R) queries of the new tokens (slots ``write_index ..``).
      cache: {"k": (B, S, 1, d_c) latents, "v": (B, S, 1, d_h^R) rotated keys}, the new
        tokens' written.
      step: ``kv_start`` masks each row's left padding; causality masks future slots.
    Returns:
      o: (B, T, H, d_c) = softmax((q_C' c^T + q_R k_R^T) (d_h + d_h^R)^-1/2 m + mask) c,
      in float32 then ``q``'s dtype (arXiv:2405.04434 eqs. 10-19, with W_UK and W_UV
      absorbed; m YaRN's softmax factor, ``models.llama.yarn_factors``, else 1).
    """
    m, T = spec.mla, q.shape[1]
    c, k = cache["k"][:, :, 0].astype(jnp.float32), cache["v"][:, :, 0].astype(jnp.float32)
    q32 = q.astype(jnp.float32)
    scores = (jnp.einsum("bthr,bsr->bhts", q32[..., :m.kv_rank], c)
              + jnp.einsum("bthp,bsp->bhts", q32[..., m.kv_rank:], k))
    scores = scores * (m.nope_dim + m.rope_dim) ** -0.5 * yarn_factors(spec)[1]
    valid = attention_mask(step, T, c.shape[1], None)  # (B,T,S)
    scores = jnp.where(valid[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bsr->bthr", probs, c).astype(q.dtype)


class ScoreOp(nn.Module):
    """SCORE: append c, k_R to the layer's latent cache and attend (``latent_attention``) ->
    o (B,T,H,d_c). ``attend`` is accepted and not used: the host's attention kernels compute
    another attention (``Family.host_attention`` is False here), so this runs on either
    device."""

    spec: ModelSpec
    attend: Callable[..., jax.Array] | None = None

    def __call__(self, q, k, v, step: Step, cache: Cache) -> tuple[tuple[jax.Array], Cache]:
        cache = append_kv(cache, k, v, step.write_index)
        return (latent_attention(q, cache, step, self.spec),), cache


class OutOp(WeightedOp):
    """OUT: o (B,T,H,d_c), x (B,T,D) -> x + (o W_UV) Wo (B,T,D), o W_UV (B,T,H,d_v) rounded to
    the model's dtype (transformers' attention output)."""

    @nn.compact
    def __call__(self, o: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s, m = self.spec, self.spec.mla
        w_uv = _absorbed(self, "w_uv", (s.n_heads, m.v_dim, m.kv_rank))
        u = jnp.einsum("bthr,hvr->bthv", o.astype(w_uv.dtype), w_uv,
                       preferred_element_type=jnp.float32).astype(s.dtype)
        y = dense(self, s.d_model, axis=(-2, -1), name="wo")(u)  # 'BTHV,DHV->BTD'
        return ((x.astype(jnp.float32) + y).astype(s.dtype),)


class DeepseekRouterOp(RouterOp):
    """MLP1: ``RouterOp`` with its logits in float32 (``DeepseekV2TopkRouter``)."""

    float32_logits: ClassVar[bool] = True


MODULES = {EMBED: EmbedOp, "Q": QOp, "K": KOp, "V": VOp, SCORE: ScoreOp, "OUT": OutOp,
           "MLP1": DeepseekRouterOp, "MLP2": ExpertsOp, **{op: ExpertsOp for op in EXPERT_OPS},
           HEAD: HeadOp}

HF_LAYER_NAMES = {
    ("Q", "attn_norm/scale"): "input_layernorm.weight",
    ("Q", "wq/kernel"): "self_attn.q_proj.weight",
    ("Q", "wq_a/kernel"): "self_attn.q_a_proj.weight",
    ("Q", "q_a_norm/scale"): "self_attn.q_a_layernorm.weight",
    ("Q", "wq_b/kernel"): "self_attn.q_b_proj.weight",
    ("Q", "w_uk"): "self_attn.kv_b_proj.weight",
    ("K", "wk/kernel"): "self_attn.kv_a_proj_with_mqa.weight",
    ("K", "k_norm/scale"): "self_attn.kv_a_layernorm.weight",
    ("V", "wv/kernel"): "self_attn.kv_a_proj_with_mqa.weight",
    ("OUT", "w_uv"): "self_attn.kv_b_proj.weight",
    ("OUT", "wo/kernel"): "self_attn.o_proj.weight",
    ("MLP1", "ffn_norm/scale"): "post_attention_layernorm.weight",
    # a dense first layer's MLP (``first_k_dense_replace``)
    ("MLP1", "w_gate/kernel"): "mlp.gate_proj.weight",
    ("MLP1", "w_up/kernel"): "mlp.up_proj.weight",
    ("MLP2", "w_down/kernel"): "mlp.down_proj.weight",
}
HF_MOE_NAMES = {("MLP1", ROUTER): "mlp.gate.weight",
                ("MLP2", "shared_w_gate/kernel"): "mlp.shared_experts.gate_proj.weight",
                ("MLP2", "shared_w_up/kernel"): "mlp.shared_experts.up_proj.weight",
                ("MLP2", "shared_w_down/kernel"): "mlp.shared_experts.down_proj.weight"}


@dataclass(frozen=True)
class DeepseekV2Family(MoeFamily):
    """Latent attention and DeepSeekMoE (module docstring)."""

    # training's losses and parallelism: the router's auxiliary losses, expert parallelism
    hf_ignored: ClassVar[frozenset] = MOE_TRAINING | frozenset({
        "aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp"})
    host_attention: ClassVar[bool] = False
    rope_types: ClassVar[tuple[str, ...]] = (*ROPE_TYPES, YARN)  # YaRN: ``yarn_factors``

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """``MoeFamily``'s embedding, MoE part and HEAD; latent attention's Q the norm (D,),
        wq (H, d_h + d_h^R, D) (or wq_a (d_c', D), q_a_norm (d_c',) and wq_b (H, d_h + d_h^R,
        d_c')) and W_UK (H, d_h, d_c); K wk (1, d_c, D) and k_norm (d_c,); V wv (1, d_h^R, D);
        OUT W_UV (H, d_v, d_c) and wo (D, H, d_v)."""
        shapes = super().weight_shapes(spec)
        D, H, m = spec.d_model, spec.n_heads, spec.mla
        qk = m.nope_dim + m.rope_dim
        shapes["Q"] = ({"attn_norm/scale": (D,), "wq_a/kernel": (m.q_rank, D),
                        "q_a_norm/scale": (m.q_rank,), "wq_b/kernel": (H, qk, m.q_rank)}
                       if m.q_rank else {"attn_norm/scale": (D,), "wq/kernel": (H, qk, D)})
        shapes["Q"]["w_uk"] = (H, m.nope_dim, m.kv_rank)
        shapes["K"] = {"wk/kernel": (1, m.kv_rank, D), "k_norm/scale": (m.kv_rank,)}
        shapes["V"] = {"wv/kernel": (1, m.rope_dim, D)}
        shapes["OUT"] = {"w_uv": (H, m.v_dim, m.kv_rank), "wo/kernel": (D, H, m.v_dim)}
        return shapes

    def flops(self, spec: ModelSpec, op: str, rows: int) -> float:
        """``Family.flops``, with the absorbed products: Q's 2·rows·H·d_h·d_c (W_UK), OUT's
        2·rows·H·d_v·d_c (W_UV)."""
        shapes = spec.op_weight_shapes(op)
        absorbed = sum(2.0 * rows * math.prod(shapes[path]) for path in ABSORBED
                       if path in shapes)
        return super().flops(spec, op, rows) + absorbed

    def modules(self) -> Mapping[str, type]:
        return MODULES

    def graph_layer(self, spec: ModelSpec) -> GraphLayer | None:
        """None: latent attention is not llama.cpp's layer graph here (its ops run one by
        one)."""
        return None

    def from_hf(self, spec: ModelSpec, tensors: Mapping[str, Any], layer: int | None, op: str,
                path: str):
        """kv_a_proj_with_mqa's rows [0, d_c) for K's wk and [d_c, d_c + d_h^R) for V's wv;
        kv_b_proj (H (d_h + d_v), d_c) as (H, d_h + d_v, d_c), its first d_h rows a head
        W_UK, the rest W_UV; else ``MoeFamily``'s."""
        m = spec.mla
        if layer is not None and path in ("wk/kernel", "wv/kernel"):
            whole = tensors[self.hf_name(layer, op, path)]
            return whole[:m.kv_rank] if path == "wk/kernel" else whole[m.kv_rank:]
        if layer is not None and path in ABSORBED:
            whole = tensors[self.hf_name(layer, op, path)].reshape(
                spec.n_heads, m.nope_dim + m.v_dim, m.kv_rank)
            return whole[:, :m.nope_dim] if path == "w_uk" else whole[:, m.nope_dim:]
        return super().from_hf(spec, tensors, layer, op, path)

    def read_heads(self, reader: ConfigReader, d_model: int, n_heads: int) -> dict[str, Any]:
        """Latent attention's fields (module docstring): one KV head, the rotated part as
        ``head_dim``, ``MlaShape`` (``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``,
        ``qk_rope_head_dim``, ``v_head_dim``).

        Raises:
          HxError: key/value heads other than the query heads, ``head_dim`` or ``qk_head_dim``
            other than transformers sets, or a key missing.
        """
        reader.expect("num_key_value_heads", (n_heads,), n_heads)
        mla = MlaShape(kv_rank=int(reader.need("kv_lora_rank")),
                       q_rank=int(reader.get("q_lora_rank", 0)),
                       nope_dim=int(reader.need("qk_nope_head_dim")),
                       rope_dim=int(reader.need("qk_rope_head_dim")),
                       v_dim=int(reader.need("v_head_dim")))
        reader.expect("head_dim", (mla.rope_dim,), mla.rope_dim)  # transformers sets it so
        reader.expect("qk_head_dim", (mla.nope_dim + mla.rope_dim,), mla.nope_dim + mla.rope_dim)
        return {"n_kv_heads": 1, "head_dim": mla.rope_dim, "mla": mla}

    def read_dense_layers(self, reader: ConfigReader, n_layers: int) -> tuple[int, ...]:
        """The first ``first_k_dense_replace`` layers (the layer type ``dense``)."""
        return tuple(range(min(int(reader.get("first_k_dense_replace", 0)), n_layers)))

    def read_moe(self, reader: ConfigReader) -> MoeShape:
        """DeepSeekMoE's shape: ``n_routed_experts`` experts of ``moe_intermediate_size``, the
        top ``num_experts_per_tok`` (of ``topk_group`` of ``n_group`` groups where
        ``topk_method`` is ``group_limited_greedy``) times ``routed_scaling_factor``, and
        ``n_shared_experts`` shared ones as one of their summed size, ungated.

        Raises:
          HxError: another top-k method or scoring, MoE layers not every layer after the
            dense ones, ``norm_topk_prob``, or a key missing.
        """
        reader.expect("moe_layer_freq", (1,), 1)
        reader.expect("scoring_func", ("softmax",), "softmax")
        reader.expect("norm_topk_prob", (False,), False)
        grouped = TOP_K_METHODS[reader.expect("topk_method", tuple(TOP_K_METHODS), "greedy")]
        if grouped:
            groups = (int(reader.need("n_group")), int(reader.need("topk_group")))
        else:  # greedy routing does not group: n_group and topk_group are read past
            reader.get("n_group")
            reader.get("topk_group")
            groups = (0, 0)
        d_expert = int(reader.need("moe_intermediate_size"))
        return MoeShape(experts=int(reader.need("n_routed_experts")),
                        top_k=int(reader.need("num_experts_per_tok")), d_expert=d_expert,
                        d_shared=d_expert * int(reader.get("n_shared_experts", 0)),
                        norm_top_k=False,
                        routed_scale=float(reader.get("routed_scaling_factor", 1.0)),
                        groups=groups[0], top_groups=groups[1], shared_gate=False)


FAMILY = DeepseekV2Family(
    name="deepseek_v2", hf_model_types=("deepseek_v2",), hf_layer_names=HF_LAYER_NAMES,
    hf_model_names=HF_MODEL_NAMES, hf_experts=QWEN_EXPERTS,
    hf_moe_names=HF_MOE_NAMES)
