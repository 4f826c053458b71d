"""The Qwen3 family (dense Qwen3; Qwen team 2025): Qwen2's layer (``models.qwen2``) without
q/k/v biases and with an RMSNorm over each head of q and of k before RoPE (``q_norm``,
``k_norm``: (E,) each); its head dim is the config's own (128 beside a hidden size of 1,024 in
Qwen3-0.6B).
"""

from __future__ import annotations

from hx.models.llama import GGUF_LAYER_NAMES, GGUF_MODEL_NAMES, HF_LAYER_NAMES, HF_MODEL_NAMES
from hx.models.qwen2 import Qwen2Family

FAMILY = Qwen2Family(name="qwen3", hf_model_types=("qwen3",), gguf_architectures=("qwen3",),
                     hf_layer_names=HF_LAYER_NAMES, hf_model_names=HF_MODEL_NAMES,
                     gguf_layer_names=GGUF_LAYER_NAMES, gguf_model_names=GGUF_MODEL_NAMES,
                     qkv_bias=False, qk_norm=True)
