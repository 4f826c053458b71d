"""The Mixtral family (Mixtral-8x7B, 8x22B; Jiang et al. 2024): Mistral's attention
(``models.mistral``: a sliding window where the config sets one) and a Mixture-of-Experts
feed-forward part (``models.moe``): 8 SwiGLU experts of ``intermediate_size``, the top 2 of a
softmax router, renormalised. ``router_jitter_noise`` and ``router_aux_loss_coef`` are training's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hx.models.family import ConfigReader
from hx.models.llama import GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES
from hx.models.moe import GGUF_MOE_NAMES, ROUTER, MoeFamily


@dataclass(frozen=True)
class MixtralFamily(MoeFamily):
    """Mistral's attention, Mixtral's experts (module docstring)."""

    hf_ignored: ClassVar[frozenset] = frozenset({"router_jitter_noise", "router_aux_loss_coef",
                                                 "output_router_logits"})

    def read_window(self, reader: ConfigReader) -> int | None:
        """The config's ``sliding_window`` (None or absent: the whole context)."""
        return reader.get("sliding_window")

    def read_expert_size(self, reader: ConfigReader) -> int:
        """``intermediate_size``: Mixtral's experts are its MLPs."""
        return reader.need("intermediate_size")

    def read_norm_top_k(self, reader: ConfigReader) -> bool:
        """Always: Mixtral renormalises its top k."""
        return True


FAMILY = MixtralFamily(
    name="mixtral", hf_model_types=("mixtral",), hf_layer_names=HF_LAYER_NAMES,
    hf_model_names=HF_MODEL_NAMES, gguf_layer_names=GGUF_MOE_NAMES,
    gguf_model_names=GGUF_MODEL_NAMES, gguf_rope_permuted=("wq/kernel", "wk/kernel"),
    gguf_moe_family="mixtral",
    hf_experts={"experts/gate_kernel": "block_sparse_moe.experts.{}.w1.weight",
                "experts/up_kernel": "block_sparse_moe.experts.{}.w3.weight",
                "experts/down_kernel": "block_sparse_moe.experts.{}.w2.weight"},
    hf_moe_names={("MLP1", ROUTER): "block_sparse_moe.gate.weight"})
