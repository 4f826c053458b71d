"""Load a Llama-family GGUF file (llama.cpp format) into hx's parameter tree.

Tensors are dequantized with the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants:
whatever ``gguf.quants.dequantize`` supports, which yields float32), rounded once to the dtype
asked for (``float32``, ``bfloat16``, ``float16``: round to nearest even) and re-laid out for
the Flax ops of ``models/llama.py``. llama.cpp's converter permutes the rows of
``attn_q``/``attn_k`` so that RoPE rotates adjacent pairs (GPT-J layout); hx uses the
rotate-half layout, so the permutation is undone here (``unpermute_rope_rows``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from hx.errors import HxError
from hx.models.buffers import aligned_copy
from hx.models.tensors import layer_key
from hx.models.spec import EMBED, HEAD, SCORE, ModelSpec, numpy_dtype

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class GGUFContents:
    """What hx takes from a GGUF file: spec, parameter tree (in ``spec.dtype``), and tokenizer
    metadata."""

    spec: ModelSpec
    params: dict[str, Any]
    metadata: dict[str, Any]


def open_gguf(path: str):
    """Open ``path`` with ``gguf.GGUFReader``, turning every failure into an ``HxError``.

    Raises:
      HxError: the file is missing, is not GGUF, or is truncated (a tensor's data runs past the
        end of the file).
    """
    import gguf

    if not os.path.isfile(path):
        raise HxError(f"model file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on corrupt input
        raise HxError(f"{path} is not a readable GGUF file (truncated or corrupt: {e}); "
                      "re-install or re-download the model file") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise HxError(f"{path} is truncated: tensor {t.name} ends at byte "
                          f"{t.data_offset + t.n_bytes} but the file has {size} bytes; "
                          "re-install or re-download the model file")
    return reader


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields of the file as Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def spec_from_metadata(meta: dict[str, Any], path: str, has_output: bool) -> ModelSpec:
    """Build a ``ModelSpec`` from GGUF metadata.

    Raises:
      HxError: the architecture is not one hx implements, or a required key is missing.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HxError(f"{path}: unsupported architecture {arch!r}; hx supports "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise HxError(f"{path}: GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelSpec(
        name=str(meta.get("general.name", os.path.basename(path))),
        n_layers=int(get("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("rope.dimension_count", d_model // n_heads)),
        d_ff=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not has_output,
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k projection rows (convert_hf_to_gguf.py).

    llama.cpp reorders each head's E output rows from [first half, second half] to interleaved
    pairs; this restores the Hugging Face order. ``w``: (n_heads * E, D) -> same shape.
    """
    half = w.shape[0] // n_heads // 2
    # llama.cpp: reshape(n_heads, 2, half, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t, path: str, dtype: str) -> np.ndarray:
    import gguf

    try:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise HxError(f"{path}: tensor {t.name} uses quantisation {t.tensor_type.name}, which "
                      "the installed gguf package cannot dequantize; convert the model to "
                      "F16, Q8_0, Q4_0 or Q4_1") from None
    a = np.asarray(a, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
    return a.astype(numpy_dtype(dtype), copy=False)


def load_gguf(path: str, dtype: str = "float32") -> GGUFContents:
    """Read spec, weights (in ``dtype``, hx layout) and metadata from a GGUF file.

    Returns:
      ``GGUFContents`` whose ``params`` is ``{"EMBED": {"embedding": (V,D)}, "layer_i": {op:
      ...}, "HEAD": {"final_norm": {"scale": (D,)}, "embedding": (V,D)}}`` of numpy arrays of
      ``dtype`` (norm scales too), and whose ``spec.dtype`` is ``dtype``.
    Raises:
      HxError: missing/corrupt/truncated file, unsupported architecture or quantisation, or a
        tensor missing or of the wrong shape.
    """
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    spec = spec_from_metadata(meta, path, has_output="output.weight" in tensors).replace(
        dtype=dtype)
    D, H, K, E, F = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_ff

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise HxError(f"{path}: tensor {name} is missing; the file is incomplete")
        a = _dequantize(tensors[name], path, dtype)
        if a.shape != shape:
            raise HxError(f"{path}: tensor {name} has shape {a.shape}, expected {shape}")
        return a

    def kernel(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """(out, in) row-major matrix -> Flax kernel (in..., out...) of ``shape``."""
        return aligned_copy(w.T).reshape(shape)

    def vector(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return aligned_copy(tensor(name, shape))

    embedding = vector("token_embd.weight", (spec.vocab_size, D))
    params: dict[str, Any] = {EMBED: {"embedding": embedding}}
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        wq = unpermute_rope_rows(tensor(b + "attn_q.weight", (H * E, D)), H)
        wk = unpermute_rope_rows(tensor(b + "attn_k.weight", (K * E, D)), K)
        params[layer_key(i)] = {
            "Q": {"attn_norm": {"scale": vector(b + "attn_norm.weight", (D,))},
                  "wq": {"kernel": kernel(wq, (D, H, E))}},
            "K": {"wk": {"kernel": kernel(wk, (D, K, E))}},
            "V": {"wv": {"kernel": kernel(tensor(b + "attn_v.weight", (K * E, D)), (D, K, E))}},
            SCORE: {},
            "OUT": {"wo": {"kernel": kernel(tensor(b + "attn_output.weight", (D, H * E)),
                                            (H, E, D))}},
            "MLP1": {"ffn_norm": {"scale": vector(b + "ffn_norm.weight", (D,))},
                     "w_gate": {"kernel": kernel(tensor(b + "ffn_gate.weight", (F, D)), (D, F))},
                     "w_up": {"kernel": kernel(tensor(b + "ffn_up.weight", (F, D)), (D, F))}},
            "MLP2": {"w_down": {"kernel": kernel(tensor(b + "ffn_down.weight", (D, F)), (F, D))}},
        }
    head_table = (embedding if spec.tie_embeddings
                  else vector("output.weight", (spec.vocab_size, D)))
    params[HEAD] = {"final_norm": {"scale": vector("output_norm.weight", (D,))},
                    "embedding": head_table}
    return GGUFContents(spec=spec, params=params, metadata=meta)
