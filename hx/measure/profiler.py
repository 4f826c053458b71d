"""Measure a ``HardwareProfile`` on the devices present: ``hx profile`` (``measure``), or a
``quick`` one when a command needs a profile and none is saved (``load_or_measure``).

Every figure is measured the way the executor uses the hardware, as the median of warmed-up,
repeated runs that stop once the median is stable (``timing.stable_seconds``, under an
``Effort``; runs that a fit or a ratio compares are interleaved, so a slow spell of this shared
machine hits them alike): copies between the devices, transfer latency and JAX's bare round
trip in ``links``; matmul, memory, attention, decompression rates, copy/compute contention and
the disk's cold read rate in ``rates``;
here the **launch overhead** (without ``calibrate.refine``): the executor's own decode steps of a
tiny model under plans of 1 to 121 segments (``QUICK``: the 33-segment one), the cost per
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
import tempfile
import time
from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hx.devices import ACCELERATOR, HOST, Devices
from hx.host_compute.attention import host_attention
from hx.measure.calibrate import dispatch_plans, observe_interleaved, predicted_decode
from hx.measure.links import (ROUND_TRIP_SHAPE, SMALL_SHAPE, measure_d2h, measure_h2d,
                              measure_round_trip, measure_small_transfers,
                              measure_staging_latency)
from hx.measure.rates import (DISK_BYTES, LOW_DTYPE, measure_attention,
                              measure_compute_contention, measure_contention, measure_dequantize,
                              measure_disk_read, measure_ggml_matmul, measure_int4_matmul,
                              measure_matmul,
                              measure_memory_bandwidth)
from hx.measure.timing import FULL, QUICK, MiB, Effort
from hx.models.layers import attention
from hx.models.decoder import init_params
from hx.models.spec import EMBED, HEAD, ModelSpec
from hx.planner.policies import NEEDS_PROFILE, needs_profile
from hx.planner.profile import QUICK_PATH, DeviceProfile, HardwareProfile, load_default
from hx.workload import Workload

TINY = ModelSpec(name="profile-tiny", n_layers=8, d_model=32, n_heads=2, n_kv_heads=1,
                 head_dim=16, d_ff=32, vocab_size=64, context_length=64)


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
    log(f"launch overhead: timing a tiny model's decode steps under {len(chosen)} plans")
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

def measure_side(devices: Devices, side: str, kernel, effort: Effort,
                 log: Callable[[str], None]) -> DeviceProfile:
    """The rates of one side (``ACCELERATOR`` or ``HOST``): matmul curves (float32, and
    bfloat16 on the accelerator), memory bandwidth, decompression curves, and the attention
    rates of its SCORE ``kernel`` over float32 and bfloat16 caches; no launch overhead."""
    device = devices[side]
    log(f"{side}: timing matmul, memory and attention rates")
    curves = {dtype: measure_matmul(device, dtype, effort.matmul_rows, effort)
              for dtype in ((jnp.float32, LOW_DTYPE) if side == ACCELERATOR
                            else (jnp.float32,))}
    memory = measure_memory_bandwidth(device, effort)
    for dtype, curve in curves.items():
        log(f"{side}: matmul {curve[0][1] / 1e9:.1f} GFLOP/s at M={curve[0][0]}, "
            f"{curve[-1][1] / 1e9:.1f} at M={curve[-1][0]} ({jnp.dtype(dtype).name})")
    log(f"{side}: memory {memory / 1e9:.1f} GB/s")
    dequant = {dtype: measure_dequantize(devices, side, dtype, effort) for dtype in curves
               if dtype == jnp.float32 or effort is not QUICK}  # quick: bf16 priced as f32
    for dtype, table in dequant.items():
        log(f"{side}: decompression into {jnp.dtype(dtype).name}, ns per weight at "
            f"{', '.join(f'{n / 1e6:.1f}' for n, _ in table[0][1])} M weights: "
            + "; ".join(f"{f} " + " ".join(f"{t * 1e9:.2f}" for _, t in points)
                        for f, points in table))
    int4 = measure_int4_matmul(device, effort.matmul_rows, effort) if side == HOST else ()
    if int4:
        log(f"{side}: torch's int4 kernel {int4[0][1] / 1e9:.1f} GFLOP/s at M={int4[0][0]}, "
            f"{int4[-1][1] / 1e9:.1f} at M={int4[-1][0]}")
    ggml = measure_ggml_matmul(device, effort.ggml_rows, effort) if side == HOST else ()
    for layout, curve in ggml:
        log(f"{side}: {layout} products by ggml's path (hx's own kernels where the CPU has "
            f"AVX-512 VNNI) {curve[0][1] / 1e9:.1f} GFLOP/s at "
            f"M={curve[0][0]}, {curve[-1][1] / 1e9:.1f} at M={curve[-1][0]}")
    return DeviceProfile(
        matmul=curves[jnp.float32], memory_bandwidth=memory, int4_matmul=int4,
        ggml_matmul=ggml,
        attention=measure_attention(device, kernel, effort.attention_slots, effort),
        attention_low=measure_attention(device, kernel, effort.attention_slots, effort,
                                        LOW_DTYPE),
        launch_overhead=(), matmul_low=curves.get(LOW_DTYPE, ()),
        dequantize=dequant[jnp.float32], dequantize_low=dequant.get(LOW_DTYPE, ()))


def measure(devices: Devices, log: Callable[[str], None] = lambda message: None,
            launch: bool = True, effort: Effort = FULL) -> HardwareProfile:
    """Measure every figure of a ``HardwareProfile`` on ``devices`` (module doc).

    Args:
      log: called with a short line as each stage of measurements starts and as each
        measurement finishes.
      launch: fit the launch overhead to a tiny model's decode steps (``fit_launch_overhead``);
        leave it out when ``calibrate.refine`` follows, as it fits it to the model.
      effort: ``FULL`` (``hx profile``) or ``QUICK``.
    """
    log("timing copies between the devices: H2D, D2H, small and staged copies, round trip")
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
    staging = measure_staging_latency(devices, h2d.bandwidth, effort)
    log(f"staged weight copies: {staging * 1e6:.0f} us each beyond bytes / bandwidth")
    round_trip = measure_round_trip(devices, effort)
    log(f"bare round trip accelerator -> host op -> accelerator {round_trip * 1e6:.0f} us")
    sides = {side: measure_side(devices, side, kernel, effort, log)
             for side, kernel in ((ACCELERATOR, jax.jit(attention)), (HOST, host_attention))}
    log("timing copy/compute and accelerator/host compute contention")
    contention = measure_contention(devices, effort)
    compute_contention = measure_compute_contention(devices, effort)
    log(f"copy/compute contention {contention:.2f}, accelerator/host compute contention "
        f"{compute_contention:.2f}")
    disk_read = measure_disk(effort, log)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    acc = devices.accelerator
    own_limit = (acc.device.memory_stats() or {}).get("bytes_limit")  # not a user's budget
    quick = effort is QUICK
    profile = HardwareProfile(
        name=f"{'emulated ' if acc.emulated else ''}{acc.device.platform}:{acc.device.id} + "
             f"host cpu ({os.cpu_count()} cores){', quick' if quick else ''}",
        accelerator=sides[ACCELERATOR], host=sides[HOST], h2d_bandwidth=h2d.bandwidth,
        d2h_bandwidth=d2h.bandwidth, transfer_latency=latency, contention=contention,
        compute_contention=compute_contention,
        accelerator_memory=own_limit, host_memory=pages, emulated=acc.emulated,
        h2d_latency=staging, d2h_latency=d2h.latency,
        quick=quick, round_trip=round_trip, disk_read_bandwidth=disk_read)
    if not launch:
        return profile
    return fit_launch_overhead(profile, devices, effort.launch_plans, log)


def measure_disk(effort: Effort, log: Callable[[str], None]) -> float:
    """The disk tier's cold read rate, bytes/s (``rates.measure_disk_read``: 256 MiB, a
    quarter in a quick profile) under the temporary directory, where ``hx.disk`` spills by
    default; 0 (no disk tier: the planner keeps everything in memory) where no file can be
    written there, said in a line to ``log``."""
    where = tempfile.gettempdir()
    nbytes = DISK_BYTES if effort is not QUICK else DISK_BYTES // 4
    log(f"timing cold reads of a {nbytes // MiB} MiB file in {where}")
    try:
        rate = measure_disk_read(where, nbytes, effort)
    except OSError as e:
        log(f"no disk read rate: cannot write a file in {where} ({e.strerror}); plans keep "
            "every weight in memory")
        return 0.0
    log(f"disk: {rate / 1e9:.2f} GB/s cold reads")
    return rate


def quick(devices: Devices, log: Callable[[str], None] = lambda message: None
          ) -> HardwareProfile:
    """A profile measured in under 20 s (``QUICK``: fewer sizes, shorter runs, the launch
    overhead from two plans of the tiny model, no calibration), marked ``quick``."""
    return measure(devices, log, launch=True, effort=QUICK)


def for_policy(policy: str | None, path: str | None, devices: Devices,
               log: Callable[[str], None] = lambda message: None,
               plans: Sequence[tuple[ModelSpec, Devices, Workload]] = ()
               ) -> HardwareProfile | None:
    """The profile a command choosing plans by ``policy`` (None: no policy chooses them)
    uses: the one at ``path`` or saved, if any; without one, ``load_or_measure``'s (a quick
    one) where a plan needs a profile -- a policy that prices ops, or ``auto`` where its
    stand-in, the largest layer split, overflows the host budget for one of ``plans``,
    (spec, devices, workload) each (``policies.needs_profile``: only CP-SAT keeps weights on
    disk, priced by the profile's disk read rate) -- else None (``auto`` plans a layer split).

    Raises:
      HxError: ``path`` given but missing or malformed.
    """
    profile = load_default(path)
    if profile is None and (policy in NEEDS_PROFILE or any(
            needs_profile(policy, *plan) for plan in plans)):
        return load_or_measure(path, devices, log)
    return profile


def load_or_measure(path: str | None, devices: Devices,
                    log: Callable[[str], None] = lambda message: None) -> HardwareProfile:
    """The profile at ``path``; without one, the one ``hx profile`` saved (``DEFAULT_PATH``);
    without that, the quick one an earlier command measured (``QUICK_PATH``), else a ``quick``
    one measured now and saved there -- never at ``DEFAULT_PATH``, so that no command which
    uses a profile only when one is saved plans on it. Using a quick profile, says so in one
    line to ``log``, with where it is and how to measure a full one.

    Raises:
      HxError: ``path`` given but missing or malformed, or a malformed ``QUICK_PATH``.
    """
    profile = load_default(path)
    if profile is not None:
        return profile
    full = "run `hx profile` for a full, calibrated one"
    if os.path.isfile(QUICK_PATH):
        log(f"no hardware profile: using the quick one an earlier command measured "
            f"({QUICK_PATH}); {full}")
        return HardwareProfile.load(QUICK_PATH)
    start = time.perf_counter()
    profile = quick(devices)
    seconds = time.perf_counter() - start
    try:
        profile.save(QUICK_PATH)
        where = (f"kept in {QUICK_PATH} for commands that need a profile; a plain "
                 f"`hx generate` within the host budget does not use it")
    except OSError as e:
        where = f"not saved ({e.strerror})"
    log(f"no hardware profile: measured a quick one in {seconds:.0f} s ({where}); {full}")
    return profile
