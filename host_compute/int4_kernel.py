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
import hashlib
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).with_name("int4mm.cc")
TARGET = "hx_int4mm"
GROUPS = (32, 64, 128, 256)  # the group sizes torch's kernel takes
# torch packs output rows in blocks of 64 on AVX-512 CPUs (32 with AVX2 only): a matrix's rows
# must fill whole blocks; it packs with the running CPU's layout, which only its kernel reads
ROW_BLOCK = 64
# torch threads per call: 1 was faster than 2 in every run of the SmolLM2 stack on the 2-core
# VM (8.1-12.4 vs 9.4-12.6 ms; small matrices, XLA's own pool beside it)
THREADS = 1


def kernel_dir() -> Path:
    """Where the library is built: ``HX_KERNEL_DIR`` or ``~/.cache/hx/kernels``, then a digest
    of the source and of the torch and jaxlib versions it is built against."""
    import torch

    root = Path(os.environ.get("HX_KERNEL_DIR",
                               Path.home() / ".cache" / "hx" / "kernels"))
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                         + jax.__version__.encode()).hexdigest()[:16]
    return root / key


def build(out_dir: Path) -> Path:
    """The handler's shared library in ``out_dir``, compiled with g++ when missing.

    Raises:
      OSError, subprocess.CalledProcessError: no compiler, or the build failed.
    """
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    so = out_dir / "libhx_int4mm.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = library_paths()[0]
    partial = out_dir / f"libhx_int4mm.so.{os.getpid()}"  # renamed once whole
    subprocess.run(["g++", "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
                    f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                    f"-I{jax.ffi.include_dir()}", *(f"-I{p}" for p in include_paths()),
                    str(SOURCE), f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}",
                    "-o", str(partial)], check=True, capture_output=True)
    partial.rename(so)
    return so


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
    lib = ctypes.cdll.LoadLibrary(str(so))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.hx_int4mm), platform="cpu")
    return None


def eligible(n_out: int, n_in: int, group: int, bits: int) -> bool:
    """Whether a (n_out, n_in) matrix of 4-bit codes in groups of ``group`` along n_in can be
    multiplied by the kernel: whole row blocks, a group size torch takes, whole groups."""
    return bits == 4 and n_out % ROW_BLOCK == 0 and group in GROUPS and n_in % group == 0


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


def matmul(x: jax.Array, w: jax.Array, sz: jax.Array, group: int) -> jax.Array:
    """x (M, K) bfloat16 @ W^T -> (M, N) bfloat16, W held as ``pack``'s (w, sz) with groups
    of ``group``: torch's kernel through the FFI target (``unavailable()`` must be None), with
    ``THREADS`` torch threads. Usable inside ``jax.jit`` on a CPU device only."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.bfloat16)
    return jax.ffi.ffi_call(TARGET, out)(x, w, sz, group=np.int64(group),
                                         threads=np.int64(THREADS))
