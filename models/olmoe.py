"""The OLMoE family (OLMoE-1B-7B; Muennighoff et al. 2024): Llama's attention with q and k
RMS-normed over the whole projection before RoPE (``q_norm`` (H E,), ``k_norm`` (K E,)) and a
Mixture-of-Experts feed-forward part (``models.moe``): ``num_experts`` SwiGLU experts of
``intermediate_size``, the top ``num_experts_per_tok`` of a softmax router, not renormalised
unless ``norm_topk_prob``. ``clip_qkv`` (clamping q, k and v) is refused where set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hx.models.family import ConfigReader
from hx.models.llama import GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES
from hx.models.moe import GGUF_MOE_NAMES, ROUTER, MoeFamily
from hx.models.qwen3_moe import MOE_TRAINING, QWEN_EXPERTS
from hx.models.spec import MoeShape


@dataclass(frozen=True)
class OlmoeFamily(MoeFamily):
    """Llama with whole-projection q/k norms and experts (module docstring)."""

    hf_ignored: ClassVar[frozenset] = MOE_TRAINING

    def read_moe(self, reader: ConfigReader) -> MoeShape:
        """``MoeFamily.read_moe``, with ``clip_qkv`` read here.

        Raises:
          HxError: ``clip_qkv`` set, or a key missing.
        """
        reader.expect("clip_qkv", (None,))
        return super().read_moe(reader)

    def read_expert_size(self, reader: ConfigReader) -> int:
        """``intermediate_size``: OLMoE's experts are its MLPs."""
        return reader.need("intermediate_size")


FAMILY = OlmoeFamily(
    name="olmoe", hf_model_types=("olmoe",), gguf_architectures=("olmoe",),
    gguf_layer_names=GGUF_MOE_NAMES, gguf_model_names=GGUF_MODEL_NAMES,
    gguf_moe_family="olmoe", gguf_norm_top_k=False, hf_layer_names=HF_LAYER_NAMES,
    hf_model_names=HF_MODEL_NAMES, qk_norm=True, qk_norm_whole=True, hf_experts=QWEN_EXPERTS,
    hf_moe_names={("MLP1", ROUTER): "mlp.gate.weight"})
