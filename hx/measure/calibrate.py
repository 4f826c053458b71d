"""Fit a ``HardwareProfile`` to a model's observed decode steps.

Micro-benchmarks miss what a model's own shapes and the executor cost: smaller matrices than the
profiler's, fixed per-call costs, Python dispatch per segment. Like TwinPilots' statistics
tracker, hx times the model's decode steps under a few plans and fits the profile so the
simulator agrees with them:

1. ``compute_scale`` per device and batch: observed / predicted decode step of the one-segment
   plans all-accelerator and all-host (the model's shapes run at other rates than the
   profiler's 1024 x 1024 products), at the launch fit's batches and at ``SCALE_BATCHES``;
2. launch overhead per segment at each batch, and the activation-transfer latency:
   non-negative least squares over plans with 1 to 121 segments (SCORE alone on either side
   among them), from their observed decode steps and the simulator's sensitivity to each (on
   this 2-core host a device switch costs more at larger batches);
3. copy/compute contention and the sync overhead after each wait on a streaming segment: grid
   search so stream-all's predicted steps meet the observed ones;
4. accelerator/host compute contention: grid search so a block step (``BLOCK``: half the
   layers on each side, two micro-batches, one computing on the host while the other computes
   on the accelerator) is predicted as observed (the profiler's figure is products that
   stream weights from memory; a model's smaller ops contend less);
5. ``model_error``: the median relative error left over the observed steps.

Every plan is observed in the same ``ROUNDS`` interleaved rounds (medians used), so the fits
compare plans timed side by side: this shared machine's speed drifts by tens of percent over
minutes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable, Sequence

import numpy as np
from scipy.optimize import nnls

from hx.devices import ACCELERATOR, HOST, Devices
from hx.executor import Executor
from hx.measure.bench import WARMUP_STEPS, DecodeProbe, time_block_decode, time_decode
from hx.models.spec import SCORE, ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict
from hx.workload import CACHE_BUCKET, round_up

# 6 timed steps a probe (median), in each of ROUNDS rounds, after one warm-up step where the
# shapes ran in an earlier round: with 12 timed and 3 warm-up steps every time, the 18 probes
# took three quarters of a full `hx profile` (185 of 296 s on the idle 2-core VM; issue 39's
# bound is 4 minutes). With 4 the fit's median error rose from 0.4-0.9 % to 6.5 % in one run.
CONTEXT, STEPS = 128, 6
FIT_PASSES = 3  # alternations of fit_compute and fit_launch (they converge in a few)
ROUNDS = 3  # interleaved observations of each plan (median used)
DISPATCH_PLANS = ((), (SCORE,), (SCORE, "MLP1"), ("K", "OUT"),  # host ops of each plan
                  ("EMBED", "Q", "K", "V", "OUT", "MLP1", "MLP2", "HEAD"))


BLOCK = (8, 2)  # (rows per micro-batch, micro-batches) of the block step fit 4 observes
# Batches at which only the one-segment plans are observed, for fit 1: throughput mode's
# micro-batches lie between and beyond the launch fit's batches (1, 16), and a device's compute
# scale is far from log-linear in batch (H100, Llama-2-7B:2L, bf16: x1.60 at batch 1, x0.22 at
# 16, so x0.91 at 4 by interpolation: a 4 x 4 block was predicted 1.28x its measured step).
SCALE_BATCHES = (4, 64)


def probe_slots(context: int, steps: int) -> int:
    """KV slots for decode probes of ``steps`` timed steps (plus warm-up) after ``context``."""
    return round_up(context + steps + 8, CACHE_BUCKET)


def observe(spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan, batch: int,
            devices: Devices, executors: dict | None = None, steps: int = STEPS,
            context: int = CONTEXT, warmup: int = WARMUP_STEPS) -> list[float]:
    """Seconds of the executor's decode steps under ``plan`` at positions ``context`` on (over a
    zero-filled KV cache: same work as after a prefill, without running one), after
    ``warmup`` untimed steps (``time_decode``).

    ``executors`` (plan -> Executor) keeps executors, and their compiled segments, for reuse
    across observations.
    """
    executors = {} if executors is None else executors
    if plan not in executors:
        executors[plan] = Executor(spec, params, plan, devices)
    return time_decode(executors[plan], DecodeProbe(spec, batch, context),
                       probe_slots(context, steps), steps, prefill=False, warmup=warmup)


def observe_block(spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan, batch: int,
                  micro_batches: int, devices: Devices, rounds: int = ROUNDS,
                  steps: int = STEPS, context: int = CONTEXT) -> float:
    """Median seconds of a decode step of a block of ``micro_batches`` x ``batch`` rows under
    ``plan`` (``rounds`` medians of ``steps`` steps, at ``observe``'s positions; the first
    round compiles)."""
    executor = Executor(spec, params, plan, devices)
    probe = DecodeProbe(spec, batch, context)
    return statistics.median(
        statistics.median(time_block_decode(executor, probe, probe_slots(context, steps),
                                            steps, micro_batches,
                                            warmup=WARMUP_STEPS if r == 0 else 1))
        for r in range(rounds))


def predicted_decode(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                     batch: int, steps: int = STEPS, context: int = CONTEXT,
                     micro_batches: int = 1) -> float:
    """The simulator's decode step at the shapes ``observe`` (or ``observe_block``) runs
    (mid-way through them)."""
    return predict(plan, spec, profile, "decode", batch, 1, probe_slots(context, steps),
                   context + steps // 2, micro_batches).seconds


def block_plan(n_layers: int) -> ExecutionPlan:
    """The plan of fit 4's block step: the first half of the layers on the accelerator."""
    return policies.layer_split(n_layers, n_layers // 2)


def dispatch_plans(n_layers: int) -> list[ExecutionPlan]:
    """The plans ``fit_launch`` observes: 1 to 121 segments (``DISPATCH_PLANS``)."""
    return [ExecutionPlan.uniform(n_layers, ops) for ops in DISPATCH_PLANS]


def observe_interleaved(spec: ModelSpec, params: dict[str, Any], plans: list[ExecutionPlan],
                        batches: tuple[int, ...], devices: Devices, rounds: int = ROUNDS,
                        also: Sequence[tuple[ExecutionPlan, int]] = (),
                        log: Callable[[str], None] = lambda message: None
                        ) -> dict[tuple[ExecutionPlan, int], float]:
    """Median decode step (seconds) of every (plan, batch), and of the (plan, batch) pairs
    ``also``, over ``rounds`` rounds that each visit all of them in turn: a slow spell of the
    machine then hits every plan alike, and the fits below compare plans observed side by
    side. ``log`` gets a line as each round starts."""
    executors: dict = {}  # each plan compiles once
    pairs = list(dict.fromkeys([(plan, b) for b in batches for plan in dict.fromkeys(plans)]
                               + list(also)))
    seen: dict[tuple[ExecutionPlan, int], list[float]] = {}
    for r in range(rounds):
        log(f"round {r + 1} of {rounds}: {len(pairs)} (plan, batch) decode probes"
            + (" (each plan compiles on its first)" if r == 0 else ""))
        for plan, b in pairs:  # compiled in round 1: one warm-up step after it
            times = observe(spec, params, plan, b, devices, executors,
                            warmup=WARMUP_STEPS if r == 0 else 1)
            seen.setdefault((plan, b), []).append(statistics.median(times))
    return {key: statistics.median(steps) for key, steps in seen.items()}


def fit_compute(profile: HardwareProfile, spec: ModelSpec,
                seen: dict[tuple[ExecutionPlan, int], float], log: Callable[[str], None]
                ) -> HardwareProfile:
    """Set each device's ``compute_scale`` so the one-segment plans (all-accelerator,
    all-host) have their observed decode step (``seen``) at every batch they were observed
    at, given the launch overhead already in ``profile`` (a step is launch + scale x compute:
    solved exactly)."""
    plans = {ACCELERATOR: policies.all_accelerator(spec.n_layers),
             HOST: policies.all_host(spec.n_layers)}
    sides = {}
    for side, plan in plans.items():
        batches = sorted(b for p, b in seen if p == plan)
        def scaled(factor: float, b: int) -> HardwareProfile:
            return dataclasses.replace(profile, **{side: dataclasses.replace(
                profile.device(side), compute_scale=((b, factor),))})

        points = []
        for b in batches:
            fixed = predicted_decode(plan, spec, scaled(0.0, b), b)
            compute = predicted_decode(plan, spec, scaled(1.0, b), b) - fixed
            points.append((b, max(seen[(plan, b)] - fixed, 0.0) / compute))
            log(f"{side} batch {b}: {seen[(plan, b)] * 1e3:.1f} ms per step, compute "
                f"x{points[-1][1]:.2f}")
        sides[side] = dataclasses.replace(profile.device(side), compute_scale=tuple(points))
    return dataclasses.replace(profile, **sides)


def fit_launch(profile: HardwareProfile, spec: ModelSpec,
               seen: dict[tuple[ExecutionPlan, int], float], batches: tuple[int, ...],
               log: Callable[[str], None]) -> HardwareProfile:
    """Launch overhead per segment at each batch and the activation-transfer latency: least
    squares with both >= 0 (``scipy.optimize.nnls``) over ``dispatch_plans``, from their
    observed decode steps (``seen``) and the simulator's sensitivity to each. Every device
    switch costs a launch and a transfer: the profiler's small-transfer timing alone varies
    several-fold between runs on this VM, so the two are fitted together on the model's steps.
    """

    def with_costs(points, latency: float) -> HardwareProfile:
        return dataclasses.replace(
            profile, transfer_latency=latency,
            accelerator=dataclasses.replace(profile.accelerator, launch_overhead=points),
            host=dataclasses.replace(profile.host, launch_overhead=points))

    probe = 1e-4
    rows, residuals = [], []
    for plan in dispatch_plans(spec.n_layers):
        for i, batch in enumerate(batches):
            base = predicted_decode(plan, spec, with_costs((), 0.0), batch)
            row = [0.0] * (len(batches) + 1)
            row[i] = (predicted_decode(plan, spec, with_costs(((batch, probe),), 0.0), batch)
                      - base) / probe
            row[-1] = (predicted_decode(plan, spec, with_costs((), probe), batch) - base) / probe
            rows.append(row)
            residuals.append(seen[(plan, batch)] - base)
    solution, _ = nnls(np.array(rows), np.array(residuals))
    points = tuple((b, float(t)) for b, t in zip(batches, solution))
    log("launch overhead per segment " + ", ".join(f"batch {b}: {t * 1e6:.0f} us"
                                                   for b, t in points)
        + f"; transfer latency {solution[-1] * 1e6:.0f} us")
    return with_costs(points, float(solution[-1]))


def fit_streaming(profile: HardwareProfile, spec: ModelSpec,
                  seen: dict[tuple[ExecutionPlan, int], float], batches: tuple[int, ...],
                  log: Callable[[str], None]) -> HardwareProfile:
    """Contention and sync overhead that best predict stream-all's observed decode steps
    (``seen``; grid search, least squares on log time ratios)."""
    plan = policies.stream_all(spec.n_layers)

    def error(contention: float, sync: float) -> float:
        trial = dataclasses.replace(profile, contention=contention, sync_overhead=sync)
        return sum(math.log(predicted_decode(plan, spec, trial, b) / seen[(plan, b)]) ** 2
                   for b in batches)

    grid = [(c / 10, s * 1e-4) for c in range(11) for s in range(21)]
    contention, sync = min(grid, key=lambda cs: error(*cs))
    log("stream-all: " + ", ".join(f"batch {b} {seen[(plan, b)] * 1e3:.1f} ms" for b in batches)
        + f" per step; contention {contention:.1f}, sync overhead {sync * 1e6:.0f} us")
    return dataclasses.replace(profile, contention=contention, sync_overhead=sync)


def fit_overlap(profile: HardwareProfile, spec: ModelSpec, block_seen: float,
                log: Callable[[str], None]) -> HardwareProfile:
    """Accelerator/host compute contention that best predicts the observed block step
    (``block_seen`` seconds of ``block_plan`` at ``BLOCK``; grid search in steps of 0.05)."""
    plan, (batch, micro) = block_plan(spec.n_layers), BLOCK

    def error(c: float) -> float:
        trial = dataclasses.replace(profile, compute_contention=c)
        return abs(math.log(predicted_decode(plan, spec, trial, batch,
                                             micro_batches=micro) / block_seen))

    contention = min((c / 20 for c in range(21)), key=error)
    log(f"block {micro} x {batch}: {block_seen * 1e3:.1f} ms per step; accelerator/host "
        f"compute contention {contention:.2f}")
    return dataclasses.replace(profile, compute_contention=contention)


def fit(profile: HardwareProfile, spec: ModelSpec,
        seen: dict[tuple[ExecutionPlan, int], float], batches: tuple[int, ...],
        log: Callable[[str], None] = lambda message: None,
        block_seen: float | None = None) -> HardwareProfile:
    """``profile`` fitted to the observed decode steps ``seen`` (seconds per (plan, batch); the
    plans of ``calibration_plans``) and, when given, the block step ``block_seen``
    (``observe_block`` of ``block_plan`` at ``BLOCK``): fits 1-5 of the module doc."""
    for i in range(FIT_PASSES):  # each fit holds the other's result fixed
        said = log if i == FIT_PASSES - 1 else (lambda message: None)
        profile = fit_compute(profile, spec, seen, said)
        profile = fit_launch(profile, spec, seen, batches, said)
    profile = fit_streaming(profile, spec, seen, batches, log)
    if block_seen is not None:
        profile = fit_overlap(profile, spec, block_seen, log)
    errors = [abs(predicted_decode(plan, spec, profile, b) / step - 1)
              for (plan, b), step in seen.items()]
    log(f"fitted profile predicts the {len(errors)} observed steps within "
        f"{statistics.median(errors):.1%} (median), {max(errors):.1%} (worst)")
    return dataclasses.replace(profile, model_error=statistics.median(errors))


def calibration_plans(n_layers: int) -> list[ExecutionPlan]:
    """The plans ``refine`` observes: the one-segment plans, stream-all, ``dispatch_plans``."""
    return ([policies.all_accelerator(n_layers), policies.all_host(n_layers),
             policies.stream_all(n_layers)] + dispatch_plans(n_layers))


def refine(profile: HardwareProfile, spec: ModelSpec, params: dict[str, Any], devices: Devices,
           batches: tuple[int, ...] = (1, 16), log: Callable[[str], None] = lambda m: None,
           scale_batches: tuple[int, ...] = SCALE_BATCHES) -> HardwareProfile:
    """A copy of ``profile`` fitted to this model's decode steps (module doc): every plan the
    fits use at ``batches``, and the one-segment plans at ``scale_batches`` too, observed in
    the same interleaved rounds. ``log`` gets a line as each stage (and round) starts and
    each fit's result."""
    plans = calibration_plans(spec.n_layers)  # the one-segment plans first
    log(f"{spec.name}: timing decode steps under {len(plans)} plans, {ROUNDS} interleaved "
        "rounds")
    seen = observe_interleaved(spec, params, plans, batches, devices,
                               also=[(plan, b) for b in scale_batches if b not in batches
                                     for plan in plans[:2]], log=log)
    log(f"{spec.name}: timing a block step ({BLOCK[1]} micro-batches x {BLOCK[0]} rows)")
    block_seen = observe_block(spec, params, block_plan(spec.n_layers), *BLOCK, devices)
    log("fitting the profile to the observed steps")
    return fit(profile, spec, seen, batches, log, block_seen)
