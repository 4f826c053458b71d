"""Weight formats: how a matrix is held -- dense in a float dtype, or compressed group-wise.

A compressed matrix of logical shape ``(out..., in)`` (the checkpoint's layout: the contracted
axis last) is cut along its last axis into groups of ``group`` consecutive elements, and held
as three arrays under the matrix's path in the parameter tree:

* ``codes``: uint8 ``(out..., in / group, group * bits / 8)``; at 4 bits, byte j of a group
  holds element j in its low nibble and element j + group/2 in its high nibble (the block
  layout of llama.cpp's Q4_0/Q4_1, so GGUF blocks are taken as they are);
* ``scale``: float16 ``(out..., in / group)``;
* ``offset``: float16 ``(out..., in / group)``, only for asymmetric formats.

An element is ``scale * code + offset`` (asymmetric) or ``scale * (code - 2^(bits-1))``
(symmetric), computed in float32: the product of a float16 scale and a code of at most 8 bits
is exact in float32, so the GGUF formats decode to exactly the values llama.cpp's (and the
``gguf`` package's) dequantization gives.

Formats (``FORMATS``):

=======  ====  =====  =====  ===================================================  ==========
name     bits  group  offset scheme                                               bits/weight
=======  ====  =====  =====  ===================================================  ==========
int8     8     64     yes    min/max per group, round to nearest (FlexGen's        8.5
                             scheme, Sheng et al. 2023 §5, at 8 bits)
int4     4     64     yes    FlexGen's 4-bit group-wise compression (§5: group     4.5
                             64, asymmetric min/max)
q8_0     8     32     no     llama.cpp Q8_0: int8 codes, one float16 scale         8.5
q4_0     4     32     no     llama.cpp Q4_0: codes 0..15 centred on 8              4.5
q4_1     4     32     yes    llama.cpp Q4_1: scale d and minimum m                 5.0
=======  ====  =====  =====  ===================================================  ==========

``DENSE`` means no compression: the matrix is one array in the model's dtype. This module
imports neither JAX nor Flax, nor numpy until a matrix is converted (planners size formats
they never load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hx.errors import HxError

if TYPE_CHECKING:
    import numpy as np

DENSE = "dense"
PARTS = ("codes", "scale", "offset")
_ITEM_BYTES = {"uint8": 1, "float16": 2}


@dataclass(frozen=True)
class Format:
    """A group-wise compressed format (module docstring).

    Attributes:
      name: the format's name (``FORMATS`` key).
      bits: bits per code, 4 or 8.
      group: elements per group along the last (contracted) axis.
      asymmetric: each group has an offset (its minimum); else codes centre on 2^(bits-1).
    """

    name: str
    bits: int
    group: int
    asymmetric: bool

    @property
    def zero(self) -> int:
        """The code of 0.0 in a symmetric format (2^(bits-1)); 0 in an asymmetric one."""
        return 0 if self.asymmetric else 1 << (self.bits - 1)

    def arrays(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, dtype name) of each held array of a matrix of logical ``shape``.

        Raises:
          HxError: the last axis is not a multiple of ``group``.
        """
        *out, n_in = shape
        if n_in % self.group:
            raise HxError(f"a {self.name} matrix needs its last axis to be a multiple of "
                          f"{self.group}; shape {shape} is not: hold it dense")
        groups = (*out, n_in // self.group)
        held = {"codes": ((*groups, self.group * self.bits // 8), "uint8"),
                "scale": (groups, "float16")}
        if self.asymmetric:
            held["offset"] = (groups, "float16")
        return held

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes held for a matrix of logical ``shape`` (codes, scales and offsets)."""
        return sum(math.prod(s) * _ITEM_BYTES[d] for s, d in self.arrays(shape).values())


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("int8", 8, 64, True), Format("int4", 4, 64, True),
    Format("q8_0", 8, 32, False), Format("q4_0", 4, 32, False), Format("q4_1", 4, 32, True))}


def get_format(name: str) -> Format | None:
    """The ``Format`` named ``name``; None for ``DENSE``.

    Raises:
      HxError: an unknown name (the message lists the formats).
    """
    if name == DENSE:
        return None
    if name not in FORMATS:
        raise HxError(f"unknown weight format {name!r}; choose {DENSE}, {', '.join(FORMATS)}")
    return FORMATS[name]


def kv_cache_format(name: str, head_dim: int) -> Format | None:
    """The ``Format`` a KV cache held in format ``name`` uses, for heads of ``head_dim``
    values; None for ``DENSE``.

    K and V are grouped along the head dim, as FlexGen groups its cache (Sheng et al. 2023
    §5; its cache config is 4-bit, group 64, ``group_dim=2`` of (slots, rows x heads, head
    dim), asymmetric), so a group never spans slots or heads: each new position's K and V
    quantize on their own, inside the step that writes them, and earlier slots are never
    re-quantized. The group is the format's, or the whole head where the head dim is smaller
    (a head of 16 values in int4: one scale and offset per head vector, 6 bits per value).

    Raises:
      HxError: an unknown format (``get_format``), or a head dim above the format's group that
        is not a multiple of it (the message says what to use instead).
    """
    fmt = get_format(name)
    if fmt is None:
        return None
    if head_dim <= fmt.group:
        return Format(fmt.name, fmt.bits, head_dim, fmt.asymmetric)
    if head_dim % fmt.group:
        raise HxError(f"a KV cache in {name} groups each head's values in groups of "
                      f"{fmt.group}, and this model's head dim {head_dim} is not a multiple of "
                      f"{fmt.group}: hold its KV cache dense (--kv dense, kv='dense')")
    return fmt


def pack(codes: np.ndarray, fmt: Format) -> np.ndarray:
    """Codes (..., group) uint8 < 2^bits -> the held bytes (..., group * bits / 8)."""
    import numpy as np

    if fmt.bits == 8:
        return codes
    half = fmt.group // 2
    return codes[..., :half] | (codes[..., half:] << np.uint8(4))


def unpack(held: np.ndarray, fmt: Format) -> np.ndarray:
    """Inverse of ``pack``: (..., group * bits / 8) uint8 -> codes (..., group) uint8."""
    import numpy as np

    if fmt.bits == 8:
        return held
    return np.concatenate([held & np.uint8(15), held >> np.uint8(4)], axis=-1)


def quantize(matrix: np.ndarray, fmt: Format, chunk_bytes: int = 32 << 20
             ) -> dict[str, np.ndarray]:
    """Compress ``matrix`` (out..., in), any float dtype, into ``fmt``'s arrays.

    Asymmetric formats take each group's minimum as offset and (max - min) / (2^bits - 1) as
    scale, both rounded to float16, and round each code to nearest with those rounded values
    (FlexGen's min/max scheme, Sheng et al. 2023 §5); symmetric ones take max|w| / (2^(bits-1)
    - 1) as scale. A group of equal values gets scale 0 and decodes exactly to its offset
    (asymmetric) or to 0 (symmetric). Works in float32 on about ``chunk_bytes`` of it at a
    time, rows of groups written into the held arrays in place: the temporaries stay a few
    chunks whatever the matrix (a whole Llama-2-7B embedding at once, 131 M weights, took
    about 2 GB of them).

    Returns:
      {"codes", "scale"[, "offset"]} as ``Format.arrays`` describes, aligned for XLA:CPU to
      use in place.
    """
    import numpy as np

    from hx.models.buffers import aligned_empty

    shapes = fmt.arrays(matrix.shape)
    held = {part: aligned_empty(shape, dtype) for part, (shape, dtype) in shapes.items()}
    groups = math.prod(shapes["scale"][0])
    w_all = np.asarray(matrix).reshape(groups, fmt.group)
    flat = {part: a.reshape(groups, -1) for part, a in held.items()}
    top = (1 << fmt.bits) - 1
    rows = max(1, chunk_bytes // (4 * fmt.group))
    for lo in range(0, groups, rows):
        w = w_all[lo:lo + rows].astype(np.float32)
        if fmt.asymmetric:
            low = w.min(axis=-1)
            offset = low.astype(np.float16)
            scale = ((w.max(axis=-1) - low) / top).astype(np.float16)
            base = offset.astype(np.float32)[:, None]
            flat["offset"][lo:lo + rows, 0] = offset
        else:
            scale = (np.abs(w).max(axis=-1) / (fmt.zero - 1)).astype(np.float16)
            base = np.float32(0)
        flat["scale"][lo:lo + rows, 0] = scale
        step = scale.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            codes = np.where(step > 0, np.rint((w - base) / step), 0) + fmt.zero
        flat["codes"][lo:lo + rows] = pack(np.clip(codes, 0, top).astype(np.uint8), fmt)
    return held


def dequantize(held: dict[str, np.ndarray], fmt: Format, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 matrix of logical ``shape`` that ``held`` (``quantize``'s arrays) encodes:
    what the programs compute on (``models.llama.dequantize`` is the same formula in JAX)."""
    import numpy as np

    codes = unpack(np.asarray(held["codes"]), fmt).astype(np.float32) - fmt.zero
    w = codes * np.asarray(held["scale"], np.float32)[..., None]
    if fmt.asymmetric:
        w = w + np.asarray(held["offset"], np.float32)[..., None]
    return w.reshape(shape)


def dequantize_into(held: dict[str, np.ndarray], fmt: Format, out: np.ndarray) -> np.ndarray:
    """``dequantize`` written into ``out``: a C-contiguous float32 array of the logical shape
    (..., in) whose leading axes are those of ``held["scale"]`` without its last. The same
    formula, in the same order (code, minus the zero, times the scale, plus the offset, in
    float32), so the values are ``dequantize``'s, in two or three passes over ``out`` (the
    codes converted as they are multiplied: 4-6x faster than casting them first, on a 256 x 3
    x 64 chunk here); the temporaries are the groups' float32 scales and offsets and, at 4 bits,
    one nibble half of the codes, so a caller decoding block after block reuses one buffer
    (host attention over a compressed KV cache: ``hx.host_compute.attention``).

    Returns:
      ``out``.
    """
    import numpy as np

    codes = np.asarray(held["codes"])
    groups = out.reshape(*codes.shape[:-1], fmt.group)  # a view: out is contiguous
    scale = np.asarray(held["scale"], np.float32)[..., None]  # small: one per group
    halves = ([(groups, codes)] if fmt.bits == 8 else
              [(groups[..., :fmt.group // 2], codes & np.uint8(15)),
               (groups[..., fmt.group // 2:], codes >> np.uint8(4))])
    for part, part_codes in halves:  # code (- zero) times scale, from the uint8 codes
        if fmt.zero:
            np.subtract(part_codes, np.float32(fmt.zero), out=part)
            part *= scale
        else:
            np.multiply(part_codes, scale, out=part)
    if fmt.asymmetric:
        groups += np.asarray(held["offset"], np.float32)[..., None]
    return out


def hold(matrix, fmt_name: str):
    """``matrix`` as format ``fmt_name`` holds it: itself when dense, else ``quantize``'s
    arrays."""
    import numpy as np

    fmt = get_format(fmt_name)
    return matrix if fmt is None else quantize(np.asarray(matrix), fmt)


def held_tensor(array: np.ndarray, shape: tuple[int, ...], dtype, fmt_name: str = DENSE):
    """A checkpoint tensor as hx holds it, made once, tensor by tensor: ``array`` reshaped to
    ``shape`` (a view), kept as it is when dense, already of numpy ``dtype`` and either mapped
    (no copy) or aligned for XLA:CPU to use in place (``models.buffers``); else converted to
    ``dtype`` (an aligned copy) or compressed into ``fmt_name`` -- and then the pages of a
    mapped source leave the resident set (``models.mapped.release``).

    Raises:
      HxError: ``array`` does not have ``shape``'s number of elements.
    """
    from hx.models.buffers import aligned_empty, is_aligned
    from hx.models.mapped import is_mapped, release

    if array.size != math.prod(shape):
        raise HxError(f"a tensor of shape {array.shape} cannot be held as {shape}")
    view = array.reshape(shape)
    if fmt_name == DENSE and view.dtype == dtype and (is_mapped(view) or is_aligned(view)):
        return view
    if fmt_name == DENSE:
        held = aligned_empty(shape, dtype)
        held[...] = view  # converted in place, no intermediate copy
    else:
        held = hold(view, fmt_name)
    release(array)
    return held


def hold_tree(tree: dict, format_of, prefix: str = "") -> dict:
    """A parameter (sub)tree with every leaf at path P (keys joined by "/", below
    ``prefix``) held as ``hold(leaf, format_of(P))``: compressed matrices become subtrees of
    their arrays, other leaves stay as they are."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        out[key] = (hold_tree(value, format_of, path) if isinstance(value, dict)
                    else hold(value, format_of(path)))
    return out
