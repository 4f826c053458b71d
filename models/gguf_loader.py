"""Load a GGUF file (llama.cpp format) of any of hx's families into hx's parameter tree.

The file is memory-mapped (``gguf.GGUFReader``) and its tensors are taken in their (out, in)
layout, which hx's ops use as it is:

* ``weights="auto"`` (the default): matrices whose blocks hx's formats hold exactly -- Q8_0,
  Q4_0, Q4_1 (``models.formats``: groups of 32 with float16 scales, and minimums) -- stay in
  them, block for block (``gguf_blocks``), when every projection matrix shares one such
  format (and likewise the embedding tables); they decompress to exactly the numbers
  ``gguf.quants.dequantize`` gives. Other tensors are dense.
* ``weights="dense"``: every tensor dequantized with the ``gguf`` package (F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, K-quants: whatever ``gguf.quants.dequantize`` supports, which yields float32)
  and rounded once to the dtype asked for (round to nearest even); an F32 tensor loaded as
  float32 stays a view of the file.
* a compressed format (``int8``, ``int4``, ...): the matrices dequantized, then compressed
  into it (``models.formats.quantize``).

What llama.cpp's converter changed is undone by the family's hooks (``models.family``): the
rows of a Llama's ``attn_q``/``attn_k``, permuted so that RoPE rotates adjacent pairs (GPT-J
layout) where hx rotates halves, are put back (``unpermute_rope_rows``, on whole rows: blocks
included) for the paths ``Family.gguf_rope_permuted`` names (Qwen's, Phi-3's and Gemma 3's files
are not permuted); a matrix kept fused with others (Phi-3's ``attn_qkv``, ``ffn_up``) is its
rows of the fused tensor (``Family.gguf_rows``: a view of the file, blocks included); a constant
added to a tensor (Gemma's norms, stored as 1 + w) is subtracted in float32
(``Family.gguf_offset``). ``rope_freqs.weight`` (Llama 3.1's RoPE factors) is a hyperparameter,
read with the keys (``read_metadata``); any other tensor hx does not take is refused, one line
naming it, as are keys hx does not implement (``models.family.MetadataReader``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from hx.errors import HxError
from hx.models.buffers import aligned_copy
from hx.models.family import ROPE_FREQS, for_gguf
from hx.models.formats import DENSE, FORMATS
from hx.models.holding import held_tensor
from hx.models.mapped import release
from hx.models.tensors import weight_tree
from hx.models.spec import ModelSpec, numpy_dtype

AUTO = "auto"
# GGUF block types hx holds as they are: ggml type name -> hx format (``models.formats``)
BLOCK_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_DENSE_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


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
    """All key/value fields of the file as Python values (strings, numbers, lists), and where
    the file holds it, ``rope_freqs.weight`` (``models.family.ROPE_FREQS``: llama.cpp's RoPE
    factors, a hyperparameter kept as a tensor) as a list of floats under its name."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            meta[ROPE_FREQS] = [float(f) for f in _dequantize(t, ROPE_FREQS)]
    return meta


def spec_from_metadata(meta: dict[str, Any], path: str, has_output: bool) -> ModelSpec:
    """Build a ``ModelSpec`` from GGUF metadata, by the family of its ``general.architecture``
    (``models.family.for_gguf``).

    Raises:
      HxError: no family of hx reads the architecture, a required key is missing, or a key
        changes the math in a way hx does not implement.
    """
    arch = meta.get("general.architecture")
    return for_gguf(arch, path).spec_from_gguf(meta, path, has_output)


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's ``permute`` of q/k projection rows (convert_hf_to_gguf.py).

    llama.cpp reorders each head's E output rows from [first half, second half] to interleaved
    pairs; this restores the Hugging Face order. ``w``: (n_heads * E, ...) -> same shape; a
    compressed matrix (``GroupMatrix``, rows first) has each array's rows reordered.
    """
    from hx.models.compressed import GroupMatrix  # JAX: only where a matrix is compressed

    if isinstance(w, GroupMatrix):
        return w.map(lambda a: unpermute_rope_rows(a, n_heads))
    half = w.shape[0] // n_heads // 2
    # llama.cpp: reshape(n_heads, 2, half, ...).swapaxes(1, 2); this is its inverse.
    rows = aligned_copy(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)).reshape(w.shape)
    release(w)  # when ``w`` is a view of the file
    return rows


def gguf_blocks(t, shape: tuple[int, ...]):
    """A Q8_0, Q4_0 or Q4_1 tensor's blocks as a ``models.compressed.GroupMatrix``
    (``group_of_blocks``), their mapped pages released once read."""
    held = group_of_blocks(np.asarray(t.data), t.tensor_type.name, shape)
    release(np.asarray(t.data))
    return held


def group_of_blocks(blocks: np.ndarray, type_name: str, shape: tuple[int, ...]):
    """GGUF ``blocks`` (uint8, a tensor's bytes) of ggml type ``type_name`` (``Q8_0``,
    ``Q4_0``, ``Q4_1``) as a ``models.compressed.GroupMatrix`` in hx's format of the same
    name, of logical shape ``shape`` (out..., in), made in one pass over the blocks.

    A block of 32 weights is a float16 scale d, for Q4_1 a float16 minimum m, and the codes:
    Q4_0/Q4_1 16 bytes of nibbles (low nibble j is weight j, high nibble weight j + 16 --
    hx's 4-bit layout), Q8_0 32 signed bytes, held as ``q + 128`` (weight = d * (code - 128)).
    """
    fmt = FORMATS[BLOCK_FORMATS[type_name]]
    arrays = fmt.arrays(shape)
    blocks = blocks.reshape(*arrays["scale"][0], -1)  # (out..., in/32, bytes)
    scale = blocks[..., 0:2].view(np.float16)[..., 0]
    held = {"scale": aligned_copy(scale)}
    if fmt.asymmetric:
        held["offset"] = aligned_copy(blocks[..., 2:4].view(np.float16)[..., 0])
    codes = blocks[..., 4:] if fmt.asymmetric else blocks[..., 2:]
    held["codes"] = aligned_copy(codes ^ np.uint8(0x80) if fmt.bits == 8 else codes)
    from hx.models.compressed import GroupMatrix

    return GroupMatrix.from_parts(fmt, held)


def _dequantize(t, path: str) -> np.ndarray:
    """A tensor as float32 (``gguf.quants.dequantize``), in the file's (out, in) layout.

    Raises:
      HxError: the installed gguf package cannot dequantize its type.
    """
    import gguf

    try:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise HxError(f"{path}: tensor {t.name} uses quantisation {t.tensor_type.name}, which "
                      "the installed gguf package cannot dequantize; convert the model to "
                      "F16, Q8_0, Q4_0 or Q4_1") from None
    release(np.asarray(t.data))
    return np.asarray(a, dtype=np.float32)


def row_slice(t, start: int, stop: int):
    """Rows [start, stop) of a ``gguf.ReaderTensor`` (out, in) as one: a view of the file, the
    blocks of a quantized one included (a block never spans rows)."""
    shape = t.shape.copy()  # GGUF's order: (in, out)
    shape[-1] = stop - start
    row_bytes = t.n_bytes // int(t.shape[-1])
    return t._replace(shape=shape, n_elements=int(np.prod(shape)),
                      n_bytes=row_bytes * (stop - start),
                      data_offset=t.data_offset + row_bytes * start, data=t.data[start:stop])


def taken_names(spec: ModelSpec, kind: str | None = None) -> set[str]:
    """The names of the tensors ``load_gguf`` takes for ``spec`` (``Family.gguf_name``); with
    ``kind``, of those whose ``Family.matrix_kind`` is it alone."""
    fam, names = spec.model_family, set()
    weight_tree(spec, lambda layer, op, path, shape: names.add(fam.gguf_name(layer, op, path))
                if kind is None or fam.matrix_kind(path) == kind else None)
    return names


def held_formats(tensors: dict, spec: ModelSpec, weights: str) -> tuple[str, str]:
    """(weight format, embedding format) a file's matrices are held in for ``weights``
    (module docstring): with ``auto``, a GGUF block format where all the projection matrices
    of ``spec`` (``Family.matrix_kind`` kernel: an MoE router, F32 in llama.cpp's files, is
    no projection) share one (and likewise the embedding tables), else dense."""
    if weights != AUTO:
        return weights, weights

    def shared(kind: str) -> str:
        kinds = {tensors[n].tensor_type.name for n in taken_names(spec, kind) if n in tensors}
        return BLOCK_FORMATS.get(kinds.pop(), DENSE) if len(kinds) == 1 else DENSE

    return shared("kernel"), shared("table")


def load_gguf(path: str, dtype: str = "float32", weights: str = AUTO) -> GGUFContents:
    """Read spec, weights (hx layout) and metadata from a GGUF file (module docstring).

    Args:
      dtype: the dtype of dense tensors and of the activations and KV caches (``spec.dtype``).
      weights: ``auto``, ``dense`` or a compressed format (``models.formats.FORMATS``).
    Returns:
      ``GGUFContents`` whose ``params`` is ``{"EMBED": {"embedding": (V,D)}, "layer_i": {op:
      ...}, "HEAD": {"final_norm": {"scale": (D,)}, "embedding": (V,D)}}`` of numpy arrays
      (compressed matrices as their formats' arrays), and whose spec has ``dtype`` and the
      formats held (``held_formats``).
    Raises:
      HxError: missing/corrupt/truncated file, unsupported architecture or quantisation, a
        tensor missing or of the wrong shape, or one hx does not implement.
    """
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    has_output = "output.weight" in tensors
    spec = spec_from_metadata(meta, path, has_output)
    weight_format, embedding_format = held_formats(tensors, spec, weights)
    spec = spec.replace(dtype=dtype, weight_format=weight_format,
                        embedding_format=embedding_format)
    unknown = sorted(set(tensors) - taken_names(spec) - {ROPE_FREQS})  # ROPE_FREQS: the spec's
    if unknown:
        raise HxError(f"{path}: holds tensor(s) hx does not implement for "
                      f"{meta['general.architecture']}: {', '.join(unknown)}")
    want = numpy_dtype(dtype)

    def tensor(name: str, shape: tuple[int, ...], fmt: str = DENSE,
               rows: tuple[int, int] | None = None, offset: float = 0.0):
        """The tensor of (out..., in) ``shape`` held in ``fmt`` -- its ``rows`` where given,
        less ``offset`` (in float32) where nonzero."""
        if name not in tensors:
            raise HxError(f"{path}: tensor {name} is missing; the file is incomplete")
        t = tensors[name] if rows is None else row_slice(tensors[name], *rows)
        size = tuple(int(n) for n in reversed(t.shape))  # (out, in) or (n,)
        # ``shape`` splits the file's rows (wq: (H, E, D)) or its columns (wo: (D, H, E))
        splits = len(size) == 1 or size[0] == shape[0] or size[-1] == shape[-1]
        if not splits or int(np.prod(size)) != int(np.prod(shape)):
            raise HxError(f"{path}: tensor {name} has shape {size}, expected {shape}")
        if fmt != DENSE and t.tensor_type.name in BLOCK_FORMATS and (
                BLOCK_FORMATS[t.tensor_type.name] == fmt):
            return gguf_blocks(t, shape)
        if t.tensor_type.name in _DENSE_TYPES:
            source = np.asarray(t.data).view(numpy_dtype(_DENSE_TYPES[t.tensor_type.name]))
        else:
            source = _dequantize(t, path)
        if offset:
            source = np.asarray(source, np.float32) - np.float32(offset)
        return held_tensor(source, shape, want, fmt)

    fam = spec.model_family

    def take(layer, op, weight, shape):
        name = fam.gguf_name(layer, op, weight)
        fmt = spec.matrix_format(weight)
        if weight not in fam.gguf_rope_permuted:
            return tensor(name, shape, fmt, fam.gguf_rows(spec, op, weight),
                          fam.gguf_offset(weight))
        heads, head_dim, d = shape  # (H or K, E, D): taken as (rows, D), rows un-permuted
        rows = unpermute_rope_rows(tensor(name, (heads * head_dim, d), fmt), heads)
        return _reshape(rows, shape)

    return GGUFContents(spec=spec, params=weight_tree(spec, take), metadata=meta)


def _reshape(held, shape: tuple[int, ...]):
    """A (rows, in) matrix, or a compressed one's arrays, as logical ``shape`` (views)."""
    if isinstance(held, np.ndarray):
        return held.reshape(shape)
    return held.map(lambda a: a.reshape(*shape[:-1], *a.shape[1:]))
