"""The Mistral family (Mistral-7B; Jiang et al. 2023): Llama's layer (``models.llama``) with
grouped-query attention over a sliding window where the config sets one (``sliding_window``:
each query attends the last W positions, its own included). llama.cpp writes Mistral's GGUF
files as ``llama`` ones, which the Llama family reads.
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
