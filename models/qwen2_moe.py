"""The Qwen2-MoE family (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; Qwen team 2024): Qwen2's attention
(``models.qwen2``: q/k/v biases, the config's ``qkv_bias``) and a Mixture-of-Experts feed-forward
part (``models.moe``) with a shared expert of ``shared_expert_intermediate_size`` on every token
behind a sigmoid gate (``shared_expert_gate``), added to the routed experts' sum; the top k of the
softmax router are not renormalised unless ``norm_topk_prob``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hx.models.family import ConfigReader
from hx.models.llama import GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES
from hx.models.moe import GGUF_MOE_NAMES, ROUTER, SHARED_GATE, MoeFamily
from hx.models.qwen3_moe import QWEN_EXPERTS, QwenMoeFamily
from hx.models.spec import MoeShape


@dataclass(frozen=True)
class Qwen2MoeFamily(QwenMoeFamily):
    """Qwen2's attention, routed experts and a shared one (module docstring)."""

    def read_moe(self, reader: ConfigReader) -> MoeShape:
        """``MoeFamily.read_moe``, with the config's ``qkv_bias`` (the biases hx's Qwen2
        attention adds) read here.

        Raises:
          HxError: ``qkv_bias`` off, a key missing, or layers without experts.
        """
        reader.expect("qkv_bias", (True,), True)
        return MoeFamily.read_moe(self, reader)

    def read_shared_size(self, reader: ConfigReader) -> int:
        """``shared_expert_intermediate_size``."""
        return reader.need("shared_expert_intermediate_size")


FAMILY = Qwen2MoeFamily(
    name="qwen2_moe", hf_model_types=("qwen2_moe",), gguf_architectures=("qwen2moe",),
    gguf_layer_names=GGUF_MOE_NAMES, gguf_model_names=GGUF_MODEL_NAMES,
    gguf_moe_family="qwen2_moe", gguf_norm_top_k=False, hf_layer_names=HF_LAYER_NAMES,
    hf_model_names=HF_MODEL_NAMES, qkv_bias=True, hf_experts=QWEN_EXPERTS,
    hf_moe_names={("MLP1", ROUTER): "mlp.gate.weight",
                  ("MLP2", "shared_w_gate/kernel"): "mlp.shared_expert.gate_proj.weight",
                  ("MLP2", "shared_w_up/kernel"): "mlp.shared_expert.up_proj.weight",
                  ("MLP2", "shared_w_down/kernel"): "mlp.shared_expert.down_proj.weight",
                  ("MLP2", SHARED_GATE): "mlp.shared_expert_gate.weight"})
