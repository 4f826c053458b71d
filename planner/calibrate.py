"""Fit a ``HardwareProfile`` to a model's observed decode steps.

Micro-benchmarks miss what a model's own shapes and the executor cost: smaller matrices than the
profiler's, fixed per-call costs, Python dispatch per segment. Like TwinPilots' statistics
tracker, hx times the model's decode steps under a few plans and fits the profile so the
simulator agrees with them:

1. ``compute_scale`` per device and batch: observed / predicted decode step of the one-segment
   plans all-accelerator and all-host (the model's shapes run at other rates than the
   profiler's 1024 x 1024 products);
2. launch overhead per segment at each batch: least squares over plans with 1 to 121 segments
   (SCORE alone on either side among them), from their observed decode steps and the
   simulator's sensitivity to it (on this 2-core host a device switch costs more at larger
   batches);
3. copy/compute contention and the sync overhead after each wait on a streaming segment: grid
   search so stream-all's predicted steps meet the observed ones.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable

import numpy as np

from hx.bench import DecodeProbe, DecodeTimes, time_decode
from hx.devices import ACCELERATOR, HOST, Devices
from hx.executor import Executor
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict
from hx.workload import CACHE_BUCKET, round_up

CONTEXT, STEPS = 128, 12
ROUNDS = 3  # observations of each one-segment plan, interleaved (median used)
DISPATCH_PLANS = ((), ("SCORE",), ("SCORE", "MLP1"), ("K", "OUT"),  # host ops of each plan
                  ("EMBED", "Q", "K", "V", "OUT", "MLP1", "MLP2", "HEAD"))


def observe(spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan, batch: int,
            devices: Devices, executors: dict | None = None, steps: int = STEPS,
            context: int = CONTEXT) -> DecodeTimes:
    """The executor's decode steps under ``plan`` after a ``context``-token prefill.

    ``executors`` (plan -> Executor) keeps executors, and their compiled segments, for reuse
    across observations.
    """
    slots = round_up(context + steps + 8, CACHE_BUCKET)
    executors = {} if executors is None else executors
    if plan not in executors:
        executors[plan] = Executor(spec, params, plan, devices)
    return time_decode(executors[plan], DecodeProbe(spec, batch, context), slots, steps)


def predicted_decode(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                     batch: int, steps: int = STEPS, context: int = CONTEXT) -> float:
    """The simulator's decode step at the shapes ``observe`` runs."""
    slots = round_up(context + steps + 8, CACHE_BUCKET)
    return predict(plan, spec, profile, "decode", batch, 1, slots, context + steps // 2).seconds


def fit_compute(profile: HardwareProfile, spec: ModelSpec, params: dict[str, Any],
                devices: Devices, batches: tuple[int, ...], log: Callable[[str], None],
                executors: dict | None = None) -> HardwareProfile:
    """Set each device's ``compute_scale`` so the one-segment plans (all-accelerator,
    all-host) have their observed decode step at each batch (median of ``ROUNDS``
    interleaved observations)."""
    plans = {ACCELERATOR: policies.all_accelerator(spec.n_layers),
             HOST: policies.all_host(spec.n_layers)}
    seen: dict[tuple[str, int], list[float]] = {}
    for _ in range(ROUNDS):  # alternate sides so a slow spell of the machine hits both
        for b in batches:
            for side, plan in plans.items():
                times = observe(spec, params, plan, b, devices, executors).total
                seen.setdefault((side, b), []).append(statistics.median(times))
    sides = {}
    for side, plan in plans.items():
        plain = dataclasses.replace(profile, **{side: dataclasses.replace(
            profile.device(side), compute_scale=())})
        points = []
        for b in batches:
            step = statistics.median(seen[(side, b)])
            points.append((b, step / predicted_decode(plan, spec, plain, b)))
            log(f"{side} batch {b}: {step * 1e3:.1f} ms per step, compute x{points[-1][1]:.2f}")
        sides[side] = dataclasses.replace(plain.device(side), compute_scale=tuple(points))
    return dataclasses.replace(profile, **sides)


def fit_launch(profile: HardwareProfile, spec: ModelSpec, params: dict[str, Any],
               devices: Devices, batches: tuple[int, ...], log: Callable[[str], None],
               executors: dict | None = None) -> HardwareProfile:
    """Launch overhead per segment at each batch: least squares over plans with 1 to 121
    segments, from their observed decode steps and the simulator's sensitivity to it."""

    def with_launch(points) -> HardwareProfile:
        return dataclasses.replace(
            profile, accelerator=dataclasses.replace(profile.accelerator, launch_overhead=points),
            host=dataclasses.replace(profile.host, launch_overhead=points))

    probe, points = 1e-4, []
    for batch in batches:
        slopes, residuals = [], []
        for ops in DISPATCH_PLANS:
            plan = ExecutionPlan.uniform(spec.n_layers, ops)
            seen = statistics.median(observe(spec, params, plan, batch, devices,
                                             executors).total)
            base = predicted_decode(plan, spec, with_launch(()), batch)
            probed = predicted_decode(plan, spec, with_launch(((batch, probe),)), batch)
            slopes.append((probed - base) / probe)
            residuals.append(seen - base)
        points.append((batch, max(0.0, float(np.dot(slopes, residuals) / np.dot(slopes, slopes)))))
        log(f"batch {batch}: launch overhead {points[-1][1] * 1e6:.0f} us per segment")
    return with_launch(tuple(points))


def fit_streaming(profile: HardwareProfile, spec: ModelSpec, params: dict[str, Any],
                  devices: Devices, batches: tuple[int, ...], log: Callable[[str], None],
                  executors: dict | None = None) -> HardwareProfile:
    """Contention and sync overhead that best predict stream-all's observed decode steps
    (grid search, least squares on log time ratios)."""
    plan = policies.stream_all(spec.n_layers)
    seen = {b: statistics.median(observe(spec, params, plan, b, devices, executors).total)
            for b in batches}

    def error(contention: float, sync: float) -> float:
        trial = dataclasses.replace(profile, contention=contention, sync_overhead=sync)
        return sum(math.log(predicted_decode(plan, spec, trial, b) / seen[b]) ** 2
                   for b in batches)

    grid = [(c / 10, s * 1e-4) for c in range(11) for s in range(21)]
    contention, sync = min(grid, key=lambda cs: error(*cs))
    log("stream-all: " + ", ".join(f"batch {b} {t * 1e3:.1f} ms" for b, t in seen.items())
        + f" per step; contention {contention:.1f}, sync overhead {sync * 1e6:.0f} us")
    return dataclasses.replace(profile, contention=contention, sync_overhead=sync)


def refine(profile: HardwareProfile, spec: ModelSpec, params: dict[str, Any], devices: Devices,
           batches: tuple[int, ...] = (1, 16), log: Callable[[str], None] = lambda m: None
           ) -> HardwareProfile:
    """A copy of ``profile`` fitted to this model's ops and decode steps (module doc)."""
    executors: dict = {}  # shared: each plan compiles once
    profile = fit_compute(profile, spec, params, devices, batches, log, executors)
    profile = fit_launch(profile, spec, params, devices, batches, log, executors)
    return fit_streaming(profile, spec, params, devices, batches, log, executors)
