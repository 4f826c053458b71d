"""CP-SAT placement: how many layers take each placement pattern (docs/architecture.md, "Planner").

A layer's pattern fixes where its KV cache (and so SCORE) lives and, for each of its six
weighted ops, whether the op runs on the host (weights at home there), on the accelerator with
resident weights, or on the accelerator with weights streamed in: 2 x 3^6 = 1458 patterns. All
layers of a model have the same shapes, so a plan is a count per pattern, plus a choice for
HEAD. Each pattern is priced by the simulator -- the marginal time of one more layer of it
in a decode step and, for the whole-run objective, in a prefill step at the chunk the model is
solved for -- and by its memory; patterns that another beats on every count are dropped;
CP-SAT then picks the counts (a full per-op interval model does not scale: no solution in 60 s
for 30 x 7 ops: docs/measurements/log.md, "Planner"). Minimised: the predicted decode step (Σ n_p
decode_p + HEAD) or,
where prefill is a large part of the run, the run per decode step (Σ n_p (decode_p +
prefill_p · prefill steps / (S - P)) + HEAD's), subject to:

  Σ n_p = L;  accelerator: Σ n_p (resident_p + kv_p) + HEAD + staging + activations ≤ capacity;
  host: Σ n_p host_p + EMBED + HEAD ≤ host capacity;  staging ≥ 2 m and ≥ m + HEAD if HEAD is
  streamed, m ≥ largest staged segment of every used pattern (two consecutive segments are
  staged at once; a conservative bound across pattern boundaries).

A second solve then takes, among plans predicted within the profile's ``model_error`` (the
fitted simulator's measured error) of that optimum, the one with the fewest device switches:
the cost model cannot tell such plans apart, and switches are where it errs most. Layers are
laid out host-heaviest first (the llama.cpp order); prefill keeps the decode placement unless
running every weighted op on the accelerator (host weights staged in) is predicted faster and
fits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from hx.devices import ACCELERATOR, HOST, Devices
from hx.errors import HxError
from hx.memory import PROXY, activation_reserve, check_fits, estimate
from hx.models.spec import LAYER_OPS, SCORE, ModelSpec
from hx.models.tensors import kv_bytes, weight_dtype
from hx.plan import (DISK, RESIDENT, STREAMED, WEIGHTED_OPS, ExecutionPlan, Placement,
                     WeightHomes, score_device)
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict, predict_prefill
from hx.schedule import disk_bytes, staged_bytes
from hx.segments import split_segments
from hx.workload import MIN_CHUNK, Workload, prefill_chunks

OP_STATES = (HOST, RESIDENT, STREAMED)  # per weighted op: runs on host / accelerator
TIME_UNIT = 1e-7  # seconds per integer unit of the objective (0.1 µs)
PREFILL_SHARE = 0.1  # of a run, below which plan_cpsat looks no further for a faster prefill
REPLANS = 3  # re-solves with a lowered budget when the exact size exceeds the model's
RECLAIM = 0.02  # of the accelerator budget: reserved activations a plan leaves unused, to reclaim


@dataclass(frozen=True)
class Pattern:
    """Placement of one layer: KV home and the state of each weighted op."""

    kv: str
    ops: tuple[str, ...]  # per WEIGHTED_OPS: host, resident or streamed

    def devices(self) -> tuple[str, ...]:
        """Device of each op of ``LAYER_OPS``."""
        state = dict(zip(WEIGHTED_OPS, self.ops))
        return tuple(score_device(self.kv) if op == SCORE else
                     (HOST if state[op] == HOST else ACCELERATOR) for op in LAYER_OPS)

    def homes(self) -> tuple[str, ...]:
        """Weight home of each op of ``WEIGHTED_OPS``."""
        return self.ops


@dataclass(frozen=True)
class PatternCost:
    """What one layer of a pattern costs: seconds per decode step, its prefill over a run per
    decode step (``whole_run_costs``; 0 where not priced), and bytes."""

    pattern: Pattern
    seconds: float
    resident: int  # accelerator bytes: resident weights + KV
    segment: int  # largest staged segment, bytes
    host: int  # host bytes: host and streamed weights + KV
    uses_accelerator: bool
    switches: int  # device changes along the layer's ops, into the next layer included
    disk_segment: int = 0  # largest segment's disk-homed weights, bytes (read double-buffered)
    prefill: float = 0.0  # the run's prefill steps per decode step x the marginal prefill step


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


def layer_plan(spec: ModelSpec, patterns: list[Pattern], head: str, name: str
               ) -> ExecutionPlan:
    """The plan of layers laid out with ``patterns`` (one per layer) and HEAD's state."""
    placement = Placement(HOST, tuple(p.devices() for p in patterns),
                          HOST if head == HOST else ACCELERATOR)
    weights = WeightHomes(HOST, tuple(p.homes() for p in patterns), head)
    return ExecutionPlan(placement, placement, weights, tuple(p.kv for p in patterns), name)


def layer_patterns(disk: bool = False) -> list[Pattern]:
    """Every layer pattern: KV on the accelerator or the host, each weighted op host, resident
    or streamed. With ``disk``, every pattern that streams weights has a twin streaming them
    from disk instead of host memory (FlexGen's weights on disk: read into host memory, then
    copied on), and every host-KV pattern a twin with its KV cache on disk."""
    patterns = [Pattern(kv, ops) for kv in (ACCELERATOR, HOST)
                for ops in itertools.product(OP_STATES, repeat=len(WEIGHTED_OPS))]
    if disk:
        patterns += [Pattern(p.kv, tuple(DISK if s == STREAMED else s for s in p.ops))
                     for p in patterns if STREAMED in p.ops]
        patterns += [Pattern(DISK, p.ops) for p in patterns if p.kv == HOST]
    return patterns


def marginal_seconds(spec: ModelSpec, profile: HardwareProfile, pattern: Pattern, phase: str,
                     batch: int, tokens: int, slots: int, context: int, micro_batches: int
                     ) -> float:
    """Seconds one more layer of ``pattern`` adds to a step of ``phase`` in a stack of such
    layers: the simulated step of three minus that of two, at least 0. HEAD is resident on
    the accelerator, so that a host HEAD's work for one micro-batch cannot hide the layers'
    work for the next (with HEAD on the host, a resident OPT-30B layer priced at 5.6 ms of
    decode at 4 x 16 rows on the H100 preset where a 48-layer stack takes 22.9 ms per layer).
    Three minus two, not two minus one: the first layer's copy and the last layer's work
    overlap the step's ends, so a one-layer step is no steady state (OPT-30B, 4 x 16 rows, A10G
    preset: a layer with its KV cache on the accelerator and MLP2 on the host priced at
    122 ms by two minus one, 165 ms by three minus two and per layer of an eight-layer stack;
    over every seventh pattern, on five rows of the standard grid, two minus one was more
    than 2 % off the eight-layer stack's per-layer time for 2-24 % of them, by up to 81 %;
    three minus two for at most 3 %). Arguments as ``simulator.predict``'s."""
    def step(n: int) -> float:
        shapes = spec.replace(n_layers=n)
        return predict(layer_plan(shapes, [pattern] * n, RESIDENT, "p"), shapes, profile, phase,
                       batch, tokens, slots, context, micro_batches).seconds

    return max(step(3) - step(2), 0.0)


def offloaded_prefill(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with every weighted op of prefill on the accelerator (host-homed weights
    staged in) and HEAD there too; SCORE stays where its KV cache lives."""
    rows = tuple(tuple(score_device(kv) if op == SCORE else ACCELERATOR for op in LAYER_OPS)
                 for kv in plan.kv)
    return ExecutionPlan(Placement(HOST, rows, ACCELERATOR), plan.decode, plan.weights,
                         plan.kv, plan.name)


@functools.lru_cache(maxsize=16)
def price_patterns(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                   context: int, disk: bool = False) -> tuple[PatternCost, ...]:
    """Simulated marginal decode time and bytes of one layer of every pattern of
    ``layer_patterns(disk)`` (cached: the budget does not enter, so planning at many budgets
    prices once)."""
    two = spec.replace(n_layers=2)
    kv_layer = kv_bytes(spec, workload.rows, workload.cache_slots)
    kv_read = kv_bytes(spec, workload.batch, workload.cache_slots)
    weights = {op: spec.op_weight_bytes(op) for op in WEIGHTED_OPS}
    host_weights = {op: spec.op_weight_bytes(op, weight_dtype(spec, HOST))
                    for op in WEIGHTED_OPS}
    costs = []
    for p in layer_patterns(disk):
        seconds = marginal_seconds(spec, profile, p, "decode", workload.batch, 1,
                                   workload.cache_slots, context, workload.micro_batches)
        resident = sum(weights[op] for op, s in zip(WEIGHTED_OPS, p.ops) if s == RESIDENT)
        host = sum(host_weights[op] if s == HOST else weights[op]  # host ops: float32
                   for op, s in zip(WEIGHTED_OPS, p.ops) if s not in (RESIDENT, DISK))
        pair = layer_plan(two, [p, p], HOST, "p")
        segments = split_segments(pair, "decode")
        staged = [staged_bytes(spec, s) for s in segments]
        on_disk = [disk_bytes(pair, spec, s) for s in segments]
        costs.append(PatternCost(
            p, seconds, resident + (kv_layer if p.kv == ACCELERATOR else 0),
            max(staged), host + (kv_layer if p.kv == HOST else 0),
            ACCELERATOR in p.devices(), _switches(p.devices()),
            max(on_disk) + (kv_read if p.kv == DISK else 0)))
    return tuple(costs)


def prefill_point(workload: Workload, chunk: int) -> tuple[float, int, int]:
    """Where the whole-run objective prices prefill in chunks of ``chunk`` tokens: (prefill
    steps of the run over its decode steps (``Workload.decode_steps``), tokens of a step,
    cache slots in use at a typical step). Steps: ceil(P / chunk) per group of prefill rows
    (``run_seconds``'s groups); slots: the prompt half done, the chunk included."""
    P = workload.prompt_tokens
    steps = _groups(workload) * len(prefill_chunks(P, chunk))
    return (steps / max(workload.decode_steps, 1), min(chunk, P),
            min(P, (P + chunk + 1) // 2))


def _groups(workload: Workload) -> float:
    """Prefill row groups of a run (each takes every chunk in turn): its rows over those of
    one prefill step."""
    return (workload.batch * workload.micro_batches
            / (workload.prefill_rows * workload.prefill_micro_batches))


@functools.lru_cache(maxsize=16)
def decode_front(spec: ModelSpec, profile: HardwareProfile, workload: Workload, disk: bool
                 ) -> tuple[PatternCost, ...]:
    """The patterns no other beats in decode time and every byte count (``prune`` of
    ``price_patterns`` at the decode context; cached)."""
    return tuple(prune(price_patterns(spec, profile, workload, workload.decode_context, disk)))


@functools.lru_cache(maxsize=64)
def whole_run_costs(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                    chunk: int, disk: bool = False) -> tuple[PatternCost, ...]:
    """The patterns of ``decode_front``, each with its prefill over a run per decode step
    (``prefill``, seconds): its marginal prefill step at ``chunk`` tokens and mid-prompt
    context, placed as in decode, times the run's prefill steps per decode step
    (``prefill_point``).
    A pattern another beats in decode time and every byte count is priced no further:
    prefill makes it better only where it runs more on the accelerator, which costs bytes.
    Cached: planning at many budgets prices once."""
    share, tokens, context = prefill_point(workload, chunk)
    return tuple(dataclasses.replace(c, prefill=share * marginal_seconds(
        spec, profile, c.pattern, "prefill", workload.prefill_rows, tokens,
        workload.cache_slots, context, workload.prefill_micro_batches))
        for c in decode_front(spec, profile, workload, disk))


def _switches(devices: tuple[str, ...]) -> int:
    return sum(a != b for a, b in zip(devices, devices[1:] + devices[:1]))


def prune(costs: tuple[PatternCost, ...]) -> list[PatternCost]:
    """Drop patterns that another is at least as good as on every count (and better on one):
    time (decode step plus any priced prefill) and bytes."""
    m = np.array([[c.seconds + c.prefill, c.resident, c.segment, c.host, c.uses_accelerator,
                   c.switches, c.disk_segment] for c in costs], dtype=float)
    keep = []
    for i in range(len(costs)):
        no_worse = (m <= m[i]).all(axis=1)
        better = (m < m[i]).any(axis=1)
        if not (no_worse & better).any():
            keep.append(costs[i])
    return keep


def head_seconds(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                 chunk: int | None = None) -> dict[str, float]:
    """Seconds of HEAD in each state after a host layer (a one-layer simulated run, the same
    layer whatever the state) in a decode step; with ``chunk``, over a whole run per decode
    step as ``whole_run_costs`` prices a layer: plus the run's prefill steps at ``chunk``
    tokens per decode step (``prefill_point``)."""
    one = spec.replace(n_layers=1)
    host_layer = Pattern(HOST, (HOST,) * len(WEIGHTED_OPS))

    def run(head: str, phase: str, rows: int, tokens: int, context: int, micro: int) -> float:
        return predict(layer_plan(one, [host_layer], head, "h"), one, profile, phase, rows,
                       tokens, workload.cache_slots, context, micro).seconds

    decode = {state: run(state, "decode", workload.batch, 1, workload.decode_context,
                         workload.micro_batches) for state in OP_STATES}
    if chunk is None:
        return decode
    share, tokens, context = prefill_point(workload, chunk)
    return {state: decode[state] + share * run(state, "prefill", workload.prefill_rows, tokens,
                                               context, workload.prefill_micro_batches)
            for state in OP_STATES}


@dataclass
class _Model:
    """The CP-SAT model over pattern counts and its key expressions."""

    model: cp_model.CpModel
    n: list
    head: dict
    accelerator_bytes: object
    seconds: object
    switches: object


def _build(spec: ModelSpec, costs: list[PatternCost], heads: dict[str, float], act: int,
           capacity: int | None, host_capacity: int | None) -> _Model:
    L = spec.n_layers
    head_bytes = spec.op_weight_bytes("HEAD")
    model = cp_model.CpModel()
    n = [model.NewIntVar(0, L, f"n{i}") for i in range(len(costs))]
    used = [model.NewBoolVar(f"used{i}") for i in range(len(costs))]
    head = {s: model.NewBoolVar(f"head_{s}") for s in OP_STATES}
    model.AddExactlyOne(head.values())
    model.Add(sum(n) == L)
    for ni, ui in zip(n, used):
        model.Add(ni <= L * ui)
        model.Add(ni >= 1).OnlyEnforceIf(ui)
    biggest = max([c.segment for c in costs] + [head_bytes])
    seg = model.NewIntVar(0, biggest, "largest_staged_segment")
    staging = model.NewIntVar(0, 2 * biggest, "staging")
    any_acc = model.NewBoolVar("uses_accelerator")
    for c, u in zip(costs, used):
        if c.segment:
            model.Add(seg >= c.segment).OnlyEnforceIf(u)
        if c.uses_accelerator:
            model.AddImplication(u, any_acc)
    model.AddImplication(head[RESIDENT], any_acc)
    model.AddImplication(head[STREAMED], any_acc)
    model.Add(staging >= 2 * seg)
    model.Add(staging >= seg + head_bytes).OnlyEnforceIf(head[STREAMED])
    acc_bytes = (sum(c.resident * ni for c, ni in zip(costs, n)) + head_bytes * head[RESIDENT]
                 + staging + act * any_acc)
    if capacity is not None:
        model.Add(acc_bytes <= capacity)
    if host_capacity is not None:
        reads = model.NewIntVar(0, max(c.disk_segment for c in costs), "largest_disk_segment")
        for c, u in zip(costs, used):
            if c.disk_segment:
                model.Add(reads >= c.disk_segment).OnlyEnforceIf(u)
        model.Add(sum(c.host * ni for c, ni in zip(costs, n)) + spec.op_weight_bytes("EMBED")
                  + head_bytes * (1 - head[RESIDENT]) + 2 * reads <= host_capacity)
    seconds = _step_units(costs, heads, n, head)
    switches = sum(c.switches * ni for c, ni in zip(costs, n))
    return _Model(model, n, head, acc_bytes, seconds, switches)


def _units(seconds: float) -> int:
    return round(seconds / TIME_UNIT)


def _step_units(costs: list[PatternCost], heads: dict[str, float], n: list, head: dict):
    """The objective in TIME_UNITs: per-pattern seconds (decode step plus any priced prefill)
    times layer counts, plus the head's; ``n`` and ``head`` are CP-SAT variables (a linear
    expression) or their values."""
    return (sum(_units(c.seconds + c.prefill) * ni for c, ni in zip(costs, n))
            + sum(_units(heads[s]) * head[s] for s in OP_STATES))


def _solver(time_limit_s: float, seed: int) -> cp_model.CpSolver:
    """One CP-SAT worker with a seed, stopped by its deterministic time (a count of work, not
    wall-clock seconds): the same model gives the same plan however loaded the machine is
    (a wall-clock limit ended a solve UNKNOWN when the standard grid ran beside other work)."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    return solver


def plan_cpsat(spec: ModelSpec, profile: HardwareProfile, devices: Devices, workload: Workload,
               time_limit_s: float = 5.0, seed: int = 0, tolerance: float | None = None
               ) -> PlannerResult:
    """The plan with the shortest predicted run (prefill, then decode steps: ``run_seconds``)
    of those found by two objectives, under the memory budgets, with the largest prefill
    chunk under which it fits (``policies.fit_prefill_chunk``).

    The CP-SAT model sets aside a step's activations (``memory.activation_reserve``) at a
    prefill chunk, first ``MIN_CHUNK`` tokens. Decode-only objective first (the decode step):
    when the plan found leaves the prompt in several chunks and prefill is more than
    ``PREFILL_SHARE`` of its predicted run (every chunk of a streamed plan streams the weights
    again), it is solved again reserving the next larger chunk of ``policies.CHUNKS`` while
    the run gets shorter (FlexGen's OPT-30B setting on the T4: the decode-optimal plan keeps 5
    layers' KV on the GPU, leaving room for 32-token chunks only, 412 s of prefill instead of
    157). If prefill is still more than ``PREFILL_SHARE`` of the best run (and not every
    layer is resident with its KV cache on the accelerator), the whole-run objective
    (``solve``'s ``whole_run``: a decode step plus the run's prefill per decode step) is
    solved at each chunk up to the prompt, smallest first, until one does not fit or its run
    is no shorter than the previous chunk's. Llama-2-70B at 16 x 512 + 32 on a T4: host
    MLP1s, best for decode, multiply 512-row products on the host in prefill (0.52 tokens/s
    simulated, 1.42 with the whole-run plan). Every candidate is sized exactly and priced by
    ``run_seconds``; the shortest run is kept, so the second objective never makes a plan
    worse. Last, EMBED moves to the accelerator where that fits and is predicted faster
    (``embed_on_accelerator``). Arguments and errors as ``solve``.
    """
    from hx.planner.policies import CHUNKS, fits

    chunks = sorted({c or workload.prompt_tokens for c in CHUNKS
                     if (c or workload.prompt_tokens) <= workload.prompt_tokens})

    def attempt(chunk: int, whole_run: bool):
        result = plan_with_reserve(spec, profile, devices, workload, chunk, time_limit_s,
                                   seed, tolerance, whole_run)
        return result, run_seconds(result.plan, spec, profile, workload)

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
            run_seconds(gathered, spec, profile, workload)[1] < best_s:
        best.plan = gathered
    return best


def embed_on_accelerator(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with EMBED's table resident and its gather on the accelerator in both phases.

    The pattern model leaves EMBED on the host (a table of V x E weights a plan short of
    memory should not hold): each step then gathers rows there and copies them over, behind
    the other step inputs. ``plan_cpsat`` takes this plan instead where the table fits beside
    its plan and the run is predicted shorter (Llama-3-8B on the H100 preset, batch 1: 0.42 ms
    of a 9.8 ms decode step, a 1.05 GB table)."""
    phases = {phase: dataclasses.replace(plan.phase(phase), embed=ACCELERATOR)
              for phase in ("prefill", "decode")}
    return dataclasses.replace(plan, weights=dataclasses.replace(plan.weights, embed=RESIDENT),
                               **phases)


def run_seconds(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                workload: Workload) -> tuple[float, float]:
    """(prefill, prefill + decode) predicted seconds of a run of ``workload``: the prompt in
    the plan's chunks (every row's: with spare rows, in join groups of ``spare_rows``), then
    ``workload.decode_steps`` decode steps at the decode context."""
    P, S = workload.prompt_tokens, workload.cache_slots
    prefill = _groups(workload) * predict_prefill(plan, spec, profile, workload.prefill_rows,
                                                  P, S, workload.prefill_micro_batches)
    decode = predict(plan, spec, profile, "decode", workload.batch, 1, S,
                     workload.decode_context, workload.micro_batches).seconds
    return prefill, prefill + workload.decode_steps * decode


def plan_with_reserve(spec: ModelSpec, profile: HardwareProfile, devices: Devices,
                      workload: Workload, chunk: int, time_limit_s: float, seed: int,
                      tolerance: float | None, whole_run: bool = False) -> PlannerResult:
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
    that solve's objective and status) is taken if ``run_seconds`` predicts a shorter run.
    Should a plan exceed the accelerator or the host budget (the host's read buffers of
    disk-homed data are only sized there), the model is solved again with that budget lowered
    by the shortfall (at most ``REPLANS`` times), so the returned plan always fits."""
    result = _fitted(spec, profile, devices, devices, workload, chunk, time_limit_s, seed,
                     tolerance, whole_run, MIN_CHUNK)
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
                          tolerance, whole_run, chunk)
    except HxError:
        return result
    runs = [run_seconds(r.plan, spec, profile, workload)[1] for r in (result, roomier)]
    return roomier if runs[1] < runs[0] else result


def _fitted(spec: ModelSpec, profile: HardwareProfile, devices: Devices, budget: Devices,
            workload: Workload, chunk: int, time_limit_s: float, seed: int,
            tolerance: float | None, whole_run: bool, smallest: int) -> PlannerResult:
    """``solve`` under ``budget``, lowered by any shortfall until the plan fits ``devices`` in
    prefill chunks of ``smallest`` tokens or more (``plan_with_reserve``)."""
    from hx.planner.policies import fit_prefill_chunk

    for attempt in range(REPLANS + 1):
        result = solve(spec, profile, budget, workload, time_limit_s, seed, tolerance, chunk,
                       whole_run)
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
          prefill_chunk: int = MIN_CHUNK, whole_run: bool = False) -> PlannerResult:
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
        ``head_seconds``; ``PlannerResult``'s seconds are these); else the decode step.
      tolerance: among plans predicted within this fraction of the optimum, the one with the
        fewest device switches is taken (a second solve): differences smaller than the cost
        model's error are noise, and every switch is a launch and a transfer whose cost varies
        most from run to run. None: the profile's ``model_error``; 0 turns it off. This solve
        starts from the optimum as a hint and gets what is left of the time limit; if it finds
        nothing, the optimum is taken. ``status`` is the first solve's (optimality of
        ``objective_s``).
    Raises:
      HxError: no plan fits the budgets; the message gives the smallest accelerator budget
        that admits one.
    """
    # the disk tier only when host memory cannot hold the weights and the KV cache: its twins
    # nearly triple the patterns, and CP-SAT's search time with them
    host_need = spec.weight_bytes + spec.n_layers * kv_bytes(spec, workload.rows,
                                                             workload.cache_slots)
    disk = bool(profile.disk_read_bandwidth) and devices.host.capacity is not None and \
        host_need > devices.host.capacity
    if whole_run:
        costs = prune(whole_run_costs(spec, profile, workload, prefill_chunk, disk))
        heads = head_seconds(spec, profile, workload, prefill_chunk)
    else:
        costs, heads = list(decode_front(spec, profile, workload, disk)), \
            head_seconds(spec, profile, workload)
    act = activation_reserve(spec, workload, min(workload.prompt_tokens, prefill_chunk))
    built = _build(spec, costs, heads, act, devices.accelerator.capacity, devices.host.capacity)
    built.model.Minimize(built.seconds)
    solver = _solver(time_limit_s, seed)
    start = time.perf_counter()
    status = solver.Solve(built.model)
    solve_s = time.perf_counter() - start
    if status == cp_model.UNKNOWN:
        raise HxError(f"CP-SAT found no plan within its time limit of {time_limit_s:g} "
                      f"deterministic s "
                      f"({len(costs)} layer patterns, status UNKNOWN: neither a plan nor a proof "
                      f"that none fits); give it more time (--time-limit)")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise HxError(_infeasible(spec, costs, heads, act, devices, workload, time_limit_s,
                                  seed, solver.StatusName(status)))
    objective = solver.ObjectiveValue() * TIME_UNIT
    bound = solver.BestObjectiveBound() * TIME_UNIT
    status_name = solver.StatusName(status)
    variables = built.n + list(built.head.values())
    values = [solver.Value(v) for v in variables]
    model_bytes = solver.Value(built.accelerator_bytes)
    tolerance = profile.model_error if tolerance is None else tolerance
    if tolerance > 0:  # best effort: the optimum found above stands if this finds nothing
        built.model.Add(built.seconds <= round(solver.ObjectiveValue() * (1 + tolerance)))
        built.model.Minimize(built.switches)
        for v, x in zip(variables, values):
            built.model.AddHint(v, x)
        simpler = _solver(max(time_limit_s - solver.deterministic_time, 0.1), seed)
        if simpler.Solve(built.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            values = [simpler.Value(v) for v in variables]
            model_bytes = simpler.Value(built.accelerator_bytes)
        solve_s = time.perf_counter() - start
    n, head = values[:len(built.n)], dict(zip(built.head, values[len(built.n):]))
    chosen = _step_units(costs, heads, n, head) * TIME_UNIT
    counts = {c.pattern: ni for c, ni in zip(costs, n) if ni}
    head_state = next(s for s in OP_STATES if head[s])
    # host-heaviest patterns first: accelerator layers last, as llama.cpp offloads them
    order = sorted(counts, key=lambda p: (p.devices().count(ACCELERATOR), p.kv == ACCELERATOR))
    layers = [p for p in order for _ in range(counts[p])]
    plan = choose_prefill(layer_plan(spec, layers, head_state, "cpsat"), spec, profile, devices,
                          workload)
    return PlannerResult(plan, status_name, objective, bound,
                         (objective - bound) / objective if objective else 0.0, solve_s,
                         len(costs), counts, chosen, tolerance, model_bytes)


def _infeasible(spec, costs, heads, act, devices, workload, time_limit_s, seed, status) -> str:
    """Why no plan fits: the smallest accelerator budget that admits one (solved for)."""
    built = _build(spec, costs, heads, act, None, devices.host.capacity)
    built.model.Minimize(built.accelerator_bytes)
    solver = _solver(time_limit_s, seed)
    if solver.Solve(built.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return (f"no plan fits the host memory budget of {devices.host.capacity} bytes, "
                f"whatever the accelerator budget (CP-SAT: {status})")
    return (f"no plan fits the accelerator memory budget of {devices.accelerator.capacity} "
            f"bytes at batch {workload.batch}, {workload.cache_slots} KV slots; the minimum "
            f"feasible budget is {round(solver.ObjectiveValue())} bytes")


def choose_prefill(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                   devices: Devices, workload: Workload) -> ExecutionPlan:
    """Keep the decode placement for prefill, or run every weighted op of prefill on the
    accelerator (host weights staged in) when that is predicted faster and still fits; each
    priced over all its prefill chunks at the largest chunk it fits with. The offloaded plan
    is sized (XLA compiles) only if its prefill in one step, the fewest weight copies, is
    predicted faster."""
    from hx.planner.policies import fit_prefill_chunk

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
