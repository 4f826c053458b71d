"""The Phi-3 family (Phi-3-mini, -medium; Abdin et al. 2024): Llama's layer (``models.llama``)
stored with fused tensors -- ``qkv_proj`` (q, k and v rows stacked) and ``gate_up_proj``
(gate rows, then up rows) -- which the loaders split into Llama's matrices (views of the file's
rows, no copy), and a sliding window where the config sets one. The long-context variants'
``longrope`` scaling is refused (``models.llama.ROPE_TYPES``).

llama.cpp's converter keeps both fused (``attn_qkv``, ``ffn_up`` holding gate then up), does
not permute q/k (its Phi-3 rotates halves, as hx), and writes the window as
``phi3.attention.sliding_window`` (0 where the config has none). llama.cpp itself disables
Phi-3's window ("Phi SWA is currently disabled", its ``llama-model.cpp``); hx applies it, as
transformers does. LongRoPE's ``rope_factors_long``/``rope_factors_short`` tensors and
``rope.scaling.attn_factor`` are refused (``models.gguf_loader``, ``MetadataReader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from hx.models.family import ConfigReader, MetadataReader
from hx.models.llama import (GGUF_LAYER_NAMES, GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES,
                             LlamaFamily)
from hx.models.spec import ModelSpec

# hx path -> (the fused tensor: Hugging Face name, llama.cpp name; which of its row blocks):
# q, k, v of ``qkv_proj``, gate, up of ``gate_up_proj``
FUSED = {("Q", "wq/kernel"): ("self_attn.qkv_proj.weight", "attn_qkv.weight", 0),
         ("K", "wk/kernel"): ("self_attn.qkv_proj.weight", "attn_qkv.weight", 1),
         ("V", "wv/kernel"): ("self_attn.qkv_proj.weight", "attn_qkv.weight", 2),
         ("MLP1", "w_gate/kernel"): ("mlp.gate_up_proj.weight", "ffn_up.weight", 0),
         ("MLP1", "w_up/kernel"): ("mlp.gate_up_proj.weight", "ffn_up.weight", 1)}
PHI3_GGUF_LAYER_NAMES = {**GGUF_LAYER_NAMES,
                         **{key: gguf for key, (_, gguf, _) in FUSED.items()}}


def fused_rows(spec: ModelSpec, op: str, path: str) -> tuple[int, int]:
    """Rows [start, stop) of ``path``'s block in its fused tensor: q (H·E), k and v (K·E) of
    qkv; gate and up (F each) of gate_up."""
    _, gguf, block = FUSED[(op, path)]
    q, kv, f = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.d_ff
    cuts = (0, q, q + kv, q + 2 * kv) if gguf == "attn_qkv.weight" else (0, f, 2 * f)
    return cuts[block], cuts[block + 1]


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

    def read_gguf_window(self, reader: MetadataReader) -> int | None:
        """``phi3.attention.sliding_window`` (0 or absent: the whole context)."""
        return int(reader.get("attention.sliding_window", 0)) or None

    def hf_name(self, layer: int | None, op: str, path: str) -> str:
        """The fused tensor holding a split matrix (``FUSED``), else Llama's name."""
        if layer is not None and (op, path) in FUSED:
            return f"model.layers.{layer}.{FUSED[(op, path)][0]}"
        return super().hf_name(layer, op, path)

    def from_hf(self, spec, tensors: Mapping[str, Any], layer: int | None, op: str, path: str):
        """A split matrix's rows of its fused tensor (``fused_rows``)."""
        whole = tensors[self.hf_name(layer, op, path)]
        if layer is None or (op, path) not in FUSED:
            return whole
        start, stop = fused_rows(spec, op, path)
        return whole[start:stop]

    def gguf_rows(self, spec, op: str, path: str) -> tuple[int, int] | None:
        """A split matrix's rows of llama.cpp's fused ``attn_qkv`` or ``ffn_up``."""
        return fused_rows(spec, op, path) if (op, path) in FUSED else None


FAMILY = Phi3Family(name="phi3", hf_model_types=("phi3",), gguf_architectures=("phi3",),
                    hf_layer_names=HF_LAYER_NAMES, hf_model_names=HF_MODEL_NAMES,
                    gguf_layer_names=PHI3_GGUF_LAYER_NAMES, gguf_model_names=GGUF_MODEL_NAMES)
