"""The DeepSeek-V3 family (DeepSeek-V3, DeepSeek-R1, Kimi-K2-style configs of the same
``model_type``; DeepSeek-AI 2024, arXiv:2412.19437; transformers' ``DeepseekV3ForCausalLM``,
``model_type`` ``deepseek_v3``): DeepSeek-V2's latent attention and DeepSeekMoE
(``models.deepseek_v2``) with V3's router (§2.1.2, eqs. 12-16; "auxiliary-loss-free load
balancing"):

  =====  =============================================================  ================
  op     computes                                                       reads -> writes
  =====  =============================================================  ================
  MLP1   n = RMSNorm(x); s = sigmoid(n R^T) in float32; the experts      x -> a
         chosen by s + b (b the learned ``e_score_correction_bias``),
         among the ``topk_group`` of ``n_group`` groups whose two best
         experts' s + b sum highest; their weights s (not s + b),
         renormalised where ``norm_topk_prob``, x ``routed_scaling_factor``
  =====  =============================================================  ================

Everything else is DeepSeek-V2's, with RoPE's pairing from ``rope_interleave``
(``models.spec.MlaShape.interleaved``). The multi-token-prediction module
(``num_nextn_predict_layers``) is not read: hx decodes with the main model, as transformers
does without ``use_mtp``. ``topk_method`` and ``scoring_func`` (DeepSeek's own config keys)
are read where present and refused unless V3's (``noaux_tc``, ``sigmoid``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn

from hx.errors import HxError
from hx.models.deepseek_v2 import (HF_LAYER_NAMES, HF_MOE_NAMES, MODULES as V2_MODULES,
                                   DeepseekRouterOp, DeepseekV2Family)
from hx.models.family import ConfigReader
from hx.models.layers import held_dtype
from hx.models.llama import HF_MODEL_NAMES
from hx.models.qwen3_moe import QWEN_EXPERTS
from hx.models.moe import top_k_routed
from hx.models.spec import ModelSpec, MoeShape

SCORE_BIAS = "score_bias"  # MLP1's (X,) bias added to the scores to choose: float32, dense


def best_two(grouped: jax.Array) -> jax.Array:
    """A group's score (..., groups) from its experts' (..., groups, X / groups): its two
    best's sum (transformers' ``DeepseekV3TopkRouter``)."""
    return jax.lax.top_k(grouped, 2)[0].sum(axis=-1)


class DeepseekV3RouterOp(DeepseekRouterOp):
    """MLP1: ``RouterOp`` (float32 logits) choosing by V3's rule (module docstring)."""

    def choose(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights, ids) (B,T,k): the experts of the k highest sigmoid(logits) + bias (of
        the best groups by ``best_two``), weighted by their sigmoid(logits) alone."""
        moe = self.spec.moe
        bias = self.param(SCORE_BIAS, nn.initializers.zeros_init(), (moe.experts,),
                          held_dtype(self))
        scores = jax.nn.sigmoid(logits)
        _, ids = top_k_routed(scores + bias.astype(jnp.float32), moe, best_two)
        return jnp.take_along_axis(scores, ids, axis=-1), ids


MODULES = {**V2_MODULES, "MLP1": DeepseekV3RouterOp}


@dataclass(frozen=True)
class DeepseekV3Family(DeepseekV2Family):
    """DeepSeek-V2's layers with V3's router (module docstring)."""

    # training's losses and parallelism, and the multi-token-prediction module hx does not run
    hf_ignored: ClassVar[frozenset] = DeepseekV2Family.hf_ignored | frozenset({
        "num_nextn_predict_layers"})

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """``DeepseekV2Family``'s; an MoE layer's MLP1 also the score bias (X,)."""
        shapes = super().weight_shapes(spec)
        if spec.moe is not None:
            shapes["MLP1"][SCORE_BIAS] = (spec.moe.routed,)
        return shapes

    def modules(self) -> Mapping[str, type]:
        return MODULES

    def read_heads(self, reader: ConfigReader, d_model: int, n_heads: int) -> dict[str, Any]:
        """``DeepseekV2Family``'s, RoPE's pairing from ``rope_interleave`` (default True)."""
        heads = super().read_heads(reader, d_model, n_heads)
        interleaved = bool(reader.get("rope_interleave", True))
        return {**heads, "mla": replace(heads["mla"], interleaved=interleaved)}

    def read_moe(self, reader: ConfigReader) -> MoeShape:
        """V3's MoE shape: ``n_routed_experts`` experts of ``moe_intermediate_size``, the top
        ``num_experts_per_tok`` of the best ``topk_group`` of ``n_group`` groups (one group:
        all experts), renormalised where ``norm_topk_prob`` (default True), times
        ``routed_scaling_factor``; ``n_shared_experts`` shared ones as one, ungated.

        Raises:
          HxError: ``topk_method`` or ``scoring_func`` other than V3's, MoE layers not every
            layer after the dense ones, groups of fewer than two experts, or a key missing.
        """
        reader.expect("moe_layer_freq", (1,), 1)
        reader.expect("topk_method", ("noaux_tc",), "noaux_tc")
        reader.expect("scoring_func", ("sigmoid",), "sigmoid")
        experts, d_expert = int(reader.need("n_routed_experts")), int(
            reader.need("moe_intermediate_size"))
        groups, top_groups = int(reader.get("n_group", 1)), int(reader.get("topk_group", 1))
        if groups > 1 and experts // groups < 2:
            raise HxError(f"{reader.where}: config.json sets n_group={groups} over "
                          f"{experts} routed experts; V3's router scores a group by its two "
                          f"best experts, so each group needs two or more")
        return MoeShape(experts=experts, top_k=int(reader.need("num_experts_per_tok")),
                        d_expert=d_expert,
                        d_shared=d_expert * int(reader.get("n_shared_experts", 0)),
                        norm_top_k=bool(reader.get("norm_topk_prob", True)),
                        routed_scale=float(reader.get("routed_scaling_factor", 1.0)),
                        groups=groups if groups > 1 else 0,
                        top_groups=top_groups if groups > 1 else 0, shared_gate=False)


FAMILY = DeepseekV3Family(
    name="deepseek_v3", hf_model_types=("deepseek_v3",), hf_layer_names=HF_LAYER_NAMES,
    hf_model_names=HF_MODEL_NAMES, hf_experts=QWEN_EXPERTS,
    hf_moe_names={**HF_MOE_NAMES, ("MLP1", SCORE_BIAS): "mlp.gate.e_score_correction_bias"})
