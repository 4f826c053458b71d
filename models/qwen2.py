"""The Qwen2 family (Qwen2, Qwen2.5; Qwen team 2024): Llama's layer (``models.llama``) with
biases on the q, k and v projections. Qwen's configs may put a sliding window on the layers from
``max_window_layers`` on (``use_sliding_window``); hx refuses that (no released Qwen2.5 turns it
on), and reads Qwen2's and Qwen3's GGUF files (llama.cpp's ``qwen2``, ``qwen3``: rotate-half RoPE,
no row permutation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hx.errors import HxError
from hx.models.family import ConfigReader
from hx.models.llama import (GGUF_LAYER_NAMES, GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES,
                             LlamaFamily)


@dataclass(frozen=True)
class Qwen2Family(LlamaFamily):
    """Llama with q/k/v biases (module docstring)."""

    # read only where ``use_sliding_window`` is on, which hx refuses
    hf_ignored: ClassVar[frozenset] = frozenset({"sliding_window", "max_window_layers"})

    def read_window(self, reader: ConfigReader) -> int | None:
        """None: every layer attends the whole context.

        Raises:
          HxError: the config turns sliding windows on, or gives a layer another kind of
            attention.
        """
        reader.expect("use_sliding_window", (False,), False)
        kinds = sorted(set(reader.get("layer_types", ())) - {"full_attention"})
        if kinds:
            raise HxError(f"{reader.where}: config.json's layer_types has {', '.join(kinds)}, "
                          f"which hx does not implement for {self.name} (it runs "
                          "full_attention)")
        return None


FAMILY = Qwen2Family(name="qwen2", hf_model_types=("qwen2",), gguf_architectures=("qwen2",),
                     hf_layer_names=HF_LAYER_NAMES, hf_model_names=HF_MODEL_NAMES,
                     gguf_layer_names=GGUF_LAYER_NAMES, gguf_model_names=GGUF_MODEL_NAMES,
                     qkv_bias=True)
