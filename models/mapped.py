"""Checkpoint files mapped into memory: tensors as read-only numpy views of the file.

A mapped tensor costs no host memory of its own: its pages are the kernel's page cache, read
from disk when first touched. They count in the process's resident set (RSS) while mapped and
touched, so a loader or the executor that has made what it keeps of a tensor (a converted or
compressed copy, a device buffer) calls ``release``: the pages leave the process's resident
set (``madvise(MADV_DONTNEED)``) and fault back in from the page cache, or from disk, if the
tensor is read again. A checkpoint larger than the host's memory is read this way one tensor at
a time; ``resident_bytes`` measures what of a tensor is in the resident set.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE


def map_file(path: str) -> np.ndarray:
    """The bytes of ``path`` as a read-only uint8 array backed by a shared mapping."""
    with open(path, "rb") as f:
        return map_open(f)


def map_open(f) -> np.ndarray:
    """The bytes of the open file ``f`` as ``map_file`` gives them (the mapping outlives
    ``f``: an unlinked file stays readable until the array is dropped)."""
    if os.fstat(f.fileno()).st_size == 0:
        return np.zeros(0, np.uint8)
    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapping, np.uint8)


def _mapping(array: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """(the mapping ``array`` views, the address of its first byte), or None when ``array``
    is not a numpy view of a whole-file mapping (``map_file``'s, or ``np.memmap``'s at offset
    0)."""
    if not isinstance(array, np.ndarray):
        return None
    owner, base = array, array.base
    while isinstance(base, np.ndarray):
        owner, base = base, base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap):
        return None
    return base, owner.ctypes.data


def release(array: np.ndarray) -> None:
    """Drop the whole pages under ``array`` from this process's resident set, if it views a
    mapped file (nothing otherwise); its contents stay readable."""
    found = _mapping(array)
    if found is None or array.nbytes == 0:
        return
    mapping, start = found
    begin = array.ctypes.data - start
    lo, hi = -(-begin // PAGE) * PAGE, (begin + array.nbytes) // PAGE * PAGE
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def is_mapped(array: np.ndarray) -> bool:
    """Whether ``array`` views a mapped file."""
    return _mapping(array) is not None


def resident_bytes(array: np.ndarray) -> int:
    """Bytes of the pages under ``array`` that are in this process's resident set: pages
    present in its page table (bit 63 of each ``/proc/self/pagemap`` entry, readable without
    privileges on Linux), not the kernel's page cache -- what ``release`` drops."""
    if array.nbytes == 0:
        return 0
    first = array.ctypes.data // PAGE
    last = (array.ctypes.data + array.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum()) * PAGE
