"""Host arrays that XLA can use in place.

XLA:CPU wraps a host array whose data is 64-byte aligned instead of copying it (measured with
jax 0.10: a 256 MiB float32 array put on both CPU devices added 0 bytes of RSS aligned, 256 MiB
per device at numpy's 16-byte alignment). Loaders allocate weights here, so weights placed on
a CPU device -- the host, or an accelerator emulated by a second CPU device -- share the
loader's buffer: one copy of each weight in host memory, not one per placement. On a GPU the
accelerator's copies are H2D transfers either way. The arrays are never written after loading
(an aliased device buffer would see the write).
"""

from __future__ import annotations

import numpy as np

ALIGNMENT = 64  # bytes


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts at a multiple of ``ALIGNMENT``."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous, aligned copy of ``array`` (any strides: a transposed view is fine)."""
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def is_aligned(array: np.ndarray) -> bool:
    """Whether XLA:CPU can use ``array`` in place: C-contiguous, data at a multiple of
    ``ALIGNMENT``."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0
