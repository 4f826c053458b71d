"""Measure a ``HardwareProfile`` on the devices present: ``hx profile`` (``measure``), or a
``quick`` one when a command needs a profile and none is saved (``load_or_measure``).

Every figure is measured the way the executor uses the hardware, as the median of warmed-up,
repeated runs that stop once the median is stable (``timing.stable_seconds``; runs that a fit
or a ratio compares are interleaved, so a slow spell of this shared machine hits them alike):

* **links**: H2D copies from the accelerator's ``pinned_host`` memory kind into its device
  memory (how ``Executor._stage`` streams weights) and D2H copies from accelerator memory to
  the host CPU device (how ``Executor.run`` moves activations to host segments; each source is
  freshly computed, as activations are). Each copy is one ``device_put`` of a list of arrays of
  at most ``CHUNK_BYTES`` (as a weight tree is). The size doubles until one copy takes
  ``Effort.link_target_s`` or reaches ``LINK_CAP`` (or an eighth of the free memory); then
  that size and a quarter of it are timed interleaved and fitted to t = latency + bytes /
  bandwidth, so a fixed cost per copy does not lower the bandwidth.
* **transfer latency**: a (16, 576) float32 activation moved each way as ``Executor.run`` moves
  it (a list in one ``device_put``, a fresh source), less bytes / bandwidth; mean of the two.
* **matmul** (FLOP/s at M rows, at a dtype): (M x 4096) @ (4096 x P) products, P covering
  256 MiB of weights at small M (64 MiB in a quick profile; beyond the caches of a CPU and of
  an H100's 50 MB L2), fewer
  columns at large M.
* **memory bandwidth**: in-place (donated) elementwise passes over 256 MiB, read + written
  bytes counted (an output allocated per call would time the allocator's page faults instead:
  measured here, 3 GB/s instead of 35).
* Work shorter than a dispatch and a synchronisation (a GPU's pass over 256 MiB, its M = 1
  product) is repeated inside one call, each repeat depending on the one before, until the
  call lasts ``Effort.memory_target_s`` / ``matmul_target_s``.
* **attention**: the SCORE kernel each side uses, reading a full KV cache of S slots.
* **round trip**: JAX's bare device switch there and back at (1, 576) float32 (accelerator
  op, ``device_put`` to the host device, host op, ``device_put`` back, accelerator op): the
  floor under the executor's cost of a host excursion (``HardwareProfile.excursion_seconds``).
* **contention**: a weight copy overlapped with an M = 1 product over as many bytes.
* **launch overhead** (without ``calibrate.refine``): the executor's own decode steps of a tiny
  model under plans of 1 to 121 segments (``QUICK``: the 33-segment one): the cost per
  segment beyond the simulator's compute and the measured transfers.

All sizes are capped by an eighth of the memory the device reports free, and no code path
depends on the accelerator being emulated: on a CPU-only machine the same rules give smaller
copies (they reach 20 ms sooner).

``calibrate.refine`` then fits compute scale, launch overhead and transfer latency to a real
model's decode steps (``hx profile`` does by default; a quick profile is not calibrated).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hx.devices import ACCELERATOR, HOST, Devices
from hx.host_compute.attention import prefix_attention
from hx.models.llama import Step, attention, init_params
from hx.models.spec import EMBED, HEAD, ModelSpec
from hx.planner.calibrate import dispatch_plans, observe_interleaved, predicted_decode
from hx.planner.profile import DEFAULT_PATH, DeviceProfile, HardwareProfile, load_default
from hx.planner.timing import Timing, stable_seconds

MiB = 2**20
# Largest array of a timed copy: a weight matrix of a small or mid-size model. On XLA:CPU larger
# buffers come from fresh mmaps now and then (glibc caps its mmap threshold at 32 MiB): a 64 MiB
# copy here took 44 ms or 9 ms by turns, 16 MiB pieces a steady 2 ms each.
CHUNK_BYTES = 16 * MiB
LINK_START = 64 * MiB  # first size tried for a large copy
LINK_CAP = 2**30  # largest timed copy, bytes
SMALL_SHAPE = (16, 576)  # an activation (batch 16, SmolLM2's width), float32: 36 KiB
MATMUL_N = 4096  # (M x N) @ (N x P) products, P a multiple of N
MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COLUMN_STEP = 1024  # P is a multiple of this
MEMORY_BYTES = 256 * MiB  # buffer of the elementwise pass
ATTENTION_SLOTS = (256, 1024, 4096)
TINY = ModelSpec(name="profile-tiny", n_layers=8, d_model=32, n_heads=2, n_kv_heads=1,
                 head_dim=16, d_ff=32, vocab_size=64, context_length=64)


@dataclass(frozen=True)
class Effort:
    """How long to measure.

    Attributes:
      link_target_s: seconds one large copy should take (bandwidth-bound beyond it).
      memory_target_s / matmul_target_s: seconds one timed call of elementwise passes / of
        products should last (work is repeated inside the call until it does).
      matmul_rows: the M of the matmul rate curve.
      matmul_weight_bytes: weights of the product at M = 1, beyond any cache (256 MiB; the
        quick profile's 64 MiB are still beyond an H100's 50 MB L2).
      attention_slots: the S of the attention rate curve.
      window / tolerance / max_rounds / max_seconds / warmup_s: ``stable_seconds``' stopping
        rule for every figure.
      launch_plans: which of ``calibrate.dispatch_plans`` (indices) the launch fit observes
        on the tiny model: all five (1 to 121 segments), or the 33-segment one alone.
    """

    link_target_s: float
    memory_target_s: float
    matmul_target_s: float
    matmul_rows: tuple[int, ...]
    matmul_weight_bytes: int
    attention_slots: tuple[int, ...]
    window: int
    tolerance: float
    max_rounds: int
    max_seconds: float
    warmup_s: float
    launch_plans: tuple[int, ...]

    def time(self, *runs: Callable, setups=None, warmup_s: float | None = None
             ) -> tuple[Timing, ...]:
        """``stable_seconds`` of ``runs`` (interleaved) under this effort's stopping rule
        (``warmup_s`` instead of the effort's own, when given)."""
        return stable_seconds(*runs, window=self.window, tolerance=self.tolerance,
                              max_rounds=self.max_rounds, max_seconds=self.max_seconds,
                              warmup_s=self.warmup_s if warmup_s is None else warmup_s,
                              setups=setups)


FULL = Effort(link_target_s=0.02, memory_target_s=0.01, matmul_target_s=0.01,
              matmul_rows=MATMUL_ROWS, matmul_weight_bytes=256 * MiB,
              attention_slots=ATTENTION_SLOTS, window=5,
              tolerance=0.05, max_rounds=25, max_seconds=1.0, warmup_s=0.3,
              launch_plans=(0, 1, 2, 3, 4))
QUICK = Effort(link_target_s=0.01, memory_target_s=0.005, matmul_target_s=0.005,
               matmul_rows=(1, 16, 256), matmul_weight_bytes=64 * MiB,
               attention_slots=(256, 4096), window=3,
               tolerance=0.05, max_rounds=7, max_seconds=0.4, warmup_s=0.1, launch_plans=(3,))


# -- memory ------------------------------------------------------------------------------------

def _room(device: jax.Device) -> int:
    """Bytes the profiler lets itself hold on ``device`` at once: an eighth of what its
    allocator reports free (``memory_stats``), or of the host's available memory where the
    device reports nothing (XLA:CPU)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(free // 8, MiB)


def _host_room() -> int:
    """An eighth of the host's available memory, bytes (pinned host buffers come from it)."""
    return max(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8, MiB)


def _memories(devices: Devices) -> tuple[SingleDeviceSharding, SingleDeviceSharding]:
    """(pinned host memory, device memory) of the accelerator: where streamed weights live and
    where the executor copies them to (``Executor._homes``, ``Executor._stage``)."""
    acc = devices[ACCELERATOR]
    return (SingleDeviceSharding(acc, memory_kind="pinned_host"),
            SingleDeviceSharding(acc, memory_kind="device"))


def _host_chunks(nbytes: int) -> list[np.ndarray]:
    """``nbytes`` of float32 host data as arrays of at most ``CHUNK_BYTES`` (views of one)."""
    base = np.ones(min(nbytes, CHUNK_BYTES) // 4, np.float32)
    sizes = [CHUNK_BYTES // 4] * (nbytes // CHUNK_BYTES)
    if nbytes % CHUNK_BYTES:
        sizes.append((nbytes % CHUNK_BYTES) // 4)
    return [base[:n] for n in sizes if n]


@partial(jax.jit, donate_argnums=0)
def _bump(arrays):
    """Each array + 1, in place: a freshly computed source, as an activation is."""
    return [a + 1.0 for a in arrays]


# -- links -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """One direction of the link.

    Attributes:
      bandwidth: bytes/s (slope of the two-size fit).
      latency: seconds of fixed cost per copy call (intercept, >= 0).
      nbytes: the large copy's size; ``seconds``: its median time.
      spread: the larger relative spread of the two timed sizes' last runs.
    """

    bandwidth: float
    latency: float
    nbytes: int
    seconds: float
    spread: float


def fit_line(small_bytes: int, small_s: float, large_bytes: int, large_s: float
             ) -> tuple[float, float]:
    """(bytes/s, seconds) of t = latency + bytes / bandwidth through two timed sizes; where
    noise gives a slope or intercept below zero, latency 0 and the large copy's rate."""
    if large_s > small_s:
        bandwidth = (large_bytes - small_bytes) / (large_s - small_s)
        latency = large_s - large_bytes / bandwidth
        if latency >= 0:
            return bandwidth, latency
    return large_bytes / large_s, 0.0


def _fastest(copy: Callable, setup: Callable | None, warmup_s: float, calls: int = 3) -> float:
    """Shortest of ``calls`` timed copies after ``warmup_s`` seconds (and two calls) of
    untimed ones (the first copies into fresh memory page-fault it in): whether a size is
    bandwidth-bound even when nothing else runs."""
    times: list[float] = []
    start, warm = time.perf_counter(), 0
    while len(times) < calls:
        args = () if setup is None else (jax.block_until_ready(setup()),)
        t0 = time.perf_counter()
        jax.block_until_ready(copy(*args))
        if warm >= 2 and t0 - start >= warmup_s:
            times.append(time.perf_counter() - t0)
        warm += 1
    return min(times)


def _grown(size: int, seconds: float, target_s: float, cap: int) -> int:
    """``size`` doubled as often as a copy of ``seconds`` needs to last ``target_s`` (at least
    once), at most ``cap``."""
    factor = 2 ** max(1, math.ceil(math.log2(target_s / max(seconds, 1e-6))))
    return min(cap, size * factor)


def _link(case: Callable[[int], tuple[Callable, Callable | None]], cap: int,
          effort: Effort) -> Link:
    """Measure one direction. ``case(nbytes)`` -> (copy, setup): ``copy(*setup result)``
    issues one copy of ``nbytes``; ``setup`` (or None) makes its source."""
    unit = 4 * MiB
    cap = max(unit, cap // unit * unit)
    size = min(LINK_START, cap)
    while size < cap:  # grow until a copy is bandwidth-bound
        copy, setup = case(size)
        seconds = _fastest(copy, setup, min(effort.warmup_s, 0.1))
        if seconds >= effort.link_target_s:
            break
        size = _grown(size, seconds, effort.link_target_s, cap)
    for _ in range(3):
        small = max(unit, size // 4 // unit * unit)
        (big_copy, big_setup), (small_copy, small_setup) = case(size), case(small)
        big, little = effort.time(big_copy, small_copy, setups=[big_setup, small_setup])
        # a probe slowed by a burst of other work stops the growth too soon: grow on
        if big.seconds >= effort.link_target_s / 2 or size >= cap:
            break
        size = _grown(size, big.seconds, effort.link_target_s, cap)
    bandwidth, latency = fit_line(small, little.seconds, size, big.seconds)
    return Link(bandwidth, latency, size, big.seconds, max(big.spread, little.spread))


def measure_h2d(devices: Devices, effort: Effort = FULL) -> Link:
    """Copies from the accelerator's pinned_host memory into its device memory."""
    pinned, acc_memory = _memories(devices)

    def case(nbytes: int):
        sources = [jax.device_put(c, pinned) for c in _host_chunks(nbytes)]
        return (lambda: jax.device_put(sources, acc_memory)), None

    return _link(case, min(LINK_CAP, _room(devices[ACCELERATOR]), _host_room()), effort)


def measure_d2h(devices: Devices, effort: Effort = FULL) -> Link:
    """Copies from accelerator memory to the host CPU device, each from a fresh source."""
    _, acc_memory = _memories(devices)
    host = devices[HOST]

    def case(nbytes: int):
        state = [jax.device_put(_host_chunks(nbytes), acc_memory)]

        def setup():
            state[0] = _bump(state[0])
            return state[0]

        return (lambda sources: jax.device_put(sources, host)), setup

    return _link(case, min(LINK_CAP, _room(devices[ACCELERATOR]) // 2, _host_room()), effort)


def measure_small_transfers(devices: Devices, effort: Effort = FULL) -> tuple[float, float]:
    """Seconds of one (16, 576) float32 activation transfer (host -> accelerator,
    accelerator -> host) as ``Executor.run`` issues it: a list in one ``device_put`` to the
    other device, of a freshly computed array."""
    sides = {}
    for side in (HOST, ACCELERATOR):
        sides[side] = [jax.device_put(np.ones(SMALL_SHAPE, np.float32), devices[side])]

    def setup(side: str) -> Callable:
        def fresh():
            sides[side] = _bump(sides[side])
            return sides[side]
        return fresh

    h2d, d2h = effort.time(lambda xs: jax.device_put(xs, devices[ACCELERATOR]),
                           lambda xs: jax.device_put(xs, devices[HOST]),
                           setups=[setup(HOST), setup(ACCELERATOR)])
    return h2d.seconds, d2h.seconds


LOW_DTYPE = jnp.bfloat16  # ``DeviceProfile.matmul_low`` on the accelerator
ROUND_TRIP_SHAPE = (1, 576)  # a decode activation of SmolLM2, float32


@jax.jit
def _touch(x: jax.Array) -> jax.Array:
    return x + 1.0


def measure_round_trip(devices: Devices, effort: Effort = FULL) -> float:
    """Seconds of JAX's bare device switch there and back (``HardwareProfile.round_trip``): a
    (1, 576) float32 activation computed on the accelerator, ``device_put`` to the host CPU
    device, a tiny op there, ``device_put`` back, a tiny op on the accelerator, waited for.
    No executor does less for a host excursion; the issue that asked for it measured ~1 ms on
    an H100 machine (jax 0.11)."""
    x = jax.device_put(np.ones(ROUND_TRIP_SHAPE, np.float32), devices[ACCELERATOR])

    def trip():
        on_host = _touch(jax.device_put(_touch(x), devices[HOST]))
        return _touch(jax.device_put(on_host, devices[ACCELERATOR]))

    return effort.time(trip)[0].seconds


# -- compute -----------------------------------------------------------------------------------

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


def _weights(device: jax.Device, dtype, columns: int, seed: int = 0) -> jax.Array:
    """A (N x ``columns``) weight matrix of ``dtype`` on ``device``, uniform in +-1/sqrt(N)
    (drawn as float32 uniform: ~5x faster than normal; the values do not change the time)."""
    rng = np.random.default_rng(seed)
    w = rng.random((MATMUL_N, columns), dtype=np.float32)
    w -= np.float32(0.5)
    w *= np.float32(2 / math.sqrt(MATMUL_N))
    return jax.device_put(w.astype(dtype, copy=False), device)


def _max_columns(device: jax.Device, dtype, weight_bytes: int) -> int:
    """Columns of the widest weight matrix: ``weight_bytes`` (or an eighth of the free
    memory), a multiple of N."""
    per = MATMUL_N * MATMUL_N * np.dtype(dtype).itemsize
    return MATMUL_N * max(1, min(weight_bytes, _room(device)) // per)


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
    cache), fewer columns at
    larger M where a product would outlast ``effort.matmul_target_s`` (``matmul_columns``);
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


@partial(jax.jit, donate_argnums=0)
def _passes(x: jax.Array, count: jax.Array) -> jax.Array:
    """``count`` in-place elementwise passes over ``x`` (a loop, so the compiler cannot fuse
    them into one; one compilation for every count)."""
    return jax.lax.fori_loop(0, count, lambda i, a: a * 0.5 + 1.0, x)


def measure_memory_bandwidth(device: jax.Device, effort: Effort = FULL) -> float:
    """Bytes/s (read + written) of in-place elementwise passes over a 256 MiB buffer (or an
    eighth of the free memory), repeated inside one call until it lasts
    ``effort.memory_target_s``."""
    nbytes = min(MEMORY_BYTES, _room(device)) // 4 * 4
    state = [jax.device_put(np.ones(nbytes // 4, np.float32), device)]

    def time_one(k: int) -> float:
        def run():
            state[0] = _passes(state[0], k)
            return state[0]
        return effort.time(run)[0].seconds

    k, seconds = _repeats(time_one, effort.memory_target_s)
    return 2 * nbytes * k / seconds


def measure_attention(device: jax.Device, kernel, slots: tuple[int, ...] = ATTENTION_SLOTS,
                      effort: Effort = FULL) -> tuple[tuple[int, float], ...]:
    """((S, KV bytes/s), ...) of ``kernel`` reading a full cache of S slots (B=4, H=16, K=4,
    E=64, one query per row, float32)."""
    B, H, K, E = 4, 16, 4, 64
    f = jax.jit(kernel)
    rates = []
    for s in slots:
        rng = np.random.default_rng(s)
        q = jax.device_put(rng.standard_normal((B, 1, H, E), np.float32), device)
        cache = jax.device_put({n: rng.standard_normal((B, s, K, E), np.float32)
                                for n in ("k", "v")}, device)
        step = jax.device_put(Step(np.zeros((B, 1), np.int32), np.int32(s - 1),
                                   np.zeros((B,), np.int32)), device)
        seconds = effort.time(lambda: f(q, cache, step))[0].seconds
        rates.append((s, 2 * B * s * K * E * 4 / seconds))
    return tuple(rates)


def measure_contention(devices: Devices, effort: Effort = FULL) -> float:
    """Share of the shorter of a weight copy (pinned_host -> device memory) and an M = 1
    product over as many weight bytes (half ``Effort.matmul_weight_bytes``) lost when both
    run at once:
    (t_both - max) / min, clipped to [0, 1]."""
    acc = devices[ACCELERATOR]
    pinned, acc_memory = _memories(devices)
    w = _weights(acc, jnp.float32, max(MATMUL_N, _max_columns(
        acc, jnp.float32, effort.matmul_weight_bytes) // 2), seed=1)
    sources = [jax.device_put(c, pinned) for c in _host_chunks(w.nbytes)]
    x = jax.device_put(jnp.ones((1, MATMUL_N), jnp.float32), acc)
    compute, copy, both = effort.time(
        lambda: _products(x, w, 1),
        lambda: jax.device_put(sources, acc_memory),
        lambda: (jax.device_put(sources, acc_memory), _products(x, w, 1)))
    shorter, longer = sorted((compute.seconds, copy.seconds))
    return min(1.0, max(0.0, (both.seconds - longer) / shorter))


# -- launch overhead ---------------------------------------------------------------------------

def _random_params(spec: ModelSpec) -> dict:
    """Parameters of ``spec`` (uniform +-0.02 float32; the values do not change the time),
    drawn with numpy on ``init_params``' tree (running Flax's initialisers takes seconds)."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(partial(init_params, spec))
    params = jax.tree.map(lambda s: (rng.random(s.shape, np.float32) - 0.5) * np.float32(0.04),
                          shapes)
    if spec.tie_embeddings:  # one array, as init_params and the loaders give it
        params[HEAD]["embedding"] = params[EMBED]["embedding"]
    return params


def fit_launch_overhead(profile: HardwareProfile, devices: Devices,
                        plans: tuple[int, ...] = (0, 1, 2, 3, 4),
                        log: Callable[[str], None] = lambda message: None) -> HardwareProfile:
    """``profile`` with the launch overhead per segment (batch 1, both devices) that makes the
    simulator meet the executor's decode steps of the tiny model ``TINY`` under ``plans``
    (indices into ``calibrate.dispatch_plans``: 1 to 121 segments), least squares, >= 0. The
    transfer latency measured by the profiler is kept: the rest of the cost of a segment and
    its device switch is the launch."""
    every = dispatch_plans(TINY.n_layers)
    chosen = [every[i] for i in plans]
    seen = observe_interleaved(TINY, _random_params(TINY), chosen, (1,), devices, rounds=1)
    probe = 1e-4

    def with_launch(seconds: float) -> HardwareProfile:
        points = ((1, seconds),) if seconds else ()
        return replace(profile,
                       accelerator=replace(profile.accelerator, launch_overhead=points),
                       host=replace(profile.host, launch_overhead=points))

    num = den = 0.0
    for plan in chosen:
        base = predicted_decode(plan, TINY, with_launch(0.0), 1)
        slope = (predicted_decode(plan, TINY, with_launch(probe), 1) - base) / probe
        num += slope * (seen[(plan, 1)] - base)
        den += slope * slope
    launch = max(0.0, num / den) if den else 0.0
    log(f"launch overhead per segment {launch * 1e6:.0f} us (tiny model, {len(chosen)} plans)")
    fitted = with_launch(launch)
    log(excursion_line(fitted))
    return fitted


def excursion_line(profile: HardwareProfile) -> str:
    """One line: what the profile prices a host excursion at vs JAX's bare round trip."""
    priced = profile.excursion_seconds(1, math.prod(ROUND_TRIP_SHAPE) * 4)
    ratio = f" = {priced / profile.round_trip:.2f}x" if profile.round_trip else ""
    return (f"host excursion (1, 576) float32: executor {priced * 1e6:.0f} us (priced: 2 "
            f"transfers + 2 launches) vs bare JAX round trip {profile.round_trip * 1e6:.0f} us"
            f"{ratio}")


# -- the profile -------------------------------------------------------------------------------

def measure(devices: Devices, log: Callable[[str], None] = lambda message: None,
            launch: bool = True, effort: Effort = FULL) -> HardwareProfile:
    """Measure every figure of a ``HardwareProfile`` on ``devices`` (module doc).

    Args:
      log: called with a short line as each measurement finishes.
      launch: fit the launch overhead to a tiny model's decode steps (``fit_launch_overhead``);
        leave it out when ``calibrate.refine`` follows, as it fits it to the model.
      effort: ``FULL`` (``hx profile``) or ``QUICK``.
    """
    h2d, d2h = measure_h2d(devices, effort), measure_d2h(devices, effort)
    small_h2d, small_d2h = measure_small_transfers(devices, effort)
    small_bytes = math.prod(SMALL_SHAPE) * 4
    latency = max(0.0, statistics.mean((small_h2d - small_bytes / h2d.bandwidth,
                                        small_d2h - small_bytes / d2h.bandwidth)))
    for name, link in (("H2D pinned_host -> device", h2d), ("D2H device -> host", d2h)):
        log(f"{name}: {link.bandwidth / 2**30:.1f} GiB/s + {link.latency * 1e6:.0f} us per copy "
            f"({link.nbytes / MiB:.0f} MiB in {link.seconds * 1e3:.1f} ms, spread "
            f"{link.spread:.0%})")
    log(f"small transfer {small_h2d * 1e6:.0f} us H2D, {small_d2h * 1e6:.0f} us D2H")
    round_trip = measure_round_trip(devices, effort)
    log(f"bare round trip accelerator -> host op -> accelerator {round_trip * 1e6:.0f} us")
    sides = {}
    for side, kernel in ((ACCELERATOR, attention), (HOST, prefix_attention)):
        device = devices[side]
        curves = {dtype: measure_matmul(device, dtype, effort.matmul_rows, effort)
                  for dtype in ((jnp.float32, LOW_DTYPE) if side == ACCELERATOR
                                else (jnp.float32,))}
        memory = measure_memory_bandwidth(device, effort)
        for dtype, curve in curves.items():
            log(f"{side}: matmul {curve[0][1] / 1e9:.1f} GFLOP/s at M={curve[0][0]}, "
                f"{curve[-1][1] / 1e9:.1f} at M={curve[-1][0]} ({jnp.dtype(dtype).name})")
        log(f"{side}: memory {memory / 1e9:.1f} GB/s")
        sides[side] = DeviceProfile(
            matmul=curves[jnp.float32], memory_bandwidth=memory,
            attention=measure_attention(device, kernel, effort.attention_slots, effort),
            launch_overhead=(), matmul_low=curves.get(LOW_DTYPE, ()))
    contention = measure_contention(devices, effort)
    log(f"copy/compute contention {contention:.2f}")
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    acc = devices.accelerator
    own_limit = (acc.device.memory_stats() or {}).get("bytes_limit")  # not a user's budget
    quick = effort is QUICK
    profile = HardwareProfile(
        name=f"{'emulated ' if acc.emulated else ''}{acc.device.platform}:{acc.device.id} + "
             f"host cpu ({os.cpu_count()} cores){', quick' if quick else ''}",
        accelerator=sides[ACCELERATOR], host=sides[HOST], h2d_bandwidth=h2d.bandwidth,
        d2h_bandwidth=d2h.bandwidth, transfer_latency=latency, contention=contention,
        accelerator_memory=own_limit, host_memory=pages, emulated=acc.emulated,
        h2d_latency=h2d.latency, d2h_latency=d2h.latency,
        quick=quick, round_trip=round_trip)
    if not launch:
        return profile
    return fit_launch_overhead(profile, devices, effort.launch_plans, log)


def quick(devices: Devices, log: Callable[[str], None] = lambda message: None
          ) -> HardwareProfile:
    """A profile measured in under 20 s (``QUICK``: fewer sizes, shorter runs, the launch
    overhead from two plans of the tiny model, no calibration), marked ``quick``."""
    return measure(devices, log, launch=True, effort=QUICK)


def for_policy(policy: str | None, path: str | None, devices: Devices,
               log: Callable[[str], None] = lambda message: None) -> HardwareProfile | None:
    """The profile a command choosing a plan by ``policy`` uses: ``load_or_measure`` for the
    policies that price ops with one (``policies.NEEDS_PROFILE``), else the one at ``path`` or
    saved, if any (``auto`` without one falls back to a layer split).

    Raises:
      HxError: ``path`` given but missing or malformed.
    """
    from hx.planner.policies import NEEDS_PROFILE

    if policy in NEEDS_PROFILE:
        return load_or_measure(path, devices, log)
    return load_default(path)


def load_or_measure(path: str | None, devices: Devices,
                    log: Callable[[str], None] = lambda message: None) -> HardwareProfile:
    """The profile at ``path``; without one, the one ``hx profile`` saved (``DEFAULT_PATH``);
    without that, a ``quick`` one measured now and saved there, with one line to ``log`` that
    says so and how to measure a full one.

    Raises:
      HxError: ``path`` given but missing or malformed.
    """
    profile = load_default(path)
    if profile is not None:
        return profile
    start = time.perf_counter()
    profile = quick(devices)
    seconds = time.perf_counter() - start
    try:
        profile.save(DEFAULT_PATH)
        where = f"saved to {DEFAULT_PATH}"
    except OSError as e:
        where = f"not saved ({e.strerror})"
    log(f"no hardware profile: measured a quick one in {seconds:.0f} s ({where}); run "
        f"`hx profile` for a full, calibrated one")
    return profile
