"""Measure a ``HardwareProfile`` on the devices present (``hx profile``), in about a minute.

Every rate is the median of repeated, warmed-up runs of jitted JAX code on the device itself, so
it includes what XLA and the runtime really cost there: matmul chains whose weights exceed the
caches, the SCORE kernel each side uses, large copies between the two memories, and a copy
overlapped with a matmul chain (contention). The cost of a device switch (launch overhead,
transfer latency) is fitted to a tiny model's decode steps (``calibrate.fit_launch``);
``calibrate.refine`` fits the profile to a real model instead.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hx.devices import ACCELERATOR, HOST, Devices
from hx.host_compute.attention import prefix_attention
from hx.models.llama import Step, attention, init_params
from hx.models.spec import ModelSpec
from hx.planner.calibrate import dispatch_plans, fit_launch, observe_interleaved
from hx.planner.timing import median_seconds
from hx.planner.profile import DeviceProfile, HardwareProfile

MATMUL_N = 1024  # (M x N) @ (N x N) products, 4 MiB of float32 weights each
MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MATMUL_WEIGHTS = 48  # at most 192 MiB of weights per chain: beyond any CPU cache
ATTENTION_SLOTS = (256, 1024, 4096)
COPY_BYTES = 16 * 2**20


@jax.jit
def _matmul_chain(x: jax.Array, weights: jax.Array) -> jax.Array:
    """x @ W_0 @ W_1 ... over the stacked ``weights`` (tanh between, so nothing folds)."""
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, weights)[0]


def _weight_stack(device: jax.Device, seed: int) -> jax.Array:
    """(MATMUL_WEIGHTS, N, N) float32 random weights on ``device`` (192 MiB)."""
    rng = np.random.default_rng(seed)
    return jax.device_put(rng.standard_normal((MATMUL_WEIGHTS, MATMUL_N, MATMUL_N), np.float32)
                          / math.sqrt(MATMUL_N), device)


def _memories(devices: Devices) -> tuple[SingleDeviceSharding, SingleDeviceSharding]:
    """(pinned host memory, device memory) of the accelerator."""
    acc = devices[ACCELERATOR]
    return (SingleDeviceSharding(acc, memory_kind="pinned_host"),
            SingleDeviceSharding(acc, memory_kind="device"))


def measure_matmul(device: jax.Device) -> tuple[tuple[int, float], ...]:
    """((M, FLOP/s), ...): chains of (M x 1024) @ (1024 x 1024) products, at most ~4 GFLOP
    and at least 4 weight matrices per chain."""
    stack = _weight_stack(device, seed=0)
    rates = []
    for rows in MATMUL_ROWS:
        n = int(min(MATMUL_WEIGHTS, max(4, 4e9 // (2 * rows * MATMUL_N * MATMUL_N))))
        x = jax.device_put(jnp.ones((rows, MATMUL_N), jnp.float32), device)
        weights = stack[:n]
        seconds = median_seconds(lambda: _matmul_chain(x, weights), repeats=7)
        rates.append((rows, 2.0 * rows * MATMUL_N * MATMUL_N * n / seconds))
    return tuple(rates)


def measure_attention(device: jax.Device, kernel) -> tuple[tuple[int, float], ...]:
    """((S, KV bytes/s), ...) of ``kernel`` reading a full cache of S slots (B=4, H=16, K=4,
    E=64, one query per row)."""
    B, H, K, E = 4, 16, 4, 64
    f = jax.jit(kernel)
    rates = []
    for slots in ATTENTION_SLOTS:
        rng = np.random.default_rng(slots)
        q = jax.device_put(rng.standard_normal((B, 1, H, E), np.float32), device)
        cache = jax.device_put({n: rng.standard_normal((B, slots, K, E), np.float32)
                                for n in ("k", "v")}, device)
        step = jax.device_put(Step(np.zeros((B, 1), np.int32), np.int32(slots - 1),
                                   np.zeros((B,), np.int32)), device)
        seconds = median_seconds(lambda: f(q, cache, step))
        rates.append((slots, 2 * B * slots * K * E * 4 / seconds))
    return tuple(rates)


def measure_memory_bandwidth(device: jax.Device) -> float:
    """Bytes/s of an elementwise pass over 64 MiB (read and write counted)."""
    a = jax.device_put(jnp.ones((16 * 2**20,), jnp.float32), device)
    f = jax.jit(lambda a: a * 1.0001 + 1.0)
    return 2 * a.nbytes / median_seconds(lambda: f(a))


def measure_links(devices: Devices) -> tuple[float, float, float]:
    """(H2D bytes/s pinned_host -> accelerator memory, D2H bytes/s accelerator -> host,
    seconds from issuing a small activation transfer to its arrival)."""
    acc = devices[ACCELERATOR]
    pinned, acc_memory = _memories(devices)
    data = np.ones((COPY_BYTES // 4,), np.float32)
    src = jax.device_put(data, pinned)
    h2d = COPY_BYTES / median_seconds(lambda: jax.device_put(src, acc_memory), repeats=21)
    on_acc = jax.device_put(data, acc_memory)
    d2h = COPY_BYTES / median_seconds(lambda: jax.device_put(on_acc, devices[HOST]), repeats=21)
    small = jax.device_put(np.ones((16, 576), np.float32), devices[HOST])
    latency = median_seconds(lambda: jax.device_put(small, acc), repeats=51)
    return h2d, d2h, latency


def measure_contention(devices: Devices) -> float:
    """Share of the shorter of a 192 MiB weight copy and a 192 MiB matmul chain lost when
    both run at once: (t_both - max) / min, clipped to [0, 1]."""
    acc = devices[ACCELERATOR]
    pinned, acc_memory = _memories(devices)
    weights = _weight_stack(acc, seed=1)
    sources = [jax.device_put(np.ones((MATMUL_N, MATMUL_N), np.float32), pinned)
               for _ in range(MATMUL_WEIGHTS)]
    x = jax.device_put(jnp.ones((1, MATMUL_N), jnp.float32), acc)
    compute = median_seconds(lambda: _matmul_chain(x, weights), repeats=3)
    copy = median_seconds(lambda: [jax.device_put(s, acc_memory) for s in sources], repeats=3)
    both = median_seconds(lambda: ([jax.device_put(s, acc_memory) for s in sources],
                                    _matmul_chain(x, weights)), repeats=3)
    return min(1.0, max(0.0, (both - max(compute, copy)) / min(compute, copy)))


def measure(devices: Devices, log: Callable[[str], None] = lambda message: None,
            launch: bool = True) -> HardwareProfile:
    """Measure every rate of a ``HardwareProfile`` on ``devices``.

    Args:
      log: called with a short line as each measurement finishes.
      launch: fit the launch overhead and transfer latency to a tiny model's decode steps
        (~15 s); leave it out when ``calibrate.refine`` follows, as it fits both to the model.
    """
    sides = {}
    h2d, d2h, latency = measure_links(devices)
    log(f"links: H2D {h2d / 2**30:.1f} GiB/s, D2H {d2h / 2**30:.1f} GiB/s, small transfer "
        f"{latency * 1e6:.0f} us")
    for side, kernel in ((ACCELERATOR, attention), (HOST, prefix_attention)):
        device = devices[side]
        matmul = measure_matmul(device)
        log(f"{side}: matmul {matmul[0][1] / 1e9:.1f} GFLOP/s at M=1, "
            f"{matmul[-1][1] / 1e9:.1f} at M={matmul[-1][0]}")
        sides[side] = DeviceProfile(matmul=matmul,
                                    memory_bandwidth=measure_memory_bandwidth(device),
                                    attention=measure_attention(device, kernel),
                                    launch_overhead=())
    contention = measure_contention(devices)
    log(f"copy/compute contention {contention:.2f}")
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    acc = devices.accelerator
    profile = HardwareProfile(
        name=f"{'emulated ' if acc.emulated else ''}{acc.device.platform}:{acc.device.id} + "
             f"host cpu ({os.cpu_count()} cores)",
        accelerator=sides[ACCELERATOR], host=sides[HOST], h2d_bandwidth=h2d,
        d2h_bandwidth=d2h, transfer_latency=latency, contention=contention,
        accelerator_memory=acc.capacity, host_memory=pages, emulated=acc.emulated)
    if not launch:
        return profile
    tiny = ModelSpec(name="profile-tiny", n_layers=8, d_model=32, n_heads=2, n_kv_heads=1,
                     head_dim=16, d_ff=32, vocab_size=64, context_length=64)
    params = jax.tree.map(np.asarray, init_params(tiny))
    seen = observe_interleaved(tiny, params, dispatch_plans(tiny.n_layers), (1,), devices,
                               rounds=1)
    return fit_launch(profile, tiny, seen, (1,), log)
