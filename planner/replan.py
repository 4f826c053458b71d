"""Re-planning as the context grows (TwinPilots' online re-planning): a schedule of plans over a
run's decode steps.

A plan solved for one context goes stale as the context grows: attention's cost and the KV
bytes grow with every token, so the best split of ops and caches between the accelerator and
the host moves. The context at every decode step of a batch is known before the run starts
(step i attends over P + i positions), so the plans are solved ahead, like compilation, not
while decoding: the run's decode steps are cut into windows of ``every`` steps, CP-SAT solves
each window's decode step at its middle context (``cpsat.solve``, decode-only objective, every
window under the run's budgets and S cache slots), and a dynamic program over (window,
candidate plan) picks the cheapest sequence of plans: each window's predicted steps
(``simulator.predict`` at its middle context) plus, where the plan changes, the predicted
switch (``switch_seconds``). The executor switches between steps (``hx.generate.Engine``):
weights and KV caches whose homes change cross the link, segments compile once per plan.

A plan only recomputes K, V of a ``streamed`` layer (KVPR, r > 0) in a stint whose layer has
recomputed since the first decode step: the host keeps a layer's activations ``h`` only while
it recomputes (``hx.streamed_kv``), so a later plan cannot start recomputing past positions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from hx.devices import ACCELERATOR, Devices
from hx.models.spec import ModelSpec
from hx.models.tensors import kv_bytes, layer_slots
from hx.plan import (RESIDENT, ExecutionPlan, Stint, plan_at, recompute_consistent,
                     weight_owners)
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict, predict_run
from hx.workload import Workload

Solve = Callable[[Workload], ExecutionPlan]


@dataclass(frozen=True)
class Window:
    """Decode steps [start, start + steps) of a run, priced at ``context`` positions."""

    start: int
    steps: int
    context: int


@dataclass(frozen=True)
class PlanSchedule:
    """Plans over a run's decode steps, in order (``stints[0].start`` is 0).

    Attributes:
      stints: the plans and where each starts.
      predicted_s: predicted run (prefill + decode steps + switches), seconds.
      fixed: the best single plan of the candidates for the whole run, and its predicted run.
      single_s: every candidate's name -> its predicted run as the only plan.
      solve_s: wall seconds CP-SAT took over all windows.
      windows: the windows solved.
    """

    stints: tuple[Stint, ...]
    predicted_s: float
    fixed: tuple[ExecutionPlan, float]
    single_s: dict[str, float]
    solve_s: float
    windows: tuple[Window, ...]

    def plan_at(self, step: int) -> ExecutionPlan:
        """The plan of decode step ``step``."""
        return plan_at(self.stints, step)


def windows(workload: Workload, every: int) -> list[Window]:
    """The run's ``Workload.decode_steps`` decode steps in windows of ``every`` (the last
    shorter), each at the context of its middle step (step i attends over P + i + 1
    positions)."""
    P, n = workload.prompt_tokens, workload.decode_steps
    return [Window(a, min(every, n - a), P + a + min(every, n - a) // 2 + 1)
            for a in range(0, n, every)]


def window_workload(workload: Workload, window: Window) -> Workload:
    """``workload`` with its decode context (``Workload.decode_context``) at the window's."""
    return dataclasses.replace(workload, new_tokens=2 * (window.context - workload.prompt_tokens))


def switch_seconds(old: ExecutionPlan, new: ExecutionPlan, spec: ModelSpec,
                   profile: HardwareProfile, workload: Workload, context: int) -> float:
    """Predicted seconds of switching from ``old`` to ``new`` between two decode steps (0 for
    the same homes): the
    weights that become resident cross H2D, those that stop being resident D2H (their host
    copy is made from the accelerator's), and every KV cache whose device changes crosses with
    its ``context`` positions of every row, each at the link's bandwidth plus its latency per
    copy. Segments of ``new`` are compiled ahead (the run's compile time)."""
    h2d = d2h = 0
    copies = 0

    def resident(plan: ExecutionPlan, layer: int | None, op: str) -> bool:
        return plan.weights.get(layer, op) == RESIDENT

    for layer, op in weight_owners(spec):
        was, now = resident(old, layer, op), resident(new, layer, op)
        if was != now:
            nbytes = (spec if layer is None else spec.layer_spec(layer)).op_weight_bytes(op)
            h2d, d2h, copies = h2d + nbytes * now, d2h + nbytes * was, copies + 1
    for layer in range(spec.n_layers):
        before, after = old.kv[layer] == ACCELERATOR, new.kv[layer] == ACCELERATOR
        if before != after:  # host, streamed: host memory both
            nbytes = kv_bytes(spec, workload.rows, layer_slots(spec, layer, context))
            h2d, d2h, copies = h2d + nbytes * after, d2h + nbytes * before, copies + 1
    if not copies:
        return 0.0
    return (copies * profile.transfer_latency + h2d / profile.h2d_bandwidth
            + d2h / profile.d2h_bandwidth)


def distinct(plans: list[ExecutionPlan]) -> list[ExecutionPlan]:
    """``plans`` without repeats of a placement (names aside), each kept under its first
    name."""
    found: dict[ExecutionPlan, ExecutionPlan] = {}
    for plan in plans:
        found.setdefault(dataclasses.replace(plan, name=""), plan)
    return list(found.values())


def plan_schedule(spec: ModelSpec, profile: HardwareProfile, devices: Devices,
                  workload: Workload, every: int, solve: Solve,
                  also: tuple[ExecutionPlan, ...] = ()) -> PlanSchedule:
    """The cheapest schedule of plans for ``workload``'s run, re-planned every ``every``
    decode steps (module docstring).

    Args:
      devices: the budgets every plan fits (``solve`` sizes its plans for them).
      every: decode steps per window (> 0).
      solve: a window's workload -> its plan (e.g. ``cpsat.solve``'s, decode-only).
      also: plans every window may take besides the solved ones (e.g. the plan solved once
        for the whole run, which weighs its prefill): the schedule is never predicted slower
        than any of them alone.
    Raises:
      ValueError: ``every`` < 1.
      HxError: ``solve``'s (no plan fits).
    """
    if every < 1:
        raise ValueError(f"every={every}: re-plan every 1 or more decode steps")
    spans = windows(workload, every)
    started = time.perf_counter()
    candidates = distinct(list(also) + [solve(window_workload(workload, w)) for w in spans])
    solve_s = time.perf_counter() - started
    B, N, S = workload.batch, workload.micro_batches, workload.cache_slots
    prefill = {c: predict_run(c, spec, profile, workload).ttft_s for c in candidates}
    memo: dict[tuple[ExecutionPlan, Window], float] = {}

    def window_s(plan: ExecutionPlan, window: Window) -> float:
        if (plan, window) not in memo:
            memo[(plan, window)] = window.steps * predict(plan, spec, profile, "decode", B, 1, S,
                                                          window.context, N).seconds
        return memo[(plan, window)]

    def switch_s(old: ExecutionPlan, new: ExecutionPlan, window: Window) -> float:
        return switch_seconds(old, new, spec, profile, workload,
                              workload.prompt_tokens + window.start)

    def run_s(stints: list[Stint]) -> float:
        """The run under ``stints``: prefill, windows, switches."""
        total = prefill[stints[0].plan]
        for k, window in enumerate(spans):
            plan = plan_at(stints, window.start)
            before = plan_at(stints, spans[k - 1].start) if k else plan
            total += window_s(plan, window) + switch_s(before, plan, window)
        return total

    # best[c]: the cheapest (cost, stints) over the windows so far, ending under candidate c
    best = [(prefill[c] + window_s(c, spans[0]), [Stint(0, c)]) for c in candidates]
    for window in spans[1:]:
        best = [min(((cost + window_s(c, window) + switch_s(stints[-1].plan, c, window),
                      stints if stints[-1].plan == c else stints + [Stint(window.start, c)])
                     for cost, stints in best), key=lambda option: option[0])
                for c in candidates]
    stints = recompute_consistent(min(best, key=lambda option: option[0])[1])
    single = {c.name: run_s([Stint(0, c)]) for c in candidates}
    fixed = min(candidates, key=lambda c: single[c.name])
    return PlanSchedule(tuple(stints), run_s(stints), (fixed, single[fixed.name]), single,
                        solve_s, tuple(spans))


def cpsat_schedule(spec: ModelSpec, profile: HardwareProfile, devices: Devices,
                   workload: Workload, every: int, time_limit_s: float = 2.0,
                   kv_streamed: bool = False) -> PlanSchedule:
    """``plan_schedule`` with CP-SAT's decode-step plan of each window (``cpsat.solve``),
    named ``cpsat@<context>`` by the context it was solved at, and the plan hx takes without
    re-planning (``cpsat.plan_cpsat`` for the whole run, prefill weighed) named ``cpsat@run``.
    Each window's solve is warm-started from the plan before it (the whole run's, then the
    previous window's: ``cpsat.solve``'s ``hint``); ``PlanSchedule.solve_s`` counts the
    windows' solves."""
    from hx.planner.cpsat import plan_cpsat, solve

    once = plan_cpsat(spec, profile, devices, workload, time_limit_s, kv_streamed=kv_streamed)
    previous = [once.hint]

    def at(window: Workload) -> ExecutionPlan:
        result = solve(spec, profile, devices, window, time_limit_s, kv_streamed=kv_streamed,
                       hint=previous[-1])
        previous.append(result.hint)
        return dataclasses.replace(result.plan,
                                   name=f"{result.plan.name}@{window.decode_context}")

    return plan_schedule(spec, profile, devices, workload, every, at,
                         (dataclasses.replace(once.plan, name="cpsat@run"),))
