"""Load a Hugging Face Llama checkpoint folder (config.json + *.safetensors) into hx's tree.

Tensors are read as numpy arrays (bfloat16 ones as ``ml_dtypes.bfloat16``) and converted to the
dtype asked for only when they differ: a bfloat16 checkpoint loaded as bfloat16 stays bit for bit
what the file holds.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from hx.errors import HxError
from hx.models.buffers import aligned_copy
from hx.models.tensors import layer_key
from hx.models.spec import EMBED, HEAD, SCORE, ModelSpec, numpy_dtype

SUPPORTED_MODEL_TYPES = ("llama",)


def spec_from_config(config: dict[str, Any], directory: str) -> ModelSpec:
    """``ModelSpec`` from a Hugging Face ``config.json`` dict.

    Raises:
      HxError: the model type is not Llama or a required key is missing.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HxError(f"{directory}: unsupported model_type {model_type!r}; hx supports "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        d_model, n_heads = config["hidden_size"], config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        return ModelSpec(
            name=config.get("_name_or_path") or os.path.basename(os.path.abspath(directory)),
            n_layers=config["num_hidden_layers"], d_model=d_model, n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or d_model // n_heads,
            d_ff=config["intermediate_size"], vocab_size=config["vocab_size"],
            context_length=config.get("max_position_embeddings", 2048),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise HxError(f"{directory}/config.json lacks {e.args[0]!r}") from None


def load_safetensors_dir(directory: str, dtype: str = "float32"
                        ) -> tuple[ModelSpec, dict[str, Any]]:
    """Read spec and parameters in ``dtype`` (``spec.dtype``) from a Hugging Face Llama
    folder.

    Hugging Face stores each projection as (out, in); hx's Flax kernels are (in, out...).
    Raises:
      HxError: missing config or weights, unsupported model type, missing tensor.
    """
    from safetensors import safe_open

    config_path = os.path.join(directory, "config.json")
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not os.path.isfile(config_path) or not files:
        raise HxError(f"{directory}: expected config.json and *.safetensors files")
    with open(config_path) as f:
        spec = spec_from_config(json.load(f), directory).replace(dtype=dtype)
    want = numpy_dtype(dtype)

    tensors: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(path, framework="np") as sf:  # numpy, bfloat16 included
            for name in sf.keys():
                tensors[name] = np.asarray(sf.get_tensor(name)).astype(want, copy=False)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise HxError(f"{directory}: tensor {name} is missing")
        return tensors[name]

    D, H, K, E, F = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_ff

    def kernel(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return aligned_copy(get(name).T).reshape(shape)

    def vector(name: str) -> np.ndarray:
        return aligned_copy(get(name))

    embedding = vector("model.embed_tokens.weight")
    params: dict[str, Any] = {EMBED: {"embedding": embedding}}
    for i in range(spec.n_layers):
        b = f"model.layers.{i}."
        params[layer_key(i)] = {
            "Q": {"attn_norm": {"scale": vector(b + "input_layernorm.weight")},
                  "wq": {"kernel": kernel(b + "self_attn.q_proj.weight", (D, H, E))}},
            "K": {"wk": {"kernel": kernel(b + "self_attn.k_proj.weight", (D, K, E))}},
            "V": {"wv": {"kernel": kernel(b + "self_attn.v_proj.weight", (D, K, E))}},
            SCORE: {},
            "OUT": {"wo": {"kernel": kernel(b + "self_attn.o_proj.weight", (H, E, D))}},
            "MLP1": {"ffn_norm": {"scale": vector(b + "post_attention_layernorm.weight")},
                     "w_gate": {"kernel": kernel(b + "mlp.gate_proj.weight", (D, F))},
                     "w_up": {"kernel": kernel(b + "mlp.up_proj.weight", (D, F))}},
            "MLP2": {"w_down": {"kernel": kernel(b + "mlp.down_proj.weight", (F, D))}},
        }
    head_table = embedding if spec.tie_embeddings else vector("lm_head.weight")
    params[HEAD] = {"final_norm": {"scale": vector("model.norm.weight")},
                    "embedding": head_table}
    return spec, params
