"""Compressed matrices as pytree types, and the one product over every held matrix.

A weight matrix of logical shape (out..., in) -- the checkpoint's layout, the contracted axis
last -- is held as one of:

* a dense array (``jax.Array`` or numpy) in a float dtype;
* ``GroupMatrix``: a group-wise compressed format of ``models.formats`` (codes, float16 scales
  and, in an asymmetric format, offsets; the ``Format`` static);
* ``Int4Packed``: a 4-bit format in the layout torch's CPU int4 kernel multiplies
  (``Format.int4pack_arrays``: packed codes in torch's row blocks, bfloat16 scale-and-zero
  pairs; the format and the row block static), made at load under ``host_matmul`` torch-int4
  (``hx.host_compute.int4_kernel.int4pack_params``);
* ``GGUFBlocks``: a GGUF block format (q4_0, q4_1, q8_0) in the file's own blocks, the layout
  ggml multiplies (``Format.blocks_arrays``), made at load under ``host_matmul`` ggml
  (``GGUFBlocks.from_group``) -- a projection matrix in q4_0 interleaved by 8 rows as ggml's
  CPU kernels want it where ggml does so on this CPU (``repacked``; ``unrepack_rows``).

The compressed types are registered pytree nodes whose children are keyed as dict entries
(``codes``, ``scale``, ``offset``; ``packed``, ``sz``), so a parameter tree's key paths read
``.../wq/kernel/codes`` as the byte tables (``ModelSpec.op_weight_arrays``), the executor's
placement and ``models.sharding`` name them: every array is placed, streamed, split and
counted as a leaf, and the type rides along as static data.

``product`` dispatches on the held type (``functools.singledispatch``): a dense matrix is
multiplied as it is; a compressed one is decompressed right before its product (``after``)
-- or, an ``Int4Packed`` or ``GGUFBlocks`` one, multiplied by the kernel the caller passes in
``Products``
(the executor passes the host's for host ops, as it passes SCORE's ``attend``), so model code
holds no device choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey

from hx.models.formats import (CENTRED_BLOCKS, REPACK_ROWS, Format, blocks_format,
                               blocks_layout, get_format)


def dequantize_parts(held: Mapping[str, jax.Array], fmt: Format, shape: tuple[int, ...],
                     dtype, after: jax.Array | None = None) -> jax.Array:
    """The array of logical ``shape`` (..., in) that ``fmt``'s arrays ``held`` (codes,
    float16 scales[, offsets], groups along the last axis) encode, in ``dtype``: ``scale *
    code + offset`` (or ``scale * (code - zero)``) in float32, rounded once
    (``models.formats.dequantize`` is the same formula in numpy).

    ``after``: an activation the decompression waits for -- a data dependency (its first
    element times 0 is added to the scales), so the matrix is made right before its product
    and dies after it. Without one XLA schedules every decompression of a program first and
    holds all the matrices at once (measured on XLA:CPU: six SmolLM2 MLP matrices, 21.2 MB of
    temporaries; with it, 3.5 MB: one matrix). The link and memory carry only the codes.
    """
    codes = held["codes"]
    if fmt.bits == 4:  # low nibbles are a group's first half, high nibbles its second
        codes = jnp.concatenate([codes & 15, codes >> 4], axis=-1)
    scale = held["scale"].astype(jnp.float32)
    if after is not None:
        scale = scale + after.reshape(-1)[0].astype(jnp.float32) * 0
    w = codes.astype(jnp.float32)
    if fmt.zero:
        w = w - fmt.zero
    w = w * scale[..., None]
    if fmt.asymmetric:
        w = w + held["offset"].astype(jnp.float32)[..., None]
    return w.reshape(shape).astype(dtype)


@dataclass(frozen=True)
class GroupMatrix:
    """A matrix held group-wise in ``fmt`` (``models.formats``; numpy or JAX arrays).

    Attributes:
      codes: uint8 (out..., in / g, g * bits / 8).
      scale: float16 (out..., in / g).
      offset: float16 (out..., in / g) in an asymmetric format, else None.
      fmt: the format (static: part of the pytree's structure, not a leaf).
    """

    codes: Any
    scale: Any
    offset: Any
    fmt: Format

    @classmethod
    def from_parts(cls, fmt: Format, parts: Mapping[str, Any]) -> "GroupMatrix":
        """From ``Format.arrays``-keyed arrays (``models.formats.quantize``'s)."""
        return cls(parts["codes"], parts["scale"], parts.get("offset"), fmt)

    def parts(self) -> dict[str, Any]:
        """The held arrays keyed as ``Format.arrays`` keys them."""
        held = {"codes": self.codes, "scale": self.scale}
        if self.offset is not None:
            held["offset"] = self.offset
        return held

    def map(self, fn: Callable[[Any], Any]) -> "GroupMatrix":
        """``fn`` applied to every held array (a row gather or reorder, a reshape of the
        leading axes, a copy): the groups stay whole."""
        return GroupMatrix.from_parts(self.fmt, {k: fn(a) for k, a in self.parts().items()})

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape (out..., in)."""
        *out, groups, _ = self.codes.shape
        return (*out, groups * self.fmt.group)

    def decompress(self, dtype, after: jax.Array | None = None) -> jax.Array:
        """The logical matrix in ``dtype`` (``dequantize_parts``)."""
        return dequantize_parts(self.parts(), self.fmt, self.shape, dtype, after)


@dataclass(frozen=True)
class Int4Packed:
    """A 4-bit matrix in torch's CPU int4 layout (``hx.host_compute.int4_kernel.pack``).

    Attributes:
      packed: uint8 (N, K / 2), N = prod(out), K = in: of each block of ``block`` output rows,
        for each input k, byte j holds row j's code in its low nibble and row j + block/2's in
        its high nibble.
      sz: bfloat16 (K / g, N, 2): each group's scale and zero, W = (code - 8) * scale + zero.
      fmt: the 4-bit format it was made from (its group g; static).
      block: torch's row block on the CPU that packed it (64 with AVX-512, 32 with AVX2;
        static).
    """

    packed: Any
    sz: Any
    fmt: Format
    block: int

    def parts(self) -> dict[str, Any]:
        """The held arrays keyed as ``Format.int4pack_arrays`` keys them."""
        return {"packed": self.packed, "sz": self.sz}

    @property
    def shape(self) -> tuple[int, int]:
        """Logical shape (N, K), the output axes flattened."""
        n, half = self.packed.shape
        return n, 2 * half

    def codes(self, lift: Callable[[Any], Any] = lambda c: c) -> Any:
        """The codes (N, K) (``unpack_rows``)."""
        return unpack_rows(self.packed, self.block, lift)

    def decompress(self, dtype, after: jax.Array | None = None) -> jax.Array:
        """The (N, K) matrix in ``dtype``: (code - 8) * scale + zero in float32, rounded once.
        ``after`` as ``dequantize_parts``'s; the codes wait for it too (with only the scales
        waiting, XLA unpacked every matrix of a segment first: a 30-layer SmolLM2 segment's
        temporaries doubled, 9.1 to 18.4 MB)."""
        n, k = self.shape
        # the unpacking waits for ``after`` too (a float dependency: XLA folds an integer x * 0)
        wait = 0.0 if after is None else after.reshape(-1)[0].astype(jnp.float32) * 0
        codes = self.codes(lambda c: c.astype(jnp.float32) + wait) - 8
        sz = self.sz.astype(jnp.float32) + wait
        scale, zero = (sz[..., i].T[..., None] for i in (0, 1))  # (N, K/g, 1)
        w = codes.reshape(n, k // self.fmt.group, self.fmt.group) * scale + zero
        return w.reshape(n, k).astype(dtype)


def unpack_rows(packed, block: int, lift: Callable[[Any], Any] = lambda c: c):
    """Codes (N, K) of torch's int4pack ``packed`` (N, K / 2) uint8 with row blocks of
    ``block`` (``Int4Packed``), each nibble half passed through ``lift`` (a conversion)
    first; numpy or JAX arrays alike (JAX's traced inside a program too)."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    n, half = packed.shape
    v = packed.reshape(n // block, 2 * half, block // 2)
    codes = xp.concatenate([lift(v & 15), lift(v >> 4)], axis=-1)  # (N / B, K, B)
    return codes.transpose(0, 2, 1).reshape(n, 2 * half)


@dataclass(frozen=True)
class GGUFBlocks:
    """A matrix in a GGUF's own blocks (``Format.blocks_arrays``): per row of N = prod(out)
    rows, in / g blocks of ``fmt.block_bytes`` bytes: the group's float16 scale, in q4_1 its
    float16 offset, then its codes (4-bit: element j of the group in the low nibble of byte
    j, j + g/2 in the high one; q8_0: int8, code - 128). A centred format
    (``models.formats.CENTRED_BLOCKS``: q4_1, w = d q + m) holds its blocks in its blocks
    format's (q4_0: the scale d and the codes q, w = d (q - 8)) and each group's centre
    c = m + 8 d beside them, so ggml multiplies it with q4_0's kernels and adds the centres'
    part; the weights are the file's exactly.

    Attributes:
      blocks: uint8 (N, in / g * block bytes of ``blocks_format``).
      fmt: its format (static).
      repacked: the rows are in ggml's repacked CPU layout, the same bytes interleaved by 8
        rows (``unrepack_rows``; static): its kernels are told so.
      centres: a centred format's float32 (in / g, N): group by group, as the product's
        centres' part reads them (``ggml_pool.h``'s ``AddCentres``); None for the others.
    """

    blocks: Any
    fmt: Format
    repacked: bool = False
    centres: Any = None

    def parts(self) -> dict[str, Any]:
        if self.centres is None:
            return {"blocks": self.blocks}
        return {"blocks": self.blocks, "centres": self.centres}

    def map(self, fn: Callable[[Any], Any]) -> "GGUFBlocks":
        """``fn`` applied to the rows (a gather or slice of rows: the blocks stay whole, a
        centred matrix's centres follow their rows; a repacked matrix's rows are interleaved,
        so it takes none).

        Raises:
          ValueError: a repacked matrix's rows would be moved.
        """
        new = fn(self.blocks)
        if self.repacked and new.shape != self.blocks.shape:
            raise ValueError("a repacked GGUFBlocks' rows are interleaved: gather none")
        centres = None if self.centres is None else fn(self.centres.T).T
        return GGUFBlocks(new, self.fmt, self.repacked, centres)

    @property
    def blocks_format(self) -> Format:
        """The format of the blocks held: ``fmt``'s own, or a centred format's blocks format
        (``models.formats.blocks_format``)."""
        return get_format(blocks_format(self.fmt.name))

    @property
    def layout(self) -> str:
        """The format's name, "NAME repacked" where the rows are in ggml's repacked layout
        (the keys of ``Products.blocks_rows``)."""
        return blocks_layout(self.fmt.name, self.repacked)

    @property
    def shape(self) -> tuple[int, int]:
        """The 2-D product's (N, K)."""
        n, row = self.blocks.shape
        return n, row // self.blocks_format.block_bytes * self.fmt.group

    def group_parts(self) -> dict[str, jax.Array]:
        """The ``GroupMatrix`` arrays (codes, scale[, offset]) of the blocks, (N, in / g, ...),
        cut from them in JAX (a centred matrix's offset m = c - 8 d in float32)."""
        held, (n, k) = self.blocks_format, self.shape
        file = unrepack_rows(self.blocks, held) if self.repacked else jnp.asarray(self.blocks)
        b = file.reshape(n, k // held.group, held.block_bytes)

        def half(a: jax.Array) -> jax.Array:  # (..., 2) bytes -> (...) float16
            return jax.lax.bitcast_convert_type(a, jnp.float16)

        parts = {"scale": half(b[..., 0:2])}
        start = 2
        if held.asymmetric:
            parts["offset"], start = half(b[..., 2:4]), 4
        if self.centres is not None:
            zero = held.zero - self.fmt.zero
            parts["offset"] = (jnp.asarray(self.centres, jnp.float32).T
                               - zero * parts["scale"].astype(jnp.float32))
        codes = b[..., start:]
        parts["codes"] = codes ^ 128 if held.bits == 8 else codes
        return parts

    def decompress(self, dtype, after: jax.Array | None = None) -> jax.Array:
        """The (N, K) matrix in ``dtype`` (``dequantize_parts`` of ``group_parts``), its
        blocks read after ``after`` exists (``dequantize_parts``' dependency, on the blocks
        themselves: the codes and scales are both cut from them)."""
        held = self
        if after is not None:
            held = self.map(lambda b: b + (after.reshape(-1)[0] * 0).astype(b.dtype))
        return dequantize_parts(held.group_parts(), self.fmt, self.shape, dtype)

    @classmethod
    def from_group(cls, held: "GroupMatrix", shape: tuple[int, int]) -> "GGUFBlocks":
        """``held`` (numpy arrays) in blocks, as the 2-D product (N, K) ``shape`` it computes
        (``ModelSpec.product_shape``); a centred format's with its centres."""
        fmt = held.fmt
        n, k = shape
        groups = k // fmt.group
        scale = np.asarray(held.scale).reshape(n, groups)
        pieces = [scale.reshape(n, groups, 1).view(np.uint8)]
        centres = None
        if fmt.name in CENTRED_BLOCKS:
            zero = get_format(CENTRED_BLOCKS[fmt.name]).zero - fmt.zero
            centres = np.ascontiguousarray((np.asarray(held.offset, np.float32).reshape(n, groups)
                                            + zero * scale.astype(np.float32)).T)
        elif fmt.asymmetric:
            pieces.append(np.asarray(held.offset).reshape(n, groups, 1).view(np.uint8))
        codes = np.asarray(held.codes).reshape(n, groups, -1)
        pieces.append(codes ^ 128 if fmt.bits == 8 else codes)
        return cls(np.concatenate(pieces, axis=-1).reshape(n, -1), fmt, False, centres)


def row_slice(held, start: int, stop: int):
    """Rows ``start`` .. ``stop`` of a compressed matrix (N, K); a repacked ``GGUFBlocks``'
    interleaved 8-row groups stay whole where ``start`` and ``stop`` (or N) are multiples of 8.

    Raises:
      ValueError: a cut through a repacked matrix's 8-row group.
    """
    if isinstance(held, GGUFBlocks) and held.repacked:
        n = held.blocks.shape[0]
        if start % REPACK_ROWS or (min(stop, n) % REPACK_ROWS and stop < n):
            raise ValueError(f"rows {start}..{stop} cut a repacked matrix's 8-row groups")
        centres = None if held.centres is None else held.centres[:, start:stop]
        return GGUFBlocks(held.blocks[start:stop], held.fmt, True, centres)
    return held.map(lambda a: a[start:stop])


def unrepack_rows(blocks, fmt: Format) -> jax.Array:
    """q4_0 ``blocks`` (N, row bytes) uint8 in ggml's repacked CPU layout back in the file's
    (N % 8 == 0): ggml's ``block_q4_0x8`` (ggml-cpu/repack.cpp, ``make_block_q4_0x8`` with an
    8-byte interleave) holds, per group of 8 rows and per block of 32 columns, the 8 rows'
    float16 scales, then 16 chunks of 8 code bytes -- chunk c is row c mod 8's bytes 8 (c div
    8) .. +8 -- each byte XOR 0x88 (its nibbles' signs flipped). Numpy or JAX in, JAX out."""
    if fmt.name != "q4_0":
        raise ValueError(f"hx reads ggml's repacked layout of q4_0 alone, not {fmt.name}")
    n, row = blocks.shape
    k = row // fmt.block_bytes
    b = jnp.asarray(blocks).reshape(n // 8, k, 8 * fmt.block_bytes)
    scales = b[..., :16].reshape(n // 8, k, 8, 2)
    codes = b[..., 16:].reshape(n // 8, k, 2, 8, 8).transpose(0, 1, 3, 2, 4)
    codes = codes.reshape(n // 8, k, 8, 16) ^ jnp.uint8(0x88)
    file = jnp.concatenate([scales, codes], axis=-1)  # (N/8, k, 8 rows, 18)
    return file.transpose(0, 2, 1, 3).reshape(n, row)


def _register(cls, static: Callable[[Any], tuple], build: Callable[..., Any]) -> None:
    """Register ``cls`` as a pytree node: children ``parts()`` keyed as dict entries, the
    ``static`` fields as auxiliary data; ``build(aux, children)`` rebuilds it."""
    def flatten_with_keys(node):
        parts = node.parts()
        return [(DictKey(k), a) for k, a in parts.items()], (static(node), tuple(parts))

    def flatten(node):
        parts = node.parts()
        return list(parts.values()), (static(node), tuple(parts))

    def unflatten(aux, children):
        fixed, names = aux
        return build(fixed, dict(zip(names, children)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


_register(GroupMatrix, lambda m: m.fmt, GroupMatrix.from_parts)
_register(Int4Packed, lambda m: (m.fmt, m.block),
          lambda fixed, parts: Int4Packed(parts["packed"], parts["sz"], *fixed))
_register(GGUFBlocks, lambda m: (m.fmt, m.repacked),
          lambda fixed, parts: GGUFBlocks(parts["blocks"], *fixed, parts.get("centres")))

COMPRESSED = (GroupMatrix, Int4Packed, GGUFBlocks)


def held_matrix(fmt: Format, parts: Mapping[str, Any], block: Callable[[], int],
                repacked: Callable[[int], bool] = lambda rows: False):
    """The compressed leaf holding ``parts``: an ``Int4Packed`` for the keys of
    ``Format.int4pack_arrays`` (``block()``: torch's row block on this CPU), a ``GGUFBlocks``
    for ``Format.blocks_arrays``' (``repacked(rows)``: held in ggml's repacked layout), else a
    ``GroupMatrix`` (``Format.arrays``' keys). Arrays may be abstract
    (``jax.ShapeDtypeStruct``), for a program's input tree."""
    if "packed" in parts:
        return Int4Packed(parts["packed"], parts["sz"], fmt, block())
    if "blocks" in parts:
        return GGUFBlocks(parts["blocks"], fmt, repacked(parts["blocks"].shape[0]),
                          parts.get("centres"))
    return GroupMatrix.from_parts(fmt, parts)


@dataclass(frozen=True)
class Products:
    """How the device an op runs on multiplies held matrices, passed in by the executor.

    Attributes:
      int4: a product ``(x (M, K) bfloat16, packed, sz, group) -> (M, N) bfloat16`` over an
        ``Int4Packed`` matrix without decompressing it (the host's: torch's CPU int4 kernel,
        ``hx.host_compute.int4_kernel.matmul``); None: decompress for XLA's product.
      int4_rows: the most rows ``int4`` multiplies; past them XLA's product of the
        decompressed matrix is faster (``int4_kernel.KERNEL_ROWS``).
      head_vector_f32: a one-row product against a compressed LM head decompresses the table
        into float32 (XLA:CPU's matrix-vector path widens a bfloat16 matrix anyway: SmolLM2's
        Q8_0 head 3.2 ms into float32 against 4.6 ms into bfloat16, 2-core VM, median of 21).
      blocks: a product ``(x (M, K), held GGUFBlocks) -> (M, N) float32`` over a
        ``GGUFBlocks`` matrix without decompressing it (the host's: ggml's,
        ``hx.host_compute.ggml_kernel.product``); None: decompress for XLA's product.
      blocks_rows: (format name, rows) pairs: the most rows ``blocks`` multiplies in that
        format ("NAME repacked": in ggml's repacked layout); past them XLA's product of the
        decompressed matrix is faster.
      experts: an MoE layer's routed experts ``(x (M, D), ids (M, k), weights (M, k), gate,
        up, down, biases, activation) -> (M, D) float32`` (``models.moe.Experts``), each row
        multiplied by its k experts' matrices as held
        (the host's: ggml's ``mul_mat_id``, ``hx.host_compute.ggml_kernel.experts``); None:
        every expert by XLA (``models.moe.Experts``).
      experts_layouts: the ``GGUFBlocks.layout`` values ``experts`` takes.
    """

    int4: Callable[..., jax.Array] | None = None
    int4_rows: int = 0
    blocks: Callable[..., jax.Array] | None = None
    blocks_rows: tuple[tuple[str, int], ...] = ()
    experts: Callable[..., jax.Array] | None = None
    experts_layouts: tuple[str, ...] = ()

    def takes_blocks(self, held: "GGUFBlocks", rows: int) -> bool:
        """Whether ``blocks`` multiplies the ``GGUFBlocks`` matrix ``held`` at ``rows`` rows
        (``blocks_rows`` of its ``GGUFBlocks.layout``)."""
        return self.blocks is not None and rows <= dict(self.blocks_rows).get(held.layout, 0)

    def takes_experts(self, held: tuple) -> bool:
        """Whether ``experts`` multiplies the stacked experts ``held`` (gate, up, down): each
        a ``GGUFBlocks`` of ``experts_layouts``."""
        return self.experts is not None and all(
            isinstance(m, GGUFBlocks) and m.layout in self.experts_layouts for m in held)
    head_vector_f32: bool = False


DEFAULT_PRODUCTS = Products()


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (N, in) @ w (out, in)^T -> (N, out) float32, in the operands' dtype with float32
    accumulation (``preferred_element_type``).

    A one-row bfloat16 product is computed as two rows, the second zero: XLA:CPU's
    matrix-vector path widens a bfloat16 matrix to a float32 temporary first (Llama-2-7B's
    11008 x 4096: 180 MB of temporaries and 61-94 ms), where its matrix-matrix path multiplies
    bfloat16 as it is (0.09 MB, 5.8-12 ms; this VM, jax 0.10.2, ``models.spec.host_dtype``).
    On a GPU both are bound by reading the matrix, so the extra row costs nothing measurable.
    """
    pad = x.shape[0] == 1 and w.dtype == jnp.bfloat16
    if pad:
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y[:1] if pad else y


@functools.singledispatch
def expert_rows(matrix, ids: np.ndarray, experts: int):
    """Experts ``ids`` (int array) of a stack of ``experts`` matrices held as ``matrix``
    (logical (X, out, in)), in that order, held as the stack is: a dense (X, out, in) array
    taken along its first axis; a 2-D held layout's rows (its N = X out rows, expert e's
    contiguous) taken by whole experts -- ggml's repacked rows stay interleaved within
    their 8, which an expert's out (a multiple of 8) never splits. The arrays are new: numpy
    where ``matrix`` holds numpy arrays, JAX inside a program (a gather of the routed
    experts: ``models.moe.Experts``), but a view where numpy takes a run of consecutive
    experts (so one expert of a mapped file stays a view of the file: ``hx.disk``)."""
    return _take(matrix, ids, 0)


def _xp(array, ids):
    """numpy where both are numpy arrays, else ``jax.numpy`` (inside a program)."""
    return np if isinstance(array, np.ndarray) and isinstance(ids, np.ndarray) else jnp


def _take(array, index, axis: int):
    """``array`` at ``index`` along ``axis``: a slice (a view) where both are numpy and the
    index is a run of consecutive integers, else ``take``."""
    xp = _xp(array, index)
    if xp is np and index.size and np.array_equal(index, np.arange(index.flat[0],
                                                                   index.flat[0] + index.size)):
        return array[(slice(None),) * axis + (slice(int(index.flat[0]),
                                                    int(index.flat[0]) + index.size),)]
    return xp.take(array, index, axis=axis)


def _whole_expert_rows(n: int, ids, experts: int, xp):
    per = n // experts
    return (xp.asarray(ids)[..., None] * per + xp.arange(per)).reshape(-1)


@expert_rows.register
def _(matrix: GroupMatrix, ids, experts: int):
    return matrix.map(lambda a: _take(a, ids, 0))


@expert_rows.register
def _(matrix: Int4Packed, ids, experts: int):
    rows = _whole_expert_rows(matrix.packed.shape[0], ids, experts, _xp(matrix.packed, ids))
    return Int4Packed(_take(matrix.packed, rows, 0), _take(matrix.sz, rows, 1),
                      matrix.fmt, matrix.block)


@expert_rows.register
def _(matrix: GGUFBlocks, ids, experts: int):
    rows = _whole_expert_rows(matrix.blocks.shape[0], ids, experts, _xp(matrix.blocks, ids))
    return GGUFBlocks(_take(matrix.blocks, rows, 0), matrix.fmt, matrix.repacked,
                      None if matrix.centres is None else _take(matrix.centres, rows, 1))


@functools.singledispatch
def product(kernel, x: jax.Array, dtype=None, products: Products = DEFAULT_PRODUCTS,
            after: jax.Array | None = None) -> jax.Array:
    """x (N, in) times a held matrix of logical shape (out..., in...) transposed -> (N, out)
    float32, out and in flattened (the matrix's trailing axes multiply to x's last).

    Dense (this function): in the matrix's dtype, x cast to it. ``GroupMatrix``: decompressed
    into ``dtype`` after ``after`` exists, then as dense. ``Int4Packed``: by
    ``products.int4`` up to ``products.int4_rows`` rows (x rounded to bfloat16, a bfloat16
    product), else decompressed as a ``GroupMatrix`` is.
    """
    return _dot(x.astype(kernel.dtype), kernel.reshape(-1, x.shape[-1]))


@product.register
def _(kernel: GroupMatrix, x, dtype=None, products=DEFAULT_PRODUCTS, after=None):
    return product(kernel.decompress(dtype, after), x)


@product.register
def _(kernel: Int4Packed, x, dtype=None, products=DEFAULT_PRODUCTS, after=None):
    if products.int4 is not None and x.shape[0] <= products.int4_rows:
        y = products.int4(x.astype(jnp.bfloat16), kernel.packed, kernel.sz, kernel.fmt.group)
        return y.astype(jnp.float32)
    return product(kernel.decompress(dtype, after), x)


@product.register
def _(kernel: GGUFBlocks, x, dtype=None, products=DEFAULT_PRODUCTS, after=None):
    if products.takes_blocks(kernel, x.shape[0]):
        return products.blocks(x, kernel)
    return product(kernel.decompress(dtype, after), x)


def check_shape(held, shape: tuple[int, ...], path: str) -> None:
    """Raise ValueError unless the compressed ``held`` holds a matrix of logical ``shape``
    (an ``Int4Packed`` or ``GGUFBlocks`` one as a 2-D product of it: its output axes and its
    contracted ones each flattened)."""
    if isinstance(held, (Int4Packed, GGUFBlocks)):
        fits = any((math.prod(shape[:i]), math.prod(shape[i:])) == held.shape
                   for i in range(1, len(shape)))
    else:
        fits = tuple(held.shape) == tuple(shape)
    if not fits:
        raise ValueError(f"{path}: a {held.fmt.name} matrix of shape {held.shape} where the "
                         f"model expects {tuple(shape)}")
