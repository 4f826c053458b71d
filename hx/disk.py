"""The disk tier: weights homed on disk, read from a mapped file every step (docs/architecture.md,
"The executor").

A disk-homed tensor is a read-only view of a mapped file (``models.mapped``) in the dtype and
format the accelerator holds it in (``models.tensors.held_weights``): the checkpoint's own
bytes where the loader left the tensor a view of its file (``models.holding.held_tensor``: a
safetensors or GGUF tensor held as stored), else written once, at construction, to a **spill
file** in the directory the caller gives (``Executor(spill_dir=...)``): random weights, a
tensor converted to another dtype or compressed. The spill file is a ``tempfile`` opened
without a name (unlinked at once), so it lives exactly as long as its mapping and no crash
leaves it behind; each tensor starts on a page, so ``release`` drops all of its pages.

Between steps a disk-homed tensor costs no host memory. Each step the executor reads a
segment's disk-homed tensors into host memory (``read``: ``device_put`` into the
accelerator's ``pinned_host`` memory kind, the source of a DMA copy on a GPU) and releases
the file's pages (``models.mapped.release``) as soon as the read buffer holds them, copies
them to the accelerator with the segment's stage, and once the segment has run drops the read
buffers and releases the pages again (XLA:CPU wraps a 64-byte aligned view instead of copying
it: there the read buffer is the mapped pages, read by the stage): the resident set holds at
most the two segments of the stage double buffer. Reads and the stages that use them run on
one disk thread, in issue order, so the executor goes on issuing (and the devices computing)
the segments before them while a segment's weights come off the disk.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np

from hx.errors import HxError
from hx.host_compute.stream import Deferred, resolve
from hx.models.mapped import PAGE, is_mapped, map_open, release


@lru_cache(maxsize=1)
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="hx-disk")


def read(trees: tuple, sharding) -> tuple:
    """``put`` mapped ``trees`` into host memory (``sharding``: the accelerator's
    ``pinned_host`` kind) one tensor at a time, releasing each tensor's pages once it is read
    (module docstring), so no more than one tensor is both mapped and copied.

    Returns:
      as ``put``.
    """
    def read_one(tensor: np.ndarray) -> jax.Array:
        buffer = jax.device_put(tensor, sharding).block_until_ready()
        release(tensor)
        return buffer

    done = _worker().submit(lambda: tuple(
        None if t is None else jax.tree.map(read_one, t) for t in trees))
    return tuple(None if t is None else Deferred(done, k) for k, t in enumerate(trees))


def put(trees: tuple, sharding) -> tuple:
    """``jax.device_put`` every tree of ``trees`` that is not None onto ``sharding``, on the
    disk thread after everything submitted before (``Deferred`` leaves of ``trees`` resolved
    there).

    Returns:
      per tree, a ``hx.host_compute.stream.Deferred`` of the placed tree (None for None).
    """
    done = _worker().submit(lambda: tuple(
        None if t is None else jax.device_put(t, sharding) for t in resolve(trees)))
    return tuple(None if t is None else Deferred(done, k) for k, t in enumerate(trees))


@dataclass(frozen=True)
class _Spilled:
    """A tensor written to the spill file: its byte offset, shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


class DiskTier:
    """The files disk-homed tensors are read from: the checkpoint's, or one spill file.

    ``hold`` each disk-homed tensor, then ``finish`` the tree that holds them.

    Args:
      spill_dir: directory of the spill file (None: tensors that are not views of a file
        in the held dtype are refused).
      plan: the plan's name, for messages.
    """

    def __init__(self, spill_dir: str | None, plan: str):
        self.spill_dir, self.plan = spill_dir, plan
        self._file = None
        self._spilled: dict[int, _Spilled] = {}  # id(tensor) -> where it was written
        self.spilled_bytes = 0

    def hold(self, tensor: np.ndarray, dtype: np.dtype, where: str) -> Any:
        """``tensor`` as the disk tier holds it in ``dtype``: itself when it is a contiguous
        view of a mapped file in ``dtype`` (its pages released), else a record of where it
        was written to the spill file (``finish`` makes it a view).

        Raises:
          HxError: the tensor needs a spill file and there is no ``spill_dir``.
        """
        if is_mapped(tensor) and tensor.dtype == dtype and tensor.flags.c_contiguous:
            release(tensor)
            return tensor
        if id(tensor) in self._spilled:  # a tied embedding
            return self._spilled[id(tensor)]
        if self.spill_dir is None:
            raise HxError(
                f"plan {self.plan!r} keeps {where} on disk, but its weights are not a file hx "
                f"can map as {np.dtype(dtype).name} (random weights, or converted or "
                "compressed when loaded): give a directory to write them to once (Executor "
                "or Engine spill_dir=, hx generate --spill-dir), or load a checkpoint whose "
                "tensors are stored in the dtype and format hx holds")
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.spill_dir, prefix="hx-spill-")
        offset = self._file.seek(0, 2)
        data = np.ascontiguousarray(tensor, dtype=dtype)
        self._file.write(data.reshape(-1).view(np.uint8).data)
        self._file.write(bytes(-self._file.tell() % PAGE))  # the next tensor starts on a page
        self._spilled[id(tensor)] = record = _Spilled(offset, data.shape, np.dtype(dtype))
        self.spilled_bytes += data.nbytes
        return record

    def finish(self, tree: Any) -> Any:
        """``tree`` with every spill record replaced by a view of the mapped spill file (one
        view per record, however often it occurs)."""
        if self._file is None:
            return tree
        self._file.flush()
        data = map_open(self._file)
        self._file.close()  # the mapping keeps the unlinked file
        self._file = None

        views: dict[_Spilled, np.ndarray] = {}

        def view(record: _Spilled) -> np.ndarray:
            if record not in views:
                nbytes = int(np.prod(record.shape, dtype=np.int64)) * record.dtype.itemsize
                views[record] = data[record.offset:record.offset + nbytes].view(
                    record.dtype).reshape(record.shape)
            return views[record]

        return jax.tree.map(lambda x: view(x) if isinstance(x, _Spilled) else x, tree,
                            is_leaf=lambda x: isinstance(x, _Spilled))
