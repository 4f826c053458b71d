"""The Mistral family (Mistral-7B; Jiang et al. 2023): Llama's layer (``models.llama``) with
grouped-query attention over a sliding window where the config sets one (``sliding_window``:
each query attends the last W positions, its own included).

llama.cpp's converter writes Mistral's checkpoints as ``llama`` GGUF files (its ``LlamaModel``
converts ``MistralForCausalLM``: q/k rows permuted, no window key), and its ``llama``
architecture reads no window; the Llama family reads them alike (family ``llama``, no window,
``attention.sliding_window`` refused should a file set it). A checkpoint whose window is
shorter than its context -- Mistral-7B-v0.1's 4,096 of 32,768; none from v0.2 on -- therefore
runs from its GGUF with every position attending the whole context, as llama.cpp runs it: the
same outputs as the checkpoint while prompt and continuation fit in the window, others past it
(tests/test_families.py compares such a GGUF with transformers without the window).
"""

from __future__ import annotations

from dataclasses import dataclass

from hx.models.family import ConfigReader
from hx.models.llama import HF_LAYER_NAMES, HF_MODEL_NAMES, LlamaFamily


@dataclass(frozen=True)
class MistralFamily(LlamaFamily):
    """Llama with a sliding window (module docstring)."""

    def read_window(self, reader: ConfigReader) -> int | None:
        """The config's ``sliding_window`` (None or absent: the whole context)."""
        return reader.get("sliding_window")


FAMILY = MistralFamily(name="mistral", hf_model_types=("mistral",),
                       hf_layer_names=HF_LAYER_NAMES, hf_model_names=HF_MODEL_NAMES)
