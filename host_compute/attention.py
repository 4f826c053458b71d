"""SCORE on the host over a large KV cache: attention in numpy, outside XLA.

Decode attention on the host is bound by reading the KV cache, and XLA:CPU's kernels read it
at a small share of memory bandwidth (Llama-2-7B decode shapes: 4-10 GB/s on the H100
machine's 16-core host, 0.8-9 GB/s on the 2-core VM, bfloat16 the slowest). This kernel reads
only the used prefix of each row's cache (slots ``kv_start[b] .. write_index + T - 1``),
multiplies with BLAS through numpy (which releases the interpreter lock) and spreads (rows, KV
heads) tasks over a thread pool with one thread per core: 26-37 GB/s in float32 and 6-12 GB/s
in bfloat16 on the H100 host (bf16 before the reused cast buffer below), 17-20 GB/s in float32
and 7-11 GB/s in bfloat16 on the VM (``scripts/bench_host_attention.py``). A bfloat16 cache is
cast ``SLOT_CHUNK`` slots at a time into a reused per-task float32 buffer, so scratch memory
stays a few MiB per thread whatever the context; a compressed cache (``ModelSpec.kv_format``,
``CompressedKV``) is decompressed into that buffer the same way, chunk by chunk
(``models.formats.dequantize_into``), so the kernel reads only its codes, scales and offsets.

Small caches stay with XLA's kernel (``xla_attention``; ``attends_in_numpy`` decides per
compiled shape). ``host_view`` gives zero-copy numpy views of the XLA host buffers the KV
caches live in (they stay XLA arrays: appends are XLA programs with the caches donated, so in
place), and ``hx.programs.SplitHostProgram`` runs a host segment holding SCORE as XLA programs
cut after each SCORE with this kernel between them.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np

from hx.host_compute.xla_attention import blocked_attention
from hx.models.formats import Format, dequantize_into
from hx.models.layers import Cache, Step, visible
from hx.models.tensors import kv_key

SLOT_CHUNK = 256  # cache slots widened to float32 and multiplied at a time
SCORE_BYTES = 8 << 20  # float32 scores held per task: bounds the query block of a prefill
MIN_TASK_BYTES = 1 << 20  # cache bytes worth a thread (~50 us at 20 GB/s: a hand-off's cost)
# KV bytes of one SCORE (2 B S K E x itemsize) from which a host segment attends in numpy; below
# it XLA's blocked kernel (``xla_attention``) is about as fast and keeps the step asynchronous
# (numpy makes the executor wait, which cost the H100's 2 x 8 and 4 x 4 decode blocks at
# 12-25 MB of cache 28-40 %). One decode step's attention, XLA vs numpy
# (``scripts/bench_host_attention.py``): H100 host, 16 cores, Llama-2-7B shapes: 71 MB bf16
# 11.2 vs 11.3 ms, 143 MB f32 14.0 vs 5.6, 285 MB bf16 64.4 vs 24.8, 570 MB f32 75.9 vs 15.6;
# this 2-core VM, f32: 4.7 MB 1.3 vs 1.5, 25 MB 5.7 vs 2.7, 151 MB 32 vs 9.6.
NUMPY_MIN_BYTES = 64 << 20
_BLOCKED = jax.jit(blocked_attention)  # the XLA kernel on its own, as host_attention runs it


def attends_in_numpy(batch: int, slots: int, kv_heads: int, head_dim: int,
                     itemsize: float) -> bool:
    """Whether a host SCORE over a (batch, slots, kv_heads, head_dim) cache of ``itemsize``
    bytes per element (a compressed cache's: its held bytes over its elements) runs in numpy
    (``NUMPY_MIN_BYTES`` of cache held) rather than in XLA."""
    return 2 * batch * slots * kv_heads * head_dim * itemsize >= NUMPY_MIN_BYTES


@dataclass(frozen=True)
class CompressedKV:
    """A compressed K (or V) cache as numpy arrays: logical (B, S, K, E) held group-wise along
    E in ``fmt`` (``models.tensors.kv_arrays``): ``codes`` uint8 (B, S, K, E/g, g·bits/8),
    ``scale`` float16 (B, S, K, E/g), ``offset`` float16 (B, S, K, E/g) or None (a symmetric
    format). Indexing it over its first three axes indexes every part alike."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    fmt: Format

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (B, S, K, E)."""
        return (*self.scale.shape[:-1], self.scale.shape[-1] * self.fmt.group)

    @property
    def itemsize(self) -> float:
        """Bytes held per logical element: codes, scales and offsets."""
        parts = [self.codes, self.scale] + ([] if self.offset is None else [self.offset])
        return sum(p.nbytes for p in parts) / max(1, int(np.prod(self.shape)))

    def __getitem__(self, index) -> "CompressedKV":
        cut = lambda a: None if a is None else a[index]  # noqa: E731
        return CompressedKV(cut(self.codes), cut(self.scale), cut(self.offset), self.fmt)

    def held(self) -> dict[str, np.ndarray]:
        """The parts as ``models.formats.dequantize`` takes them."""
        parts = {"codes": self.codes, "scale": self.scale}
        return parts if self.offset is None else {**parts, "offset": self.offset}


def cache_arrays(cache: dict[str, np.ndarray], fmt: Format | None
                 ) -> tuple[np.ndarray | CompressedKV, np.ndarray | CompressedKV]:
    """(k, v) of a layer's cache dict of numpy arrays: the arrays themselves when dense, else
    a ``CompressedKV`` each."""
    if fmt is None:
        return cache["k"], cache["v"]
    return tuple(CompressedKV(cache[name], cache[kv_key(name, "scale")],
                              cache.get(kv_key(name, "offset")), fmt) for name in ("k", "v"))


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="hx-attention")


@lru_cache(maxsize=1)
def threads() -> int:
    """Threads the kernel spreads its tasks over: the CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def host_view(array: jax.Array) -> np.ndarray:
    """A read-only numpy view of a host (CPU device) XLA array's buffer, without copying.

    Waits until ``array`` is ready. The view does not keep the buffer alive: the caller holds
    ``array`` (and does not donate it) while the view is in use.

    Args:
      array: a single-device array on a CPU device, in XLA's default (row-major) layout.
    Returns:
      ndarray of ``array``'s shape and dtype (``ml_dtypes`` types for bfloat16).
    Raises:
      ValueError: ``array`` is not on a CPU device.
    """
    if array.devices() and next(iter(array.devices())).platform != "cpu":
        raise ValueError("host_view needs an array on a CPU device")
    array.block_until_ready()
    if array.nbytes == 0:
        return np.zeros(array.shape, array.dtype)
    buffer = (ctypes.c_char * array.nbytes).from_address(array.unsafe_buffer_pointer())
    view = np.frombuffer(buffer, dtype=array.dtype).reshape(array.shape)
    view.flags.writeable = False
    return view


def host_attention(q: jax.Array, cache: Cache, step: Step, fmt: Format | None = None,
                   window: int | None = None) -> Any:
    """Host SCORE as a host segment runs it at these shapes: XLA's blocked kernel below
    ``NUMPY_MIN_BYTES`` of cache, ``cache_attention`` from there (the profiler times this).

    Returns:
      o: (B, T, H, E), a JAX array (XLA kernel) or float32 numpy (numpy kernel).
    """
    B, S, K = cache["k"].shape[:3]
    E = q.shape[-1]
    held = sum(a.nbytes for a in cache.values())
    if attends_in_numpy(B, S, K, E, held / (2 * B * S * K * E)):
        return cache_attention(q, cache, step, fmt, window)
    return _BLOCKED(q, cache, step, fmt, window)


def cache_attention(q: jax.Array, cache: Cache, step: Step, fmt: Format | None = None,
                    window: int | None = None) -> np.ndarray:
    """``prefix_attention`` of XLA host arrays, read in place (``host_view``): how a host
    segment attends (``hx.programs.SplitHostProgram``) and the profiler times it.

    Args:
      q: (B, T, H, E) queries; cache: {"k", "v"} (B, S, K, E), the new tokens written,
        compressed in ``fmt`` when given (``models.tensors.kv_arrays``); step:
        ``write_index`` and ``kv_start`` -- all on the host CPU device, held by the caller;
        window: the sliding window (``models.layers.attention``), None for none.
    Returns:
      o: (B, T, H, E) float32 numpy.
    """
    k, v = cache_arrays({key: host_view(a) for key, a in cache.items()}, fmt)
    return prefix_attention(host_view(q), k, v, int(step.write_index),
                            host_view(step.kv_start), window)


def prefix_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, write_index: int,
                     kv_start: np.ndarray, window: int | None = None) -> np.ndarray:
    """Causal grouped-query attention of new queries over the used prefix of a KV cache.

    o = softmax(q k^T / sqrt(E) + mask) v (Vaswani et al. 2017, eq. 1), in float32 with the
    row maximum subtracted before ``exp``. The rows and KV heads are cut into at most one task
    per thread, and no more than one per ``MIN_TASK_BYTES`` of cache read, so a small
    attention runs in the calling thread.

    Args:
      q: (B, T, H, E) queries of the new tokens, at slots ``write_index .. write_index+T-1``.
      k, v: (B, R, K, E) caches, any float dtype or ``CompressedKV`` (decompressed
        ``SLOT_CHUNK`` slots at a time), the new tokens already written; slots past
        ``write_index + T - 1`` are never read, nor those before the smallest ``kv_start`` of
        a task's rows. A ring of R slots (``models.layers.ring_positions``): slot s at index
        s mod R, the R slots before ``write_index + T`` held.
      write_index: slot of the first new token.
      kv_start: (B,) each row's first valid slot (left padding before it).
      window: a query sees only the last ``window`` slots, its own included (sliding-window
        attention); slots no query of the step sees are not read. None: no window.
    Returns:
      o: (B, T, H, E) float32, equal to ``models.layers.attention`` for every query that has a
      valid key; a query with none (a padding query) gets zeros.
    """
    B, T, H, E = q.shape
    K = k.shape[2]
    starts = np.asarray(kv_start).astype(np.int64)
    o = np.zeros((B, T, H, E), np.float32)
    end = int(write_index) + T
    read = int(2 * B * max(0, min(end - int(starts.min()), k.shape[1])) * K * E * k.itemsize)
    tasks = max(1, min(threads(), read // MIN_TASK_BYTES))
    row_parts = min(B, tasks)
    head_parts = max(1, min(K, tasks // row_parts))
    rows = [B * i // row_parts for i in range(row_parts + 1)]
    heads = [K * i // head_parts for i in range(head_parts + 1)]
    qs = np.multiply(q, np.float32(E ** -0.5), dtype=np.float32)
    cuts = [(b0, b1, k0, k1) for b0, b1 in itertools.pairwise(rows)
            for k0, k1 in itertools.pairwise(heads)]

    def run(cut):
        b0, b1, k0, k1 = cut
        _attend(qs[b0:b1], k[b0:b1], v[b0:b1], int(write_index), starts[b0:b1], k0, k1,
                o[b0:b1], window)

    if len(cuts) == 1:
        run(cuts[0])
    else:
        list(_pool().map(run, cuts))
    return o


def _attend(q, k, v, write_index, starts, k0, k1, out, window=None) -> None:
    """Attention of rows q (R, T, H, E) float32 (pre-scaled) over k, v (R, S, K, E) for KV
    heads ``k0:k1``, written into out (R, T, H, E), row by row: each reads its slots from
    its own start (or the first slot the ``window`` lets the step's first query see, or a
    ring's oldest), each query's future (and, with a window, what lies before it) masked."""
    R, T, H, E = q.shape
    G = H // k.shape[2]
    heads = k1 - k0
    end = write_index + T
    widen = _widener(k, min(SLOT_CHUNK, end), heads, E)
    for r in range(R):
        lo = max(int(starts[r]), end - k.shape[1])
        lo = lo if window is None else max(lo, write_index - window + 1)
        n = end - lo
        if n <= 0:
            continue
        chunks = _chunks(lo, end, k.shape[1])
        qg = q[r].reshape(T, -1, G, E)[:, k0:k1].transpose(1, 2, 0, 3)  # (heads, G, T, E)
        step = max(1, SCORE_BYTES // (4 * heads * G * n))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            tq = t1 - t0
            qb = qg[:, :, t0:t1].reshape(heads, G * tq, E)  # a KV head's queries as rows
            s = np.empty((heads, G * tq, n), np.float32)
            for c0, c1, at in chunks:
                keys = widen(k[r, at:at + c1 - c0, k0:k1])  # (C, heads, E)
                s[..., c0:c1] = np.matmul(qb, keys.transpose(1, 2, 0))
            old = window is not None and lo <= write_index + t1 - 1 - window
            if write_index + t0 < end - 1 or old:  # causal: query t sees slots up to its own
                slots = np.arange(lo, end)[None, :]
                hidden = ~visible(slots, write_index + np.arange(t0, t1)[:, None], lo, window)
                np.copyto(s.reshape(heads, G, tq, n), -np.inf, where=hidden)
            m = s.max(axis=-1, keepdims=True)
            m[~np.isfinite(m)] = 0.0  # a query with no valid key: every score -inf, weight 0
            np.subtract(s, m, out=s)
            np.exp(s, out=s)
            denom = s.sum(axis=-1, keepdims=True)  # (heads, G * T', 1)
            acc = np.zeros((heads, G * tq, E), np.float32)
            for c0, c1, at in chunks:
                values = widen(v[r, at:at + c1 - c0, k0:k1])  # (C, heads, E)
                acc += np.matmul(s[..., c0:c1], values.transpose(1, 0, 2))
            np.divide(acc, denom, out=acc, where=denom > 0)
            out[r, t0:t1, k0 * G:k1 * G] = (acc.reshape(heads, G, tq, E)
                                            .transpose(2, 0, 1, 3).reshape(tq, heads * G, E))


def _chunks(lo: int, end: int, size: int) -> list[tuple[int, int, int]]:
    """Slots ``lo .. end - 1`` of a ring of ``size`` indices (slot s at s mod size) in chunks
    of at most ``SLOT_CHUNK`` that do not wrap: (first, last + 1) counted from ``lo``, and
    the index of the first."""
    chunks, c0 = [], 0
    while lo + c0 < end:
        at = (lo + c0) % size
        c1 = min(end - lo, c0 + SLOT_CHUNK, c0 + size - at)
        chunks.append((c0, c1, at))
        c0 = c1
    return chunks


def _widener(cache: np.ndarray | CompressedKV, slots: int, heads: int, head_dim: int):
    """A function giving a (C <= ``slots``, heads, head_dim) chunk of ``cache`` as float32:
    the chunk itself for float32 (a strided view; BLAS reads it in place); else cast -- or,
    compressed, decompressed (``dequantize_into``) -- into a float32 buffer reused chunk
    after chunk. The cast (``ml_dtypes``' loop for bfloat16) runs without
    the interpreter lock (2 threads: 1.7x one here); ``astype`` into fresh arrays maps new
    pages for every chunk, the likely reason 16 threads queued on it on the H100 host. Per
    256 x 32 x 128 chunk on this VM: 105 us, against 150 us for ``astype`` and 341 us for
    copying the 16 bits into the high halves of a zeroed buffer."""
    if not isinstance(cache, CompressedKV) and cache.dtype == np.float32:
        return lambda chunk: chunk
    buffer = np.empty((slots, heads, head_dim), np.float32)

    def widen(chunk: np.ndarray | CompressedKV) -> np.ndarray:
        c = chunk.shape[0]
        if isinstance(chunk, CompressedKV):
            return dequantize_into(chunk.held(), chunk.fmt, buffer[:c])
        np.copyto(buffer[:c], chunk, casting="unsafe")
        return buffer[:c]

    return widen
