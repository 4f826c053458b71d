"""Copies between the accelerator and the host, measured as the executor makes them
(``profiler`` assembles them into a ``HardwareProfile``):

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
* **round trip**: JAX's bare device switch there and back at (1, 576) float32 (accelerator
  op, ``device_put`` to the host device, host op, ``device_put`` back, accelerator op): the
  floor under the executor's cost of a host excursion (``HardwareProfile.excursion_seconds``).

Sizes are capped by an eighth of the memory the device reports free (``room``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hx.devices import ACCELERATOR, HOST, Devices
from hx.measure.timing import FULL, MiB, Effort

# Largest array of a timed copy: a weight matrix of a small or mid-size model. On XLA:CPU larger
# buffers come from fresh mmaps now and then (glibc caps its mmap threshold at 32 MiB): a 64 MiB
# copy here took 44 ms or 9 ms by turns, 16 MiB pieces a steady 2 ms each.
CHUNK_BYTES = 16 * MiB
LINK_START = 64 * MiB  # first size tried for a large copy
LINK_CAP = 2**30  # largest timed copy, bytes
SMALL_SHAPE = (16, 576)  # an activation (batch 16, SmolLM2's width), float32: 36 KiB
ROUND_TRIP_SHAPE = (1, 576)  # a decode activation of SmolLM2, float32


# -- memory ------------------------------------------------------------------------------------

def room(device: jax.Device) -> int:
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


def memories(devices: Devices) -> tuple[SingleDeviceSharding, SingleDeviceSharding]:
    """(pinned host memory, device memory) of the accelerator: where streamed weights live and
    where the executor copies them to (``Executor._homes``, ``Executor._stage``)."""
    acc = devices[ACCELERATOR]
    return (SingleDeviceSharding(acc, memory_kind="pinned_host"),
            SingleDeviceSharding(acc, memory_kind="device"))


def host_chunks(nbytes: int) -> list[np.ndarray]:
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
    pinned, acc_memory = memories(devices)

    def case(nbytes: int):
        sources = [jax.device_put(c, pinned) for c in host_chunks(nbytes)]
        return (lambda: jax.device_put(sources, acc_memory)), None

    return _link(case, min(LINK_CAP, room(devices[ACCELERATOR]), _host_room()), effort)


def measure_d2h(devices: Devices, effort: Effort = FULL) -> Link:
    """Copies from accelerator memory to the host CPU device, each from a fresh source."""
    _, acc_memory = memories(devices)
    host = devices[HOST]

    def case(nbytes: int):
        state = [jax.device_put(host_chunks(nbytes), acc_memory)]

        def setup():
            state[0] = _bump(state[0])
            return state[0]

        return (lambda sources: jax.device_put(sources, host)), setup

    return _link(case, min(LINK_CAP, room(devices[ACCELERATOR]) // 2, _host_room()), effort)


STAGED_COPIES = 8  # back-to-back weight copies of a staging probe
STAGED_BYTES = 4 * MiB  # each: an op's weights of a small model


def measure_staging_latency(devices: Devices, bandwidth: float, effort: Effort = FULL) -> float:
    """Seconds each weight copy adds beyond bytes / ``bandwidth`` when a segment's weights are
    staged: ``STAGED_COPIES`` ``device_put`` calls (pinned_host -> device memory, one array of
    ``STAGED_BYTES`` each) issued back to back and waited for together, as
    ``Executor._stage`` issues one per staged op. The intercept of the large-copy fit
    (``Link.latency``) is not this: it is the difference of two large, noisy times, and a
    copy queued behind another does not pay a call's whole fixed cost again."""
    pinned, acc_memory = memories(devices)
    pieces = [[jax.device_put(np.full(STAGED_BYTES // 4, i, np.float32), pinned)]
              for i in range(STAGED_COPIES)]

    def stage():
        return [jax.device_put(piece, acc_memory) for piece in pieces]

    seconds = effort.time(stage)[0].seconds
    return max(0.0, seconds / STAGED_COPIES - STAGED_BYTES / bandwidth)


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
