"""Host products over 4-bit group-wise weights with torch's CPU int4 kernel, called from inside
XLA programs as an XLA FFI custom call.

XLA:CPU does not fuse a decompression into its dot: it writes the decompressed matrix out and
reads it back. One batch-1 SmolLM2 decode step's products (30 layers + the LM head) took 30.1 ms
in float32 and 118 ms with the GGUF's Q4_1/Q8_0 blocks decompressed in XLA, where torch's
``_weight_int4pack_mm_for_cpu`` (bfloat16 activations, a bfloat16 scale and zero per group)
took 8.3 ms called from the same jitted program through this module: 1.1-1.8 us a call, where
``jax.pure_callback`` costs ~150 us (``scripts/ffi_int4/bench.py``; docs/measurements/log.md,
"Bytes, third part"). Its products are bfloat16-class: 3.7e-3 relative error against float64
(hx's XLA bfloat16 products: 2.2e-3 to 4.4e-3). XLA runs a custom call in series with the rest
of its program.

``int4mm.cc`` (the handler) is compiled once per (source, torch, jaxlib) with g++ against
torch's and jaxlib's headers into ``~/.cache/hx/kernels/<digest>/`` (``HX_KERNEL_DIR``
overrides the root; 10-15 s on the 2-core VM) and registered with ``jax.ffi``; without torch
or a compiler ``unavailable()`` says why and callers keep XLA's path. torch's OpenMP threads
must not spin beside XLA's pool (``OMP_WAIT_POLICY=PASSIVE``, set before torch loads).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hx.errors import HxError
from hx.host_compute import ffi_build
from hx.models.compressed import GroupMatrix, Int4Packed, unpack_rows
from hx.models.formats import unpack
from hx.models.holding import relayout

SOURCE = Path(__file__).with_name("int4mm.cc")
TARGET = "hx_int4mm"
# Threads and rows, measured on the 2-core VM (median of 9, one call, ms; "xla": the matrix
# decompressed from this layout in XLA, then XLA's bfloat16 product):
#
#   (N x K), rows M     M=1    8      16     32     64
#   1536 x 576, 1 thr   0.06   0.21   0.35   0.68   1.44
#               2 thr   0.07   0.22   0.37   0.71   1.37
#               xla     0.71   0.76   0.78   0.86   1.27
#   11008 x 4096, 1     2.45   8.61   17.2   34.0   68.2
#               2       1.30   4.48   8.76   17.1   34.2
#               xla     47.0   46.0   47.8   52.1   60.9
#
# The kernel's time grows with M and XLA's hardly does: past ``KERNEL_ROWS`` rows (a prefill
# chunk) the matrix is decompressed for XLA's product instead. One thread serves a small
# product best (XLA's pool runs beside it), all of them a large one: ``SMALL_WORK``.
KERNEL_ROWS = 32
SMALL_WORK = 1 << 24  # M * N * K at most this: one torch thread


def kernel_dir() -> Path:
    """Where the library is built (``ffi_build.kernel_dir``: a digest of the source and of the
    torch and jaxlib versions it is built against)."""
    import torch

    return ffi_build.kernel_dir(SOURCE.read_bytes(), torch.__version__.encode())


def build(out_dir: Path) -> Path:
    """The handler's shared library in ``out_dir``, compiled with g++ when missing
    (``ffi_build.compile_handler``).

    Raises:
      OSError, subprocess.CalledProcessError: no compiler, or the build failed.
    """
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    lib = library_paths()[0]
    return ffi_build.compile_handler([SOURCE], out_dir / "libhx_int4mm.so", [
        "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in include_paths()), f"-L{lib}", "-ltorch_cpu", "-lc10",
        f"-Wl,-rpath,{lib}"])


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None once the kernel is built and registered with JAX; else why it cannot be (no torch,
    no compiler, a failed build)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (pip install torch, its CPU build)"
    try:
        so = build(kernel_dir())
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        return f"building {SOURCE.name} failed: {e} {err.decode(errors='replace')[-300:]}"
    if row_block() is None:
        return ("torch packs 4-bit weights in a layout hx does not decode (torch "
                f"{torch.__version__}); hx knows row blocks of {', '.join(map(str, ROW_BLOCKS))}")
    lib = ctypes.cdll.LoadLibrary(str(so))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.hx_int4mm), platform="cpu")
    return None


ROW_BLOCKS = (64, 32)  # torch's row blocks: 64 rows with AVX-512, 32 with AVX2 only


@functools.lru_cache(maxsize=1)
def row_block() -> int | None:
    """The rows B of torch's int4pack row blocks on this CPU, found by packing a probe: of
    each block of B output rows, for each input k, byte j holds row j's code in its low nibble
    and row j + B/2's in its high nibble (aten's ``_convert_weight_to_int4pack_for_cpu``: 64
    rows with AVX-512, 32 with AVX2 only). None where no block size of ``ROW_BLOCKS`` decodes
    the probe (a torch whose layout hx does not know)."""
    import torch

    codes = np.random.default_rng(0).integers(0, 16, (128, 64)).astype(np.int32)
    held = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes), 1)
    held = held.numpy()
    for block in ROW_BLOCKS:
        if held.shape == (128, 32) and np.array_equal(unpack_rows(held, block), codes):
            return block
    return None


def pack(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, zero_code: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's arrays of W = scale * (code - zero_code) + offset (hx's group-wise formats,
    ``models.formats``).

    Args:
      codes: (N, K) integers 0..15.
      scale, offset: (N, K / g) float (offset None: 0).
      zero_code: the code of 0 (8 in a symmetric format, 0 in an asymmetric one).
    Returns:
      w: (N, K / 2) uint8, torch's packed layout (``_convert_weight_to_int4pack_for_cpu``);
      sz: (K / g, N, 2) bfloat16 (as uint16 bits' dtype ``ml_dtypes.bfloat16``): scale and
        zero = offset + scale * (8 - zero_code), in float32 then rounded once, so that W =
        (code - 8) * scale + zero (torch's formula).
    """
    import torch

    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(np.ascontiguousarray(codes, np.int32)), 1).numpy()
    s = np.asarray(scale, np.float32)
    z = s * np.float32(8 - zero_code)
    if offset is not None:
        z = z + np.asarray(offset, np.float32)
    sz = np.stack([s.T, z.T], axis=-1).astype(jnp.bfloat16)
    return w, np.ascontiguousarray(sz)


def int4pack(held: GroupMatrix, shape: tuple[int, int]) -> Int4Packed:
    """A 4-bit group-wise matrix (``models.compressed.GroupMatrix``: codes, float16
    scales[, offsets]) in the kernel's layout (``Format.int4pack_arrays``; ``pack``), as the
    2-D product (N, K) ``shape`` it computes (``ModelSpec.product_shape``: OUT's (D, H, E)
    kernel as (D, H * E)). Works on one matrix at a time: its codes unpacked to int32 (8
    bytes a weight) are the largest temporary."""
    fmt = held.fmt
    n_out, n_in = shape
    codes = unpack(np.asarray(held.codes), fmt).reshape(n_out, n_in)
    groups = (n_out, n_in // fmt.group)
    packed, sz = pack(codes, np.asarray(held.scale).reshape(groups),
                      None if held.offset is None else np.asarray(held.offset).reshape(groups),
                      fmt.zero)
    return Int4Packed(packed, sz, fmt, row_block())


def int4pack_params(spec, params: dict) -> dict:
    """``params`` with every matrix ``spec`` holds in the kernel's layout (``host_matmul``
    torch-int4) converted by ``int4pack`` (``models.holding.relayout``), in place."""
    return relayout(spec, params, "packed", int4pack)


def matmul(x: jax.Array, w: jax.Array, sz: jax.Array, group: int) -> jax.Array:
    """x (M, K) bfloat16 @ W^T -> (M, N) bfloat16, W held as ``pack``'s (w, sz) with groups
    of ``group``: torch's kernel through the FFI target, on one torch thread up to
    ``SMALL_WORK`` multiply-adds, else on as many as this process may use. Usable inside
    ``jax.jit`` on a CPU device only.

    Raises:
      HxError: the kernel cannot be built or loaded (``unavailable`` says why).
    """
    reason = unavailable()
    if reason is not None:
        raise HxError(f"torch's int4 kernel is unavailable: {reason}; run with host_matmul "
                      "xla (--host-matmul xla)")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.bfloat16)
    work = x.shape[0] * w.shape[0] * x.shape[1]
    threads = 1 if work <= SMALL_WORK else len(os.sched_getaffinity(0))
    return jax.ffi.ffi_call(TARGET, out)(x, w, sz, group=np.int64(group),
                                         threads=np.int64(threads))
