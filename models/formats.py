"""Weight formats: how a matrix is held -- dense in a float dtype, or compressed group-wise.

A compressed matrix of logical shape ``(out..., in)`` (the checkpoint's layout: the contracted
axis last) is cut along its last axis into groups of ``group`` consecutive elements, and held
as three arrays (in the parameter tree a ``models.compressed.GroupMatrix``, its arrays at
``PATH/codes``, ``PATH/scale``, ``PATH/offset``):

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
name     bits  group  offset scheme (``Format.fit``)                              bits/weight
=======  ====  =====  =====  ===================================================  ==========
int8     8     32     yes    least squared error per group (``mse``, below):      9.0
                             the better of min/max and zero-centred absmax,
                             then a least-squares refit of scale and offset
int4     4     64     yes    FlexGen's 4-bit group-wise compression (Sheng et     4.5
                             al. 2023 §5: group 64, asymmetric min/max)
q8_0     8     32     no     llama.cpp Q8_0: int8 codes, one float16 scale         8.5
q4_0     4     32     no     llama.cpp Q4_0: codes 0..15 centred on 8              4.5
q4_1     4     32     yes    llama.cpp Q4_1: scale d and minimum m                 5.0
=======  ====  =====  =====  ===================================================  ==========

Bits per weight: the code bits plus 16 per float16 scale and 16 per offset, over the group.

int8's fit (``mse``). Per group of 32 it tries candidate (scale, offset) pairs, each rounded to
float16, its codes rounded to nearest (clipped to 0..255) with those rounded values, and keeps
the one whose decoded group has the least squared error (the earlier one on a tie):

1. min/max (FlexGen's scheme at 8 bits): offset = min, scale = (max - min) / 255;
2. zero-centred absmax: scale = max|w| / 127, offset = -128 * scale (codes 1..255 are
   scale * -127..127: the grid of llama.cpp's Q8_0 and of absmax int8, which holds 0 exactly);
   kept only where it covers the group (below);
3. ``MSE_REFITS`` (1) least-squares refit(s) of the best so far: with its codes q fixed, the
   scale and offset minimizing sum (scale * q + offset - w)^2 (ordinary least squares of w on
   q: scale = cov(q, w) / var(q), offset = mean(w) - scale * mean(q)), the scale rounded to
   float16, the offset refit to the rounded scale and rounded, the codes recomputed: one
   alternation of Lloyd's algorithm (Lloyd 1982: codes fixed, refit the levels; levels fixed,
   re-round the codes) with the levels kept a uniform grid, as llama.cpp's K-quants refit
   scale and minimum by least squares from the rounded codes of candidate scales
   (``make_qkx2_quants``, ggml-quants.c).

A candidate other than min/max must cover its group (offset - scale / 2 <= min and max <=
offset + 255 * scale + scale / 2), so every element still decodes within half its group's
step; min/max covers it up to the float16 rounding of its offset and scale. The group's
squared error is therefore never above the min/max scheme's (computed in float32: up to its
rounding). On standard-normal groups it is 9 % below min/max at group 32 (relative RMS error
0.461 % -> 0.440 %); a group whose values lie on a zero-centred grid of a float16 step that
spans max|w| in 127 steps (a Q8_0 block) is held exactly, and one that lies on 16 levels of a
min/max grid (a Q4_1 block) is held up to the float16 rounding of the scale and offset.

Group 32 rather than FlexGen's 64 costs 0.5 bits per weight (9.0 instead of 8.5). On the
accuracy text (``scripts/accuracy.py``: SmolLM2-135M, whose float32 reference is its GGUF's
Q4_1 and Q8_0 values; ``docs/measurements/vm-2026-11-25/accuracy-int8.md``) int8 agreed with
float32 on 97.82 % of the top-1 tokens as min/max at group 64, 98.09 % with least-squares
refits at group 64, 98.99 % as min/max at group 32, and 99.83 % (perplexity -0.01 %) with this
fit at group 32, which holds the Q8_0 token embedding exactly. ``quantize`` takes about 1.8x
the min/max scheme's time (a Llama-2-7B FFN matrix on the 2-core VM: 0.66 s vs 0.37 s).

``DENSE`` means no compression: the matrix is one array in the model's dtype. This module
imports neither JAX nor Flax, nor numpy until a matrix is converted (planners size formats
they never load); a compressed matrix is held as a ``models.compressed.GroupMatrix`` (a pytree
type), which ``models.holding`` makes at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hx.errors import HxError

if TYPE_CHECKING:
    import numpy as np

DENSE = "dense"
# a KV cache held dense in a dtype of its own, not the model's (``ModelSpec.kv_format``):
# llama.cpp holds its cache in float16 whatever its weights
KV_DTYPES = ("float16", "bfloat16", "float32")
PARTS = ("codes", "scale", "offset")
_ITEM_BYTES = {"uint8": 1, "float16": 2, "bfloat16": 2}
# torch's CPU int4 kernel (``hx.host_compute.int4_kernel``) reads a 4-bit matrix in its own
# layout, ``int4pack_arrays``: output rows packed in blocks of 64 (AVX-512; torch packs with the
# running CPU's layout, which only its kernel reads), group sizes of 32 to 256
INT4PACK_PARTS = ("packed", "sz")
INT4PACK_ROW_BLOCK = 64
INT4PACK_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Format:
    """A group-wise compressed format (module docstring).

    Attributes:
      name: the format's name (``FORMATS`` key).
      bits: bits per code, 4 or 8.
      group: elements per group along the last (contracted) axis.
      asymmetric: each group has an offset; else codes centre on 2^(bits-1).
      fit: how ``quantize`` chooses a group's scale and offset: ``minmax`` (FlexGen's min/max
        in an asymmetric format, llama.cpp's absmax in a symmetric one) or ``mse`` (asymmetric
        only: the least squared error of the candidates in the module docstring).
    """

    name: str
    bits: int
    group: int
    asymmetric: bool
    fit: str = "minmax"

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

    def int4pack_arrays(self, shape: tuple[int, ...]
                        ) -> dict[str, tuple[tuple[int, ...], str]] | None:
        """(shape, dtype name) of the arrays of a matrix of logical ``shape`` (out..., in) in
        the layout torch's CPU int4 kernel multiplies (``hx.host_compute.int4_kernel.pack``),
        with N = prod(out), K = in, g = ``group``: ``packed`` uint8 (N, K / 2), the codes in
        torch's row-block order; ``sz`` bfloat16 (K / g, N, 2), each group's scale and zero
        (W = (code - 8) * scale + zero). The same bytes as ``arrays`` for an asymmetric format
        (4 per group either way), 2 more per group for a symmetric one. None where the kernel
        cannot take the matrix: not 4 bits, N not whole row blocks
        (``INT4PACK_ROW_BLOCK``), or a group size it has no kernel for (``INT4PACK_GROUPS``).
        """
        *out, n_in = shape
        n_out = math.prod(out)
        if self.bits != 4 or n_out % INT4PACK_ROW_BLOCK or self.group not in INT4PACK_GROUPS:
            return None
        self.arrays(shape)  # raises on a last axis that is not whole groups
        return {"packed": ((n_out, n_in // 2), "uint8"),
                "sz": ((n_in // self.group, n_out, 2), "bfloat16")}


    def blocks_arrays(self, shape: tuple[int, ...]
                      ) -> dict[str, tuple[tuple[int, ...], str]] | None:
        """(shape, dtype name) of a matrix of logical ``shape`` (out..., in) held in a GGUF's
        own blocks (``GGUF_BLOCKS``), the layout ggml multiplies
        (``hx.host_compute.ggml_kernel``): ``blocks`` uint8 (N, in / g * block bytes), N =
        prod(out), each group's float16 scale, its float16 offset (q4_1's ``m``) and its
        codes (q8_0's as int8: code - 128) -- the same bytes as ``arrays``; a centred format
        (``CENTRED_BLOCKS``: q4_1) in its blocks format's blocks (q4_0: scale and codes) with
        ``centres`` float32 (in / g, N), each group's m + 8 d (``models.compressed.GGUFBlocks``).
        None for a format GGUF has no blocks of."""
        if self.name not in GGUF_BLOCKS:
            return None
        *out, n_in = shape
        self.arrays(shape)  # raises on a last axis that is not whole groups
        n, groups = math.prod(out), n_in // self.group
        held = FORMATS[blocks_format(self.name)]
        arrays = {"blocks": ((n, groups * held.block_bytes), "uint8")}
        if self.name in CENTRED_BLOCKS:
            arrays["centres"] = ((groups, n), "float32")
        return arrays

    @property
    def block_bytes(self) -> int:
        """Bytes of one group held (codes, float16 scale and offset): a GGUF block's size."""
        return self.group * self.bits // 8 + (4 if self.asymmetric else 2)


# The formats that are GGUF block types, with ggml's type numbers (``gguf.GGMLQuantizationType``)
GGUF_BLOCKS = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
REPACK_ROWS = 8  # rows ggml's repacked CPU layout interleaves (block_q4_0x8): whole groups only
# A centred format's GGUF blocks are held as another format's, with each group's centre beside
# them: q4_1's w = d q + m is q4_0's d (q - 8) plus c = m + 8 d, so ggml multiplies it with
# q4_0's kernels and adds the centres' part (``hx.host_compute.ggml_kernel``): 1.3x faster at
# one row and 2x at 32 than ggml's q4_1 kernel, which has no repacked layout on x86 (SmolLM2's
# 1536 x 576 ``ffn_up``, 2 threads, median of 100 interleaved calls on the 2-core VM, ms: 1 row
# 0.048 -> 0.041 repacked; 32 rows 0.910 -> 0.447; Llama-2-7B's 11008 x 4096: 1.49 -> 1.44,
# 40.6 -> 20.4; docs/measurements/log.md, "Q4_1 held centred").
# The weights are the file's exactly; 4 bytes a group of 32 more than the file's 20.
CENTRED_BLOCKS = {"q4_1": "q4_0"}


def blocks_format(name: str) -> str:
    """The GGUF block format a matrix in format ``name`` holds its blocks in under ggml: its
    own, or a centred format's (``CENTRED_BLOCKS``)."""
    return CENTRED_BLOCKS.get(name, name)


def blocks_layout(name: str, repacked: bool) -> str:
    """The name of a GGUF block format's layout as ggml multiplies it: ``name``, or ``"NAME
    repacked"`` where its rows are in ggml's repacked CPU layout (``GGUFBlocks.layout``; the
    keys of ``ggml_kernel.KERNEL_ROWS`` and of a profile's ``ggml_matmul``)."""
    return f"{name} repacked" if repacked else name

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("int8", 8, 32, True, fit="mse"), Format("int4", 4, 64, True),
    Format("q8_0", 8, 32, False), Format("q4_0", 4, 32, False), Format("q4_1", 4, 32, True))}
MSE_REFITS = 1  # least-squares refits of an ``mse`` group's scale and offset (module docstring)
# float32 bytes of a matrix an ``mse`` fit works on at a time: its four working arrays stay in
# the caches (a Llama-2-7B FFN matrix, 11008 x 4096 bfloat16, on the 2-core VM: 1 MiB 0.66 s,
# 4 MiB 0.76 s, 32 MiB 0.95 s)
MSE_CHUNK_BYTES = 1 << 20


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
    values; None for ``DENSE`` and the dense dtypes ``KV_DTYPES``.

    K and V are grouped along the head dim, as FlexGen groups its cache (Sheng et al. 2023
    §5; its cache config is 4-bit, group 64, ``group_dim=2`` of (slots, rows x heads, head
    dim), asymmetric), so a group never spans slots or heads: each new position's K and V
    quantize on their own, inside the step that writes them, and earlier slots are never
    re-quantized. The group is the format's, or the whole head where the head dim is smaller
    (a head of 16 values in int4: one scale and offset per head vector, 6 bits per value).
    Its fit is always ``minmax`` (FlexGen's; int8's weight fit ``mse`` is not used for the
    cache): ``models.layers.quantize_kv`` compresses K and V inside the JAX programs with the
    min/max scheme, and ``quantize`` of this format gives its arrays bit for bit.

    Raises:
      HxError: an unknown format (``get_format``), or a head dim above the format's group that
        is not a multiple of it (the message says what to use instead).
    """
    if name in KV_DTYPES:
        return None
    fmt = get_format(name)
    if fmt is None:
        return None
    if head_dim % fmt.group and head_dim > fmt.group:
        raise HxError(f"a KV cache in {name} groups each head's values in groups of "
                      f"{fmt.group}, and this model's head dim {head_dim} is not a multiple of "
                      f"{fmt.group}: hold its KV cache dense (--kv dense, kv='dense')")
    return Format(fmt.name, fmt.bits, min(head_dim, fmt.group), fmt.asymmetric)


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

    ``minmax`` fit: an asymmetric format takes each group's minimum as offset and (max - min) /
    (2^bits - 1) as scale, both rounded to float16, and rounds each code to nearest with those
    rounded values (FlexGen's min/max scheme, Sheng et al. 2023 §5); a symmetric one takes
    max|w| / (2^(bits-1) - 1) as scale (llama.cpp's Q8_0 reference quantizer at 8 bits). ``mse``
    fit (int8): the candidates of the module docstring, the least squared error kept
    (``_fit_mse``). A group of equal values gets scale 0 under min/max and decodes to its
    offset: exactly that value where it is a float16 (``mse`` keeps min/max there unless a
    candidate decodes closer). Works in float32 on about ``chunk_bytes`` of it at a time (the
    ``mse`` fit: at most ``MSE_CHUNK_BYTES``, in four arrays of that size), rows of groups
    written into the held arrays in place: the temporaries stay a few chunks whatever the
    matrix (a whole Llama-2-7B embedding at once, 131 M weights, took about 2 GB of them).

    Returns:
      {"codes", "scale"[, "offset"]} as ``Format.arrays`` describes, aligned for XLA:CPU to
      use in place.
    """
    import numpy as np

    from hx.models.buffers import aligned_empty

    if fmt.fit == "mse" and not fmt.asymmetric:
        raise HxError(f"format {fmt.name}: the mse fit needs an offset (asymmetric)")
    shapes = fmt.arrays(matrix.shape)
    held = {part: aligned_empty(shape, dtype) for part, (shape, dtype) in shapes.items()}
    groups = math.prod(shapes["scale"][0])
    w_all = np.asarray(matrix).reshape(groups, fmt.group)
    flat = {part: a.reshape(groups, -1) for part, a in held.items()}
    top = (1 << fmt.bits) - 1
    if fmt.fit == "mse":  # several passes over each chunk: chunks that stay in the caches
        chunk_bytes = min(chunk_bytes, MSE_CHUNK_BYTES)
    rows = max(1, chunk_bytes // (4 * fmt.group))
    for lo in range(0, groups, rows):
        w = w_all[lo:lo + rows].astype(np.float32)
        if fmt.fit == "mse":
            codes, scale, offset = _fit_mse(w, top)
            flat["offset"][lo:lo + rows, 0] = offset
            flat["scale"][lo:lo + rows, 0] = scale
            flat["codes"][lo:lo + rows] = pack(codes.astype(np.uint8), fmt)
            continue
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


def _codes_and_error(w: np.ndarray, scale: np.ndarray, offset: np.ndarray, top: int,
                     codes: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Nearest codes of groups ``w`` (G, g) float32 under float32 ``scale`` and ``offset``
    (G,) (float16 values), clipped to 0..``top``, written into ``codes`` (G, g) float32; a
    scale of 0 gives codes 0. Returns each group's squared error (G,) float32, sum over the
    group of (scale * code + offset - w)^2, computed in ``work`` (G, g) float32."""
    import numpy as np

    np.subtract(w, offset[:, None], out=codes)
    with np.errstate(divide="ignore", invalid="ignore"):  # x / inf = 0: scale 0 -> code 0
        codes /= np.where(scale > 0, scale, np.float32(np.inf))[:, None]
    np.rint(codes, out=codes)
    np.clip(codes, 0, top, out=codes)
    np.multiply(codes, scale[:, None], out=work)
    work += offset[:, None]
    work -= w
    return np.einsum("ij,ij->i", work, work)


def _fit_mse(w: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``mse`` fit (module docstring) of groups ``w`` (G, g) float32 at codes 0..``top``.

    Returns:
      (codes (G, g) float32 of integers 0..top, scale (G,) float16, offset (G,) float16).
    """
    import numpy as np

    half = np.float32((top + 1) // 2)  # 128: code of 0 on the zero-centred grid
    f16 = lambda x: np.asarray(x).astype(np.float16).astype(np.float32)  # noqa: E731
    low, high = w.min(axis=-1), w.max(axis=-1)
    codes, trial, work = np.empty_like(w), np.empty_like(w), np.empty_like(w)
    # 1. min/max
    scale, offset = f16((high - low) / top), f16(low)
    error = _codes_and_error(w, scale, offset, top, codes, work)

    def consider(s: np.ndarray, m: np.ndarray, covered: bool = True) -> None:
        """Take (s, m) for the groups where it covers the group and lowers the error."""
        nonlocal scale, offset, error
        with np.errstate(invalid="ignore", over="ignore"):
            e = _codes_and_error(w, s, m, top, trial, work)
            take = covered & (e < error)
        if take.any():
            codes[take] = trial[take]
            scale, offset, error = (np.where(take, s, scale), np.where(take, m, offset),
                                    np.where(take, e, error))

    def covers(s: np.ndarray, m: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            return (s > 0) & (m - s / 2 <= low) & (high <= m + (top + 0.5) * s)

    # 2. the zero-centred absmax grid: scale * (code - 128)
    s = f16(np.maximum(-low, high) / (half - 1))
    with np.errstate(over="ignore"):
        m = f16(-half * s)
    consider(s, m, covers(s, m))
    # 3. least-squares refits of scale and offset given the codes (float64 sums of each group)
    n = w.shape[1]
    sum_w = w.sum(axis=-1, dtype=np.float64)
    for _ in range(MSE_REFITS):
        sum_q = codes.sum(axis=-1, dtype=np.float64)  # integers: exact
        sum_qq = np.einsum("ij,ij->i", codes, codes).astype(np.float64)  # < 2^24: exact
        sum_qw = np.einsum("ij,ij->i", codes, w).astype(np.float64)
        det = n * sum_qq - sum_q * sum_q  # n^2 var(q) >= 0, exact
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            s = f16(np.where(det > 0, (n * sum_qw - sum_q * sum_w) / det, 0))
            m = f16((sum_w - s * sum_q) / n)
        consider(s, m, covers(s, m))
    return codes, scale.astype(np.float16), offset.astype(np.float16)


def dequantize(held: dict[str, np.ndarray], fmt: Format, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 matrix of logical ``shape`` that ``held`` (``quantize``'s arrays) encodes:
    what the programs compute on (``models.compressed.dequantize_parts`` is the same formula in
    JAX)."""
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
