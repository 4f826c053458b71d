"""Compute and memory rates of one device, measured as the executor's ops use it
(``profiler`` assembles them into a ``HardwareProfile``):

* **matmul** (FLOP/s at M rows, at a dtype): (M x 4096) @ (4096 x P) products, P covering
  ``Effort.matmul_weight_bytes`` of weights at small M (256 MiB; 64 MiB in a quick profile:
  beyond the caches of a CPU and of an H100's 50 MB L2), fewer columns at large M.
* **memory bandwidth**: in-place (donated) elementwise passes over 256 MiB, read + written
  bytes counted (an output allocated per call would time the allocator's page faults instead:
  measured here, 3 GB/s instead of 35).
* Work shorter than a dispatch and a synchronisation (a GPU's pass over 256 MiB, its M = 1
  product) is repeated inside one call, each repeat depending on the one before, until the
  call lasts ``Effort.memory_target_s`` / ``matmul_target_s``.
* **attention**: the SCORE kernel each side uses, reading a full KV cache of S slots.
* **decompression**: per compressed weight format, the seconds per weight that a layer's MLP
  segment (one decode row, the executor's own program) takes with its matrices compressed
  beyond the same segment dense, at several matrix sizes (both calls pay one dispatch,
  which the difference cancels).
* **contention**: a weight copy overlapped with an M = 1 product over as many bytes;
* **compute contention**: M = 1 products on the accelerator and the host at once;
* **disk read**: a file written where the disk tier spills (``hx.disk``), dropped from the page
  cache, then read through a mapping as the executor reads disk-homed weights.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hx.devices import ACCELERATOR, HOST, Devices
from hx.measure.links import host_chunks, memories, room
from hx.measure.timing import ATTENTION_SLOTS, FULL, MATMUL_ROWS, MiB, Effort
from hx.models.formats import FORMATS, REPACK_ROWS
from hx.models.layers import Step
from hx.planner.profile import ATTENTION_PROBE

MATMUL_N = 4096  # (M x N) @ (N x P) products, P a multiple of N
COLUMN_STEP = 1024  # P is a multiple of this
MEMORY_BYTES = 256 * MiB  # buffer of the elementwise pass
DISK_BYTES = 256 * MiB  # file the disk read probe reads (a quick profile: a quarter)
LOW_DTYPE = jnp.bfloat16  # ``DeviceProfile.matmul_low`` on the accelerator


@jax.jit
def _products(x: jax.Array, w: jax.Array, count: jax.Array) -> jax.Array:
    """``count`` products x_i @ w in a loop (one compilation for every count), each input
    scaled by the mean of the product before it: the data dependency keeps the compiler from
    merging them into one wider product (which would read ``w`` once) or hoisting them out;
    each reads all of ``w`` (larger than the caches)."""
    def product(i, carry):
        x, _ = carry
        y = x @ w
        return x * (1 + jnp.mean(y) * 1e-12).astype(x.dtype), y

    first = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
    return jax.lax.fori_loop(0, count, product, (x, first))[1]


def _uniform(device: jax.Device, shape: tuple[int, ...], dtype, scale: float, seed: int
             ) -> jax.Array:
    """An array of ``shape`` and ``dtype`` on ``device``, uniform in +-``scale`` (drawn as
    float32 uniform: ~5x faster than normal; the values do not change a kernel's time)."""
    a = np.random.default_rng(seed).random(shape, dtype=np.float32)
    a -= np.float32(0.5)
    a *= np.float32(2 * scale)
    return jax.device_put(a.astype(dtype, copy=False), device)


def _weights(device: jax.Device, dtype, columns: int, seed: int = 0) -> jax.Array:
    """A (N x ``columns``) weight matrix of ``dtype`` on ``device``, uniform in
    +-1/sqrt(N)."""
    return _uniform(device, (MATMUL_N, columns), dtype, 1 / math.sqrt(MATMUL_N), seed)


def _max_columns(device: jax.Device, dtype, weight_bytes: int) -> int:
    """Columns of the widest weight matrix: ``weight_bytes`` (or an eighth of the free
    memory), a multiple of N."""
    per = MATMUL_N * MATMUL_N * np.dtype(dtype).itemsize
    return MATMUL_N * max(1, min(weight_bytes, room(device)) // per)


def matmul_columns(rows: int, widest: int, rate: float | None, target_s: float) -> int:
    """Columns P of the product timed at M = ``rows``: all ``widest`` at first (``rate``
    None), then as many as ``rate`` (FLOP/s, measured at the smaller M before) gets through in
    ``target_s``: a multiple of ``COLUMN_STEP``, at least one step. A CPU at large M then
    times a product of tens of milliseconds, where all columns would take seconds; a GPU keeps
    them all (a wide product fills its SMs)."""
    if rate is None:
        return widest
    p = int(rate * target_s / (2 * rows * MATMUL_N)) // COLUMN_STEP * COLUMN_STEP
    return min(widest, max(COLUMN_STEP, p))


def _repeats(time_one: Callable[[int], float], target_s: float, most: int = 1024
             ) -> tuple[int, float]:
    """(k, seconds): one call of ``time_one(k)`` repeats its work k times, k = 1 unless one
    is shorter than ``target_s`` (a GPU's pass over 256 MiB is shorter than a dispatch and a
    synchronisation), then enough to last ``target_s``."""
    seconds = time_one(1)
    if seconds >= target_s:
        return 1, seconds
    k = min(most, math.ceil(target_s / seconds))
    return k, time_one(k)


def measure_matmul(device: jax.Device, dtype=jnp.float32, rows: tuple[int, ...] = MATMUL_ROWS,
                   effort: Effort = FULL) -> tuple[tuple[int, float], ...]:
    """((M, FLOP/s), ...) of (M x 4096) @ (4096 x P) products of ``dtype`` whose weights come
    from memory: P covers ``effort.matmul_weight_bytes`` of weights at M = 1 (beyond any
    cache), fewer columns at larger M where a product would outlast ``effort.matmul_target_s``
    (``matmul_columns``);
    products shorter than that are repeated (each depending on the one before) inside one
    call until it lasts that long."""
    widest = _weights(device, dtype, _max_columns(device, dtype, effort.matmul_weight_bytes))
    rates: list[tuple[int, float]] = []
    for m in rows:
        p = matmul_columns(m, widest.shape[1], rates[-1][1] if rates else None,
                           effort.matmul_target_s)
        w = widest if p == widest.shape[1] else widest[:, :p]
        x = jax.device_put(jnp.ones((m, MATMUL_N), dtype), device)
        warmup = None if not rates else min(effort.warmup_s, 0.05)  # busy since the first M

        def time_one(k: int) -> float:
            return effort.time(lambda: _products(x, w, k), warmup_s=warmup)[0].seconds

        k, seconds = _repeats(time_one, effort.matmul_target_s)
        rates.append((m, 2.0 * m * MATMUL_N * p * k / seconds))
    return tuple(rates)


@partial(jax.jit, static_argnums=4)
def _int4_products(x: jax.Array, packed: jax.Array, sz: jax.Array, count: jax.Array,
                   group: int) -> jax.Array:
    """``_products`` by torch's int4 kernel: ``count`` products of x (M, N) bfloat16 with the
    (P, N) matrix ``packed``/``sz`` holds (``host_compute.int4_kernel.matmul``), each input
    scaled by the mean of the product before it."""
    from hx.host_compute import int4_kernel

    def product(i, carry):
        x, _ = carry
        y = int4_kernel.matmul(x, packed, sz, group)
        return x * (1 + jnp.mean(y.astype(jnp.float32)) * 1e-12).astype(x.dtype), y

    first = jnp.zeros((x.shape[0], packed.shape[0]), jnp.bfloat16)
    return jax.lax.fori_loop(0, count, product, (x, first))[1]


def measure_int4_matmul(device: jax.Device, rows: tuple[int, ...] = MATMUL_ROWS,
                        effort: Effort = FULL) -> tuple[tuple[int, float], ...]:
    """((M, FLOP/s), ...) of torch's CPU int4 kernel (``host_compute.int4_kernel``): (M x N)
    bfloat16 activations times a (P x N) matrix of 4-bit codes in groups of 64 (hx's int4)
    with random codes, scales and zeros, P as ``measure_matmul``'s float32 product at M = 1
    (the same weights, an eighth of its bytes), fewer columns at larger M
    (``matmul_columns``), repeated inside one call until it lasts ``effort.matmul_target_s``;
    () where the kernel cannot be built (``int4_kernel.unavailable``)."""
    from hx.host_compute import int4_kernel

    if int4_kernel.unavailable() is not None:
        return ()
    group = 64
    widest = _max_columns(device, jnp.float32, effort.matmul_weight_bytes)
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (widest, MATMUL_N // 2), dtype=np.uint8)
    sz = (rng.random((MATMUL_N // group, widest, 2), dtype=np.float32) * 1e-2).astype(
        jnp.bfloat16)
    rates: list[tuple[int, float]] = []
    for m in rows:
        p = matmul_columns(m, widest, rates[-1][1] if rates else None, effort.matmul_target_s)
        w, s = (jax.device_put(a, device) for a in (packed[:p], sz[:, :p]))
        x = jax.device_put(jnp.ones((m, MATMUL_N), jnp.bfloat16), device)
        warmup = None if not rates else min(effort.warmup_s, 0.05)

        def time_one(k: int) -> float:
            return effort.time(lambda: _int4_products(x, w, s, k, group),
                               warmup_s=warmup)[0].seconds

        k, seconds = _repeats(time_one, effort.matmul_target_s)
        rates.append((m, 2.0 * m * MATMUL_N * p * k / seconds))
    return tuple(rates)


@jax.jit
def _ggml_products(x: jax.Array, held, count: jax.Array) -> jax.Array:
    """``_products`` by ggml's kernel: ``count`` products of x (M, N) float32 with the (P, N)
    ``GGUFBlocks`` matrix ``held`` (``host_compute.ggml_kernel.product``), each input scaled
    by the mean of the product before it."""
    from hx.host_compute import ggml_kernel

    def product(i, carry):
        x, _ = carry
        y = ggml_kernel.product(x, held)
        return x * (1 + jnp.mean(y) * 1e-12), y

    first = jnp.zeros((x.shape[0], held.shape[0]), jnp.float32)
    return jax.lax.fori_loop(0, count, product, (x, first))[1]


def measure_ggml_matmul(device: jax.Device, rows: tuple[int, ...] = MATMUL_ROWS,
                        effort: Effort = FULL
                        ) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """((held layout, ((M, FLOP/s), ...)), ...) of ggml's products
    (``host_compute.ggml_kernel``) for each layout hx multiplies a GGUF's blocks in
    (``GGUFBlocks.layout``: ``ggml_kernel.KERNEL_ROWS``' q4_0, q4_1 (centred), q8_0, and q4_0
    and q4_1 in ggml's repacked layout where this CPU has it), at each M of ``rows`` below the
    rows that
    layout's kernel takes and at those (the curve's last M: past it hx decompresses for
    XLA): (M x N) float32 times a (P x N) matrix of random codes under one
    scale (the values do not change the time), P as ``measure_int4_matmul``'s; () where
    ggml's kernels are unavailable."""
    from hx.host_compute import ggml_kernel
    from hx.models.compressed import GGUFBlocks, GroupMatrix, row_slice

    if ggml_kernel.unavailable() is not None:
        return ()
    widest = _max_columns(device, jnp.float32, effort.matmul_weight_bytes)
    rng = np.random.default_rng(0)
    curves = []
    for layout, most in ggml_kernel.KERNEL_ROWS:
        name, repacked = layout.split()[0], layout.endswith("repacked")
        if repacked and not ggml_kernel.repacks(name, REPACK_ROWS):
            continue
        fmt = FORMATS[name]
        groups = (widest, MATMUL_N // fmt.group)
        held = GroupMatrix(rng.integers(0, 256, (*groups, fmt.group * fmt.bits // 8), np.uint8),
                           np.full(groups, 2.0 ** -6, np.float16),
                           np.zeros(groups, np.float16) if fmt.asymmetric else None, fmt)
        blocks = GGUFBlocks.from_group(held, (widest, MATMUL_N))
        if repacked:
            blocks = ggml_kernel.repacked(blocks)
        rates: list[tuple[int, float]] = []
        for m in [m for m in rows if m < most] + [most]:
            p = matmul_columns(m, widest, rates[-1][1] if rates else None,
                               effort.matmul_target_s)
            w = jax.device_put(row_slice(blocks, 0, p), device)
            x = jax.device_put(jnp.ones((m, MATMUL_N), jnp.float32), device)
            warmup = None if not rates else min(effort.warmup_s, 0.05)

            def time_one(k: int) -> float:
                return effort.time(lambda: _ggml_products(x, w, k),
                                   warmup_s=warmup)[0].seconds

            k, seconds = _repeats(time_one, effort.matmul_target_s)
            rates.append((m, 2.0 * m * MATMUL_N * p * k / seconds))
        curves.append((layout, tuple(rates)))
    return tuple(curves)


def _probe_ffn(width: int) -> int:
    """d_ff of the decompression probe of d_model ``width``: 2.6875 x (Llama-2-7B's 11008 /
    4096), a multiple of 64 (int4's group)."""
    return round(2.6875 * width / 64) * 64


def _mlp_probe(side: str, devices: Devices, width: int, dtype, fmt: str
               ) -> Callable[[], jax.Array]:
    """One decode row through a layer's MLP1 and MLP2 on ``side``, as the executor runs that
    segment (``programs.segment_function``): a Llama layer of d_model ``width`` and d_ff
    2.6875 x (Llama-2-7B's ratio, rounded to 64), its matrices held in ``fmt`` with random
    values (they do not change the time)."""
    from jax.sharding import SingleDeviceSharding

    from hx.models.spec import ModelSpec
    from hx.programs import param_tree, segment_function

    spec = ModelSpec(name="dequantize-probe", n_layers=1, d_model=width, n_heads=width // 128,
                     n_kv_heads=width // 128, head_dim=128, d_ff=_probe_ffn(width),
                     vocab_size=64, context_length=64, dtype=jnp.dtype(dtype).name,
                     weight_format=fmt)
    device = devices[side]
    rng = np.random.default_rng(width)

    def random(s: jax.ShapeDtypeStruct) -> jax.Array:
        a = (rng.integers(0, 256, s.shape, dtype=np.uint8) if s.dtype == jnp.uint8
             else (rng.random(s.shape, dtype=np.float32) * 1e-2).astype(s.dtype))
        return jax.device_put(a, device)

    ops = ("MLP1", "MLP2")
    sharding = SingleDeviceSharding(device)
    params = tuple(jax.tree.map(random, param_tree(spec, op, side, lambda *_: sharding))
                   for op in ops)
    x = jax.device_put(np.ones((1, 1, width), dtype), device)
    step = jax.device_put(Step(np.zeros((1, 1), np.int32), np.int32(0), np.zeros(1, np.int32)),
                          device)
    run = segment_function(spec, side, ops, ("x",))
    return lambda: run(params, {"x": x}, (), step)


def measure_dequantize(devices: Devices, side: str, dtype=jnp.float32, effort: Effort = FULL
                       ) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """((format, ((weights per matrix, seconds per weight), ...)), ...) for every compressed
    format (``FORMATS``): what a layer's MLP segment (one decode row; ``_mlp_probe``) takes
    on ``side`` with its three matrices held in the format beyond the same segment with them
    dense in ``dtype``, divided by their weights, 0 where it takes no longer, every format
    timed in the same interleaved rounds as the dense segment; at each d_model of
    ``effort.dequantize_widths`` whose matrices in every format fit ``room`` (the first in
    any case).
    The cost depends on the matrix: XLA:CPU fused the decompression of SmolLM2's matrices into
    their products (0.11 ns per weight over dense here) and decompressed Llama-2-7B's into
    memory first (4.3 ns); an H100 fused a (4096 x 4096) one (< 0.001 ns)."""
    first, *rest = effort.dequantize_widths
    # the three dense matrices and the five formats' at once (those under 4 bytes a weight)
    fits = room(devices[side]) // (3 * (np.dtype(dtype).itemsize + 4))
    curves: dict[str, list[tuple[int, float]]] = {f: [] for f in FORMATS}
    for width in [first] + [w for w in rest if w * _probe_ffn(w) <= fits]:
        weights = width * _probe_ffn(width)
        # every format's segment and the dense one in the same interleaved rounds
        plain, *held = effort.time(*(_mlp_probe(side, devices, width, dtype, name)
                                     for name in ("dense", *FORMATS)))
        for name, timing in zip(FORMATS, held):
            extra = max(0.0, timing.seconds - plain.seconds)
            curves[name].append((weights, extra / (3 * weights)))
    return tuple((name, tuple(points)) for name, points in curves.items())


@partial(jax.jit, donate_argnums=0)
def _passes(x: jax.Array, count: jax.Array) -> jax.Array:
    """``count`` in-place elementwise passes over ``x`` (a loop, so the compiler cannot fuse
    them into one; one compilation for every count)."""
    return jax.lax.fori_loop(0, count, lambda i, a: a * 0.5 + 1.0, x)


def measure_memory_bandwidth(device: jax.Device, effort: Effort = FULL) -> float:
    """Bytes/s (read + written) of in-place elementwise passes over a 256 MiB buffer (or an
    eighth of the free memory), repeated inside one call until it lasts
    ``effort.memory_target_s``."""
    nbytes = min(MEMORY_BYTES, room(device)) // 4 * 4
    state = [jax.device_put(np.ones(nbytes // 4, np.float32), device)]

    def time_one(k: int) -> float:
        def run():
            state[0] = _passes(state[0], k)
            return state[0]
        return effort.time(run)[0].seconds

    k, seconds = _repeats(time_one, effort.memory_target_s)
    return 2 * nbytes * k / seconds


def measure_attention(device: jax.Device, kernel, slots: tuple[int, ...] = ATTENTION_SLOTS,
                      effort: Effort = FULL, dtype=jnp.float32) -> tuple[tuple[int, float], ...]:
    """((S, KV bytes/s), ...) of ``kernel(q, cache, step)`` reading a full ``dtype`` cache
    of S slots at ``profile.ATTENTION_PROBE``'s shape: B = 8 rows, H = 32 query and K = 8 KV
    heads of E = 128 (Llama-3-8B's attention), one query per row. On the host the kernel is
    ``host_attention``, which switches from XLA's to numpy's at 64 MiB of cache: float32 from
    S = 1024, bfloat16 from S = 2048."""
    B, H, K, E = ATTENTION_PROBE
    rates = []
    for s in slots:
        q = _uniform(device, (B, 1, H, E), dtype, 1.0, s)
        cache = {n: _uniform(device, (B, s, K, E), dtype, 1.0, s + i)
                 for i, n in enumerate(("k", "v"))}
        step = jax.device_put(Step(np.zeros((B, 1), np.int32), np.int32(s - 1),
                                   np.zeros((B,), np.int32)), device)
        seconds = effort.time(lambda: kernel(q, cache, step))[0].seconds
        rates.append((s, 2 * B * s * K * E * jnp.dtype(dtype).itemsize / seconds))
    return tuple(rates)


def measure_contention(devices: Devices, effort: Effort = FULL) -> float:
    """Share of the shorter of a weight copy (pinned_host -> device memory) and an M = 1
    product over as many weight bytes (half ``Effort.matmul_weight_bytes``) lost when both
    run at once:
    (t_both - max) / min, clipped to [0, 1]."""
    acc = devices[ACCELERATOR]
    pinned, acc_memory = memories(devices)
    w = _weights(acc, jnp.float32, max(MATMUL_N, _max_columns(
        acc, jnp.float32, effort.matmul_weight_bytes) // 2), seed=1)
    sources = [jax.device_put(c, pinned) for c in host_chunks(w.nbytes)]
    x = jax.device_put(jnp.ones((1, MATMUL_N), jnp.float32), acc)
    compute, copy, both = effort.time(
        lambda: _products(x, w, 1),
        lambda: jax.device_put(sources, acc_memory),
        lambda: (jax.device_put(sources, acc_memory), _products(x, w, 1)))
    return _lost_share(compute.seconds, copy.seconds, both.seconds)


def _lost_share(first_s: float, second_s: float, both_s: float) -> float:
    """Share of the shorter of two pieces of work lost when they run at once: (both - longer)
    / shorter, clipped to [0, 1] (0: they overlap fully; 1: they serialise)."""
    shorter, longer = sorted((first_s, second_s))
    return min(1.0, max(0.0, (both_s - longer) / shorter))


def measure_compute_contention(devices: Devices, effort: Effort = FULL) -> float:
    """Share of the shorter of two M = 1 products, one on the accelerator and one on the host
    (each over half ``Effort.matmul_weight_bytes`` of weights), lost when both run at once:
    (t_both - max) / min, clipped to [0, 1] (``HardwareProfile.compute_contention``)."""
    sides = []
    for device in (devices[ACCELERATOR], devices[HOST]):
        w = _weights(device, jnp.float32, max(MATMUL_N, _max_columns(
            device, jnp.float32, effort.matmul_weight_bytes) // 2), seed=2)
        sides.append((jax.device_put(jnp.ones((1, MATMUL_N), jnp.float32), device), w))
    (xa, wa), (xh, wh) = sides
    acc, host, both = effort.time(lambda: _products(xa, wa, 1), lambda: _products(xh, wh, 1),
                                  lambda: (_products(xa, wa, 1), _products(xh, wh, 1)))
    return _lost_share(acc.seconds, host.seconds, both.seconds)


def measure_disk_read(directory: str | None = None, nbytes: int = DISK_BYTES,
                      effort: Effort = FULL) -> float:
    """Bytes/s of cold sequential reads from the disk under ``directory`` (default: the
    temporary directory, where ``hx.disk`` spills weights by default), as the executor reads
    disk-homed weights: an unnamed file of ``nbytes`` written there and synced once, then,
    before each timed read, dropped from the page cache (``posix_fadvise(DONTNEED)``) and from
    this process's mapping, so every read comes from the device; each read copies the whole
    mapped file into a buffer. A warm read (page cache) is several times faster (this VM:
    0.6-2 GB/s cold, 5-9 GB/s warm): the disk tier's weights are larger than the host memory
    that would keep them cached, so the planner prices the cold rate. On a tmpfs the page cache
    is the file, and the rate is memory's.

    Raises:
      OSError: ``directory`` cannot hold the file.
    """
    block = np.random.default_rng(0).integers(0, 256, 4 * MiB, dtype=np.uint8)
    with tempfile.TemporaryFile(dir=directory, prefix="hx-disk-probe-") as f:
        for _ in range(max(1, nbytes // block.nbytes)):
            f.write(block.data)
        f.flush()
        os.fsync(f.fileno())  # dirty pages cannot be dropped from the page cache
        into = np.empty(f.tell(), np.uint8)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            def cold() -> None:
                mapping.madvise(mmap.MADV_DONTNEED)
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

            def read(_) -> None:  # the view ends with the call: the mapping can close
                np.copyto(into, np.frombuffer(mapping, np.uint8))

            seconds = effort.time(read, setups=(cold,), warmup_s=0.0)[0].seconds
    return into.nbytes / seconds
