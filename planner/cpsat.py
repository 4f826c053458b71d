"""CP-SAT placement: the outer search around the CP-SAT model (docs/architecture.md,
"Planner").

``planner.patterns`` prices every layer pattern; ``planner.cpsat_model`` counts layers per
pattern under the budgets; here ``solve`` lays the counted layers out as a plan (host-heaviest
first, the llama.cpp order) and chooses its prefill placement (``choose_prefill``: the decode
placement, or every weighted op on the accelerator with host weights staged in, where that is
predicted faster and fits), and ``plan_cpsat`` searches around it: prefill chunks to reserve
activations for (``SEARCH_CHUNKS``), the whole-run objective where prefill matters (at chunks
whose reserve exceeds the budget, with a reference plan's activations), reclaiming an activation
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
from hx.models.tensors import cache_bytes
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
# Prefill chunks CP-SAT searches and fits its plans to (``fit_chunk``): ``fitting.CHUNKS``
# and 256, where the whole prompt does not fit but half of it does with fewer resident
# weights (FlexGen's OPT-175B setting on the T4, 32 x 8 rows: 7.0 GB of activations at 256
# tokens, 14.1 GB at 512; a prefill of 2,054 s instead of 2,338 s in chunks of 128, for a
# decode step 1.2 s longer)
SEARCH_CHUNKS = tuple(sorted(set(CHUNKS) | {256}, key=lambda c: -(c or 1 << 30)))


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
    chunk of ``SEARCH_CHUNKS`` under which it fits (``fit_chunk``).

    The CP-SAT model sets aside a step's activations (``memory.activation_reserve``) at a
    prefill chunk, first ``MIN_CHUNK`` tokens. Decode-only objective first (the decode step):
    when the plan found leaves the prompt in several chunks and prefill is more than
    ``PREFILL_SHARE`` of its predicted run (every chunk of a streamed plan streams the weights
    again), it is solved again reserving the next larger chunk of ``SEARCH_CHUNKS`` while
    the run gets shorter (FlexGen's OPT-30B setting on the T4: the decode-optimal plan keeps 5
    layers' KV on the GPU, leaving room for 32-token chunks only, 412 s of prefill instead of
    157). If prefill is still more than ``PREFILL_SHARE`` of the best run (and not every
    layer is resident with its KV cache on the accelerator), the whole-run objective
    (``solve``'s ``whole_run``: a decode step plus the run's prefill per decode step) is
    solved at each chunk up to the prompt, smallest first, until one does not fit or its run
    is no shorter than the previous chunk's. Llama-2-70B at 16 x 512 + 32 on a T4: host
    MLP1s, best for decode, multiply 512-row products on the host in prefill (0.52 tokens/s
    simulated, 1.42 with the whole-run plan). At a chunk whose reserve leaves no room, the
    whole-run objective reserves the best plan's exact activations there instead
    (``plan_with_reserve``'s ``reference``): FlexGen's OPT-175B setting on the T4 (KV on
    disk, 32 x 8 rows) reserves 21 GB at 128 tokens, where plans need 3.5 GB, and its
    decode-optimal plan runs in chunks of 128 (0.523 tokens/s simulated); the whole-run plan
    at 256 holds fewer resident weights for half as many prefill steps (0.532). Every
    candidate is sized exactly and priced by ``simulator.predict_run``; the shortest run is
    kept, so the second objective never makes a plan worse. Last, EMBED moves to the
    accelerator where that fits and is predicted faster (``embed_on_accelerator``).
    Arguments and errors as ``solve``.
    """
    chunks = sorted({c or workload.prompt_tokens for c in SEARCH_CHUNKS
                     if (c or workload.prompt_tokens) <= workload.prompt_tokens})

    def attempt(chunk: int, whole_run: bool):
        result = plan_with_reserve(spec, profile, devices, workload, chunk, time_limit_s,
                                   seed, tolerance, whole_run, kv_disk, kv_streamed,
                                   best.plan if whole_run else None)
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
                      kv_streamed: bool = False, reference: ExecutionPlan | None = None
                      ) -> PlannerResult:
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
    by the shortfall (at most ``REPLANS`` times), so the returned plan always fits.

    Where the reserve at ``chunk`` leaves no plan room at all (it can exceed the budget: 21.0
    GB at 128 tokens for OPT-175B at 32 x 8 rows, where a plan needs 3.5 GB and fits the T4's
    16 GB), and a ``reference`` plan is given (``plan_cpsat``'s best so far), the model is
    solved reserving the activations the reference needs at ``chunk`` instead
    (``_reserving_like``): without it the whole-run objective could price prefill only at
    chunks far below the one its plans run at (OPT-175B: 32 tokens, 16 steps each reading
    the disk-homed weights, for plans run in chunks of 128)."""
    capacity = devices.accelerator.capacity
    tokens = min(workload.prompt_tokens, chunk)
    # no plan fits under the reserve (bar HEAD's) where it alone exceeds the budget
    over = reference is not None and capacity is not None and activation_reserve(
        spec, workload, tokens) - head_reserve(spec, workload, tokens) > capacity
    if not over:
        try:
            result = _fitted(spec, profile, devices, devices, workload, chunk, time_limit_s,
                             seed, tolerance, whole_run, MIN_CHUNK, kv_disk, kv_streamed)
        except HxError:
            if reference is None or capacity is None:
                raise
            over = True
    if over:
        return _reserving_like(spec, profile, devices, workload, chunk, time_limit_s, seed,
                               tolerance, whole_run, kv_disk, kv_streamed, reference)
    if capacity is None:
        return result
    unused = _unused(spec, workload, result.plan, chunk)
    if unused <= RECLAIM * capacity:
        return result
    try:
        roomier = _fitted(spec, profile, devices, _raised(devices, unused), workload, chunk,
                          time_limit_s, seed, tolerance, whole_run, chunk, kv_disk,
                          kv_streamed)
    except HxError:
        return result
    runs = [predict_run(r.plan, spec, profile, workload).total_s for r in (result, roomier)]
    return roomier if runs[1] < runs[0] else result


def _reserving_like(spec: ModelSpec, profile: HardwareProfile, devices: Devices,
                    workload: Workload, chunk: int, time_limit_s: float, seed: int,
                    tolerance: float | None, whole_run: bool, kv_disk: bool, kv_streamed: bool,
                    reference: ExecutionPlan) -> PlannerResult:
    """``solve`` with the accelerator budget raised by the part of the activation reserve at
    ``chunk`` that ``reference``'s exact activations there leave unused, the plan kept if it
    fits in chunks of ``chunk`` tokens or more (``fit_chunk``); else solved again reserving
    that plan's own activations (a plan attending on the accelerator needs more than one
    attending on the host), at most ``REPLANS`` times.

    Raises:
      HxError: no plan found fits so, or ``reference`` without its resident weights does not
        fit the budget at ``chunk`` (``_room_at``).
    """
    for _ in range(REPLANS + 1):
        if not _room_at(spec, devices, workload, reference, chunk):
            break
        result = solve(spec, profile, _raised(devices, _unused(spec, workload, reference, chunk)),
                       workload, time_limit_s, seed, tolerance, chunk, whole_run, kv_disk,
                       kv_streamed)
        try:
            fitted = fit_chunk(result.plan, spec, devices, workload)
        except HxError:
            fitted = None
        if fitted is not None and (fitted.prefill_chunk or workload.prompt_tokens) >= chunk:
            result.plan = fitted
            return result
        reference = result.plan
    raise HxError(f"no plan fits the accelerator memory budget of "
                  f"{devices.accelerator.capacity} bytes with its activations at "
                  f"{min(chunk, workload.prompt_tokens)} tokens reserved")


def _unused(spec: ModelSpec, workload: Workload, plan: ExecutionPlan, chunk: int) -> int:
    """Bytes of the activation reserve at ``chunk`` tokens that ``plan``'s exact activations
    there leave unused (``plan_with_reserve``)."""
    return activation_reserve(spec, workload, min(workload.prompt_tokens, chunk)) - estimate(
        plan.with_prefill_chunk(chunk), spec, workload).activations


def _room_at(spec: ModelSpec, devices: Devices, workload: Workload, plan: ExecutionPlan,
             chunk: int) -> bool:
    """Whether ``plan`` without its resident weights -- its staging, KV caches and exact
    activations at ``chunk`` tokens -- fits the accelerator budget: where it does not, a
    solve reserving its activations at ``chunk`` is not tried (``plan_with_reserve``;
    OPT-175B at 32 x 8 rows and 512 tokens: 14.1 GB of activations and 4.0 GB of staging
    against the T4's 16 GB)."""
    need = estimate(plan.with_prefill_chunk(chunk), spec, workload)
    return need.accelerator - need.weights <= devices.accelerator.capacity


def _raised(devices: Devices, extra: int) -> Devices:
    """``devices`` with the accelerator budget raised by ``extra`` bytes."""
    return dataclasses.replace(devices, accelerator=dataclasses.replace(
        devices.accelerator, capacity=devices.accelerator.capacity + extra))


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
            fitted = fit_chunk(result.plan, spec, devices, workload)
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
    host_need = spec.weight_bytes + cache_bytes(spec, workload.rows, workload.cache_slots,
                                                range(spec.n_layers))
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
        plan = fit_chunk(plan, spec, devices, workload)
        own = prefill_s(plan)
        offloaded = offloaded_prefill(plan).with_prefill_chunk(None)
        if prefill_s(offloaded) >= own:
            return plan
        offloaded = fit_chunk(offloaded, spec, devices, workload)
    except HxError:
        return plan
    return offloaded if prefill_s(offloaded) < own else plan


def fit_chunk(plan: ExecutionPlan, spec: ModelSpec, devices: Devices, workload: Workload
              ) -> ExecutionPlan:
    """``fitting.fit_prefill_chunk``'s plan (a chunk of ``fitting.CHUNKS``), then with each
    larger chunk of ``SEARCH_CHUNKS`` in turn while it still fits (a larger chunk never needs
    less memory).

    Raises:
      HxError: as ``fit_prefill_chunk``: the plan does not fit even at ``MIN_CHUNK``.
    """
    fitted = fit_prefill_chunk(plan, spec, devices, workload)
    P = workload.prompt_tokens
    for size in reversed(SEARCH_CHUNKS):  # smallest first
        if (size or P) <= (fitted.prefill_chunk or P) or (size is not None and size >= P):
            continue
        larger = fitted.with_prefill_chunk(size)
        if not fits(larger, spec, devices, workload):
            break
        fitted = larger
    return fitted
