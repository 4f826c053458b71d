"""CP-SAT placement: the outer search around the CP-SAT model (docs/architecture.md,
"Planner").

``planner.patterns`` prices every layer pattern; ``planner.cpsat_model`` counts layers per
pattern under the budgets; here ``solve`` lays the counted layers out as a plan (host-heaviest
first, the llama.cpp order) and chooses its prefill placement (``choose_prefill``: the decode
placement, or every weighted op on the accelerator with host weights staged in, where that is
predicted faster and fits), and ``plan_cpsat`` searches around it: prefill chunks to reserve
activations for, the whole-run objective where prefill matters, reclaiming an activation
reserve the plan leaves unused, re-plans at a lower budget when a plan's size exceeds the
model's, and EMBED on the accelerator (``plan_cpsat``'s docstring). Every candidate is priced by
``simulator.predict_run``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hx.devices import ACCELERATOR, Devices
from hx.errors import HxError
from hx.memory import PROXY, activation_reserve, check_fits, estimate, head_reserve
from hx.models.spec import ModelSpec
from hx.models.tensors import kv_bytes
from hx.plan import RESIDENT, ExecutionPlan
from hx.planner.cpsat_model import Hint, solve_counts
from hx.planner.fitting import CHUNKS, fit_prefill_chunk, fits
from hx.planner.patterns import (Pattern, decode_front, end_costs, layer_plan,
                                 offloaded_prefill, prune, whole_run_costs)
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict_prefill, predict_run
from hx.workload import MIN_CHUNK, Workload

PREFILL_SHARE = 0.1  # of a run, below which plan_cpsat looks no further for a faster prefill
REPLANS = 3  # re-solves with a lowered budget when the exact size exceeds the model's
RECLAIM = 0.02  # of the accelerator budget: reserved activations a plan leaves unused, to reclaim


@dataclass
class PlannerResult:
    """The plan and how the solver got there.

    Attributes:
      plan: the chosen plan (validated; fits the budgets).
      status: ``OPTIMAL`` or ``FEASIBLE`` (time limit hit: best plan found, not proven).
      objective_s / bound_s: the model's objective (predicted decode step or, whole-run, the
        run per decode step: ``solve``) and the solver's best bound, in seconds; ``gap`` =
        (objective - bound) / objective.
      solve_s: CP-SAT wall time (both solves); ``patterns``: patterns left after pruning.
      counts: layers per pattern in the solution.
      chosen_s: the same for the plan taken (within ``tolerance`` of objective_s, with the
        fewest device switches); ``tolerance``: the fraction used.
      model_bytes: accelerator bytes of the plan taken as the model counts them (the
        activation reserve included; ``memory.estimate`` sizes the plan exactly).
      hint: the counts taken, as a warm start for a later solve (``solve``'s ``hint``).
    """

    plan: ExecutionPlan
    status: str
    objective_s: float
    bound_s: float
    gap: float
    solve_s: float
    patterns: int
    counts: dict[Pattern, int]
    chosen_s: float
    tolerance: float
    model_bytes: int
    hint: Hint


def plan_cpsat(spec: ModelSpec, profile: HardwareProfile, devices: Devices, workload: Workload,
               time_limit_s: float = 5.0, seed: int = 0, tolerance: float | None = None,
               kv_disk: bool = False, kv_streamed: bool = False) -> PlannerResult:
    """The plan with the shortest predicted run (prefill, then decode steps: ``simulator.predict_run``)
    of those found by two objectives, under the memory budgets, with the largest prefill
    chunk under which it fits (``fitting.fit_prefill_chunk``).

    The CP-SAT model sets aside a step's activations (``memory.activation_reserve``) at a
    prefill chunk, first ``MIN_CHUNK`` tokens. Decode-only objective first (the decode step):
    when the plan found leaves the prompt in several chunks and prefill is more than
    ``PREFILL_SHARE`` of its predicted run (every chunk of a streamed plan streams the weights
    again), it is solved again reserving the next larger chunk of ``fitting.CHUNKS`` while
    the run gets shorter (FlexGen's OPT-30B setting on the T4: the decode-optimal plan keeps 5
    layers' KV on the GPU, leaving room for 32-token chunks only, 412 s of prefill instead of
    157). If prefill is still more than ``PREFILL_SHARE`` of the best run (and not every
    layer is resident with its KV cache on the accelerator), the whole-run objective
    (``solve``'s ``whole_run``: a decode step plus the run's prefill per decode step) is
    solved at each chunk up to the prompt, smallest first, until one does not fit or its run
    is no shorter than the previous chunk's. Llama-2-70B at 16 x 512 + 32 on a T4: host
    MLP1s, best for decode, multiply 512-row products on the host in prefill (0.52 tokens/s
    simulated, 1.42 with the whole-run plan). Every candidate is sized exactly and priced by
    ``simulator.predict_run``; the shortest run is kept, so the second objective never makes a plan
    worse. Last, EMBED moves to the accelerator where that fits and is predicted faster
    (``embed_on_accelerator``). Arguments and errors as ``solve``.
    """
    chunks = sorted({c or workload.prompt_tokens for c in CHUNKS
                     if (c or workload.prompt_tokens) <= workload.prompt_tokens})

    def attempt(chunk: int, whole_run: bool):
        result = plan_with_reserve(spec, profile, devices, workload, chunk, time_limit_s,
                                   seed, tolerance, whole_run, kv_disk, kv_streamed)
        run = predict_run(result.plan, spec, profile, workload)
        return result, (run.ttft_s, run.total_s)

    best, (prefill_s, best_s) = attempt(chunks[0], False)  # raises if nothing fits
    for chunk in chunks[1:]:  # decode-only, larger chunks while prefill matters
        if prefill_s <= PREFILL_SHARE * best_s:
            break
        if (best.plan.prefill_chunk or workload.prompt_tokens) >= chunk:
            continue
        try:
            result, run = attempt(chunk, False)
        except HxError:
            break
        if run[1] >= best_s:
            break
        best, (prefill_s, best_s) = result, run
    # whole-run candidates when prefill still matters, unless every layer is resident with
    # its KV cache on the accelerator (no placement prefills faster)
    if prefill_s > PREFILL_SHARE * best_s and any(
            p.kv != ACCELERATOR or set(p.ops) != {RESIDENT} for p in best.counts):
        previous = float("inf")
        for chunk in chunks:
            try:
                result, (_, run_s) = attempt(chunk, True)
            except HxError:
                break
            if run_s < best_s:
                best, best_s = result, run_s
            if run_s >= previous:
                break
            previous = run_s
    gathered = embed_on_accelerator(best.plan)
    if fits(gathered, spec, devices, workload) and \
            predict_run(gathered, spec, profile, workload).total_s < best_s:
        best.plan = gathered
    return best


def embed_on_accelerator(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with EMBED's table resident and its gather on the accelerator in both phases.

    The pattern model prices EMBED's states after a host layer (``patterns.end_costs``), where
    a host EMBED needs no copy; after the accelerator layer that usually follows it, a host
    EMBED's rows are copied over behind the other step inputs. ``plan_cpsat`` takes this plan
    instead where the table fits beside its plan and the whole run is predicted shorter
    (Llama-3-8B on the H100 preset, batch 1: 0.42 ms of a 9.8 ms decode step, a 1.05 GB
    table)."""
    phases = {phase: dataclasses.replace(plan.phase(phase), embed=ACCELERATOR)
              for phase in ("prefill", "decode")}
    return dataclasses.replace(plan, weights=dataclasses.replace(plan.weights, embed=RESIDENT),
                               **phases)


def plan_with_reserve(spec: ModelSpec, profile: HardwareProfile, devices: Devices,
                      workload: Workload, chunk: int, time_limit_s: float, seed: int,
                      tolerance: float | None, whole_run: bool = False, kv_disk: bool = False,
                      kv_streamed: bool = False) -> PlannerResult:
    """``solve`` with activations reserved at ``chunk`` tokens, the plan then sized exactly
    (``memory.estimate``) with its largest fitting prefill chunk.

    The reserve (``memory.activation_reserve``) is an upper bound taken before the plan is
    known -- every activation on the accelerator, twice, and the XLA temporaries of the
    whole model as one segment -- and overstates a streamed plan's by up to 2.3 GB (OPT-30B,
    4 x 16 rows, 128-token chunks on the A10G preset: 3.55 GB reserved, 1.29 GB needed), room
    a plan could hold KV caches or resident weights in. When the plan's exact activations at
    ``chunk`` fall short of the reserve by more than ``RECLAIM`` of the accelerator budget,
    the model is solved again with the budget raised by the difference (lowered again by any
    shortfall at ``chunk``: the room is for the chunk's activations), and that plan (with
    that solve's objective and status) is taken if ``simulator.predict_run`` predicts a shorter run.
    Should a plan exceed the accelerator or the host budget (the host's read buffers of
    disk-homed data are only sized there), the model is solved again with that budget lowered
    by the shortfall (at most ``REPLANS`` times), so the returned plan always fits."""
    result = _fitted(spec, profile, devices, devices, workload, chunk, time_limit_s, seed,
                     tolerance, whole_run, MIN_CHUNK, kv_disk, kv_streamed)
    capacity = devices.accelerator.capacity
    if capacity is None:
        return result
    unused = activation_reserve(spec, workload, min(workload.prompt_tokens, chunk)) - estimate(
        result.plan.with_prefill_chunk(chunk), spec, workload).activations
    if unused <= RECLAIM * capacity:
        return result
    raised = dataclasses.replace(devices, accelerator=dataclasses.replace(
        devices.accelerator, capacity=capacity + unused))
    try:
        roomier = _fitted(spec, profile, devices, raised, workload, chunk, time_limit_s, seed,
                          tolerance, whole_run, chunk, kv_disk, kv_streamed)
    except HxError:
        return result
    runs = [predict_run(r.plan, spec, profile, workload).total_s for r in (result, roomier)]
    return roomier if runs[1] < runs[0] else result


def _fitted(spec: ModelSpec, profile: HardwareProfile, devices: Devices, budget: Devices,
            workload: Workload, chunk: int, time_limit_s: float, seed: int,
            tolerance: float | None, whole_run: bool, smallest: int, kv_disk: bool = False,
            kv_streamed: bool = False) -> PlannerResult:
    """``solve`` under ``budget``, lowered by any shortfall until the plan fits ``devices`` in
    prefill chunks of ``smallest`` tokens or more (``plan_with_reserve``)."""
    for attempt in range(REPLANS + 1):
        result = solve(spec, profile, budget, workload, time_limit_s, seed, tolerance, chunk,
                       whole_run, kv_disk, kv_streamed)
        try:
            fitted = fit_prefill_chunk(result.plan, spec, devices, workload)
            if (fitted.prefill_chunk or workload.prompt_tokens) >= smallest:
                result.plan = fitted
                return result
        except HxError:
            pass
        smallest_plan = result.plan.with_prefill_chunk(smallest)
        need = estimate(smallest_plan, spec, workload)
        over = {side: getattr(need, side) - getattr(devices, side).capacity
                for side in ("accelerator", "host")
                if getattr(devices, side).capacity is not None}
        if max(over.values(), default=0) <= 0:  # fits at smallest, a larger chunk did not
            result.plan = smallest_plan
            return result
        if attempt == REPLANS:
            check_fits(smallest_plan, spec, devices, workload, sizing=PROXY)  # raises: by how much
        # the accelerator's below the bytes the model counted for this plan, less the
        # shortfall: lowering a budget the plan did not fill by the shortfall alone can
        # return the same plan
        start = {side: getattr(budget, side).capacity for side in over}
        if "accelerator" in start:
            start["accelerator"] = min(start["accelerator"], result.model_bytes)
        budget = dataclasses.replace(budget, **{
            side: dataclasses.replace(getattr(budget, side), capacity=start[side] - bytes_over)
            for side, bytes_over in over.items() if bytes_over > 0})
    raise AssertionError("unreachable")


def solve(spec: ModelSpec, profile: HardwareProfile, devices: Devices, workload: Workload,
          time_limit_s: float = 5.0, seed: int = 0, tolerance: float | None = None,
          prefill_chunk: int = MIN_CHUNK, whole_run: bool = False, kv_disk: bool = False,
          kv_streamed: bool = False, hint: Hint | None = None) -> PlannerResult:
    """The plan minimising the predicted decode step (or, ``whole_run``, the run per decode
    step) under the memory budgets.

    Args:
      spec: model shapes.
      profile: rates the simulator prices patterns with.
      devices: budgets (accelerator capacity; host capacity when known).
      workload: batch and cache shapes the plan must fit and is priced at (decode context:
        the middle of the cache).
      time_limit_s: CP-SAT's deterministic time limit (its measure of work in "deterministic
        seconds", independent of machine load; one took 1.5-3.8 wall-clock seconds, median
        2.1, of one core of the development machine in the standard grid's solves); when hit,
        the best plan found is returned with status FEASIBLE and its gap.
      seed: CP-SAT random seed (one worker, a deterministic limit: the result is
        reproducible).
      prefill_chunk: prefill tokens per step the activation reserve is sized at (and, with
        ``whole_run``, prefill is priced at).
      whole_run: minimise a decode step plus the run's prefill steps at ``prefill_chunk``
        over its S - P decode steps, prefill placed as decode (``whole_run_costs``,
        ``end_costs``; ``PlannerResult``'s seconds are these); else the decode step.
      kv_disk: offer patterns with the KV cache on disk (FlexGen's OPT-175B setting), which
        the executor refuses: for plans that are simulated only (``policies.plan_on``). Weights
        go to disk in any case where host memory cannot hold them and the profile has a disk
        read rate.
      kv_streamed: offer patterns with the KV cache ``streamed`` (host memory, attended on
        the accelerator, with KVPR's recompute at ``recompute.choose_recompute``'s r), which
        the executor refuses yet: for plans that are simulated only.
      tolerance: among plans predicted within this fraction of the optimum, the one with the
        fewest device switches is taken (a second solve): differences smaller than the cost
        model's error are noise, and every switch is a launch and a transfer whose cost varies
        most from run to run. None: the profile's ``model_error``; 0 turns it off. This solve
        starts from the optimum as a hint and gets what is left of the time limit; if it finds
        nothing, the optimum is taken. ``status`` is the first solve's (optimality of
        ``objective_s``).
      hint: a solution to start the first solve from (``PlannerResult.hint`` of an earlier
        solve, e.g. at a shorter context: ``replan.cpsat_schedule``'s warm start).
    Raises:
      HxError: no plan fits the budgets; the message gives the smallest accelerator budget
        that admits one (and says when a profile without a disk read rate kept weights off
        the disk).
    """
    # the disk tier only when host memory cannot hold the weights and the KV cache: its twins
    # nearly triple the patterns, and CP-SAT's search time with them
    host_need = spec.weight_bytes + spec.n_layers * kv_bytes(spec, workload.rows,
                                                             workload.cache_slots)
    short = devices.host.capacity is not None and host_need > devices.host.capacity
    disk = short and bool(profile.disk_read_bandwidth)
    if whole_run:
        costs = prune(whole_run_costs(spec, profile, workload, prefill_chunk, disk, kv_disk,
                                      kv_streamed))
    else:
        costs = list(decode_front(spec, profile, workload, disk, kv_disk, kv_streamed))
    ends = list(end_costs(spec, profile, workload, disk, prefill_chunk if whole_run else None))
    tokens = min(workload.prompt_tokens, prefill_chunk)
    head_act = head_reserve(spec, workload, tokens)
    act = activation_reserve(spec, workload, tokens) - head_act
    tolerance = profile.model_error if tolerance is None else tolerance
    try:
        found = solve_counts(spec, costs, ends, act, head_act, devices, workload, time_limit_s,
                             seed, tolerance, hint)
    except HxError as e:
        if short and not disk:
            raise HxError(f"{e}. The hardware profile {profile.name!r} has no disk read rate, "
                          "so no weights were planned on disk: measure one with `hx profile` "
                          "(a profile saved before hx measured disks has none)") from None
        raise
    # host-heaviest patterns first: accelerator layers last, as llama.cpp offloads them
    order = sorted(found.counts, key=lambda p: (p.devices().count(ACCELERATOR),
                                                p.kv == ACCELERATOR))
    layers = [p for p in order for _ in range(found.counts[p])]
    plan = choose_prefill(layer_plan(spec, layers, found.head, "cpsat", found.embed), spec,
                          profile, devices, workload)
    objective = found.objective_s
    return PlannerResult(plan, found.status, objective, found.bound_s,
                         (objective - found.bound_s) / objective if objective else 0.0,
                         found.solve_s, len(costs), found.counts, found.chosen_s, tolerance,
                         found.model_bytes, found.hint)


def choose_prefill(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                   devices: Devices, workload: Workload) -> ExecutionPlan:
    """Keep the decode placement for prefill, or run every weighted op of prefill on the
    accelerator (host weights staged in) when that is predicted faster and still fits; each
    priced over all its prefill chunks at the largest chunk it fits with. The offloaded plan
    is sized (XLA compiles) only if its prefill in one step, the fewest weight copies, is
    predicted faster."""
    def prefill_s(p: ExecutionPlan) -> float:
        return predict_prefill(p, spec, profile, workload.prefill_rows, workload.prompt_tokens,
                               workload.cache_slots, workload.prefill_micro_batches)

    try:
        plan = fit_prefill_chunk(plan, spec, devices, workload)
        own = prefill_s(plan)
        offloaded = offloaded_prefill(plan).with_prefill_chunk(None)
        if prefill_s(offloaded) >= own:
            return plan
        offloaded = fit_prefill_chunk(offloaded, spec, devices, workload)
    except HxError:
        return plan
    return offloaded if prefill_s(offloaded) < own else plan
