"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B; Qwen team 2025): Qwen3's attention
(``models.qwen3``: q/k RMSNorm per head, no biases) and a Mixture-of-Experts feed-forward part
(``models.moe``): ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, the top
``num_experts_per_tok`` of a softmax router, renormalised where ``norm_topk_prob``. Layers with a
dense MLP of ``intermediate_size`` (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are the
layer type ``dense`` (``MoeFamily.read_dense_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hx.models.llama import GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES
from hx.models.moe import GGUF_MOE_NAMES, ROUTER, MoeFamily
from hx.models.qwen2 import Qwen2Family

# the router's and experts' losses and outputs in training
MOE_TRAINING = frozenset({"router_aux_loss_coef", "output_router_logits"})


@dataclass(frozen=True)
class QwenMoeFamily(MoeFamily, Qwen2Family):
    """Qwen2's or Qwen3's attention (their switches) with experts (module docstring)."""

    hf_ignored: ClassVar[frozenset] = Qwen2Family.hf_ignored | MOE_TRAINING


QWEN_EXPERTS = {"experts/gate_kernel": "mlp.experts.{}.gate_proj.weight",
                "experts/up_kernel": "mlp.experts.{}.up_proj.weight",
                "experts/down_kernel": "mlp.experts.{}.down_proj.weight"}

FAMILY = QwenMoeFamily(
    name="qwen3_moe", hf_model_types=("qwen3_moe",), gguf_architectures=("qwen3moe",),
    gguf_layer_names=GGUF_MOE_NAMES, gguf_model_names=GGUF_MODEL_NAMES,
    gguf_moe_family="qwen3_moe", hf_layer_names=HF_LAYER_NAMES,
    hf_model_names=HF_MODEL_NAMES, qkv_bias=False, qk_norm=True, hf_experts=QWEN_EXPERTS,
    hf_moe_names={("MLP1", ROUTER): "mlp.gate.weight"})
