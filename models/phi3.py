"""The Phi-3 family (Phi-3-mini, -medium; Abdin et al. 2024): Llama's layer (``models.llama``)
stored with fused tensors -- ``qkv_proj`` (q, k and v rows stacked) and ``gate_up_proj``
(gate rows, then up rows) -- which the loader splits into Llama's matrices (views of the file's
rows, no copy), and a sliding window where the config sets one. The long-context variants'
``longrope`` scaling is refused (``models.llama.ROPE_TYPES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from hx.models.family import ConfigReader
from hx.models.llama import HF_LAYER_NAMES, HF_MODEL_NAMES, LlamaFamily

# hx path -> (fused tensor, which of its row blocks): q, k, v of ``qkv_proj``, gate, up of
# ``gate_up_proj``
FUSED = {("Q", "wq/kernel"): ("self_attn.qkv_proj.weight", 0),
         ("K", "wk/kernel"): ("self_attn.qkv_proj.weight", 1),
         ("V", "wv/kernel"): ("self_attn.qkv_proj.weight", 2),
         ("MLP1", "w_gate/kernel"): ("mlp.gate_up_proj.weight", 0),
         ("MLP1", "w_up/kernel"): ("mlp.gate_up_proj.weight", 1)}


@dataclass(frozen=True)
class Phi3Family(LlamaFamily):
    """Llama with fused tensors and an optional window (module docstring)."""

    # dropout rates (training only); the context the model was trained at before longrope,
    # read only by longrope, which hx refuses
    hf_ignored: ClassVar[frozenset] = frozenset({"resid_pdrop", "embd_pdrop",
                                                 "original_max_position_embeddings"})

    def read_window(self, reader: ConfigReader) -> int | None:
        """The config's ``sliding_window`` (None: the whole context)."""
        return reader.get("sliding_window")

    def hf_name(self, layer: int | None, op: str, path: str) -> str:
        """The fused tensor holding a split matrix (``FUSED``), else Llama's name."""
        if layer is not None and (op, path) in FUSED:
            return f"model.layers.{layer}.{FUSED[(op, path)][0]}"
        return super().hf_name(layer, op, path)

    def from_hf(self, spec, tensors: Mapping[str, Any], layer: int | None, op: str, path: str):
        """A split matrix's rows of its fused tensor: q (H·E), k and v (K·E) of qkv_proj,
        gate and up (F each) of gate_up_proj."""
        whole = tensors[self.hf_name(layer, op, path)]
        if layer is None or (op, path) not in FUSED:
            return whole
        fused, block = FUSED[(op, path)]
        q, kv, f = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.d_ff
        cuts = (0, q, q + kv, q + 2 * kv) if fused.startswith("self_attn") else (0, f, 2 * f)
        return whole[cuts[block]:cuts[block + 1]]


FAMILY = Phi3Family(name="phi3", hf_model_types=("phi3",), hf_layer_names=HF_LAYER_NAMES,
                    hf_model_names=HF_MODEL_NAMES)
