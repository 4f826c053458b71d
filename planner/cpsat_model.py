"""The CP-SAT model over layer-pattern counts (``planner.patterns`` prices the patterns).

CP-SAT picks how many layers take each pattern and the states of EMBED and HEAD, as one of
the pairs ``patterns.end_costs`` prices (a full per-op interval model does not scale: no
solution in 60 s for 30 x 7 ops: docs/measurements/log.md, "Planner"). Minimised: the predicted
decode step (Σ n_p decode_p + the pair's) or, where prefill is a large part of the run, the run
per decode step (Σ n_p (decode_p + prefill_p · prefill steps / decode steps) + the pair's),
subject to:

  Σ n_p = L;  accelerator: Σ n_p (resident_p + kv_p) + the pair's resident + staging
  + activations (HEAD's XLA temporaries only where HEAD is on the accelerator) ≤ capacity;
  host: Σ n_p host_p + the pair's host + 2 x largest disk read ≤ host capacity (the disk
  reads of a layer segment, of EMBED or of HEAD: double-buffered);
  staging ≥ the largest two consecutive staged segments of each used pattern (two
  consecutive segments are staged at once), ≥ l + f across pattern boundaries, ≥ EMBED's
  staged bytes + f and ≥ l + HEAD's, and ≥ both theirs when no layer streams (they are then
  consecutive); f and l ≥ the first and the last staged segment of a layer of every used
  pattern.

A second solve then takes, among plans predicted within a tolerance of that optimum, the one
with the fewest device switches (``solve_counts``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from hx.devices import HOST, Devices
from hx.errors import HxError
from hx.models.spec import ModelSpec
from hx.planner.patterns import EndCost, Pattern, PatternCost
from hx.workload import Workload

TIME_UNIT = 1e-7  # seconds per integer unit of the objective (0.1 µs)


@dataclass
class _Model:
    """The CP-SAT model over pattern counts and its key expressions."""

    model: cp_model.CpModel
    n: list
    ends: list
    accelerator_bytes: object
    seconds: object
    switches: object


def _build(spec: ModelSpec, costs: list[PatternCost], ends: list[EndCost], act: int,
           head_act: int, capacity: int | None, host_capacity: int | None) -> _Model:
    L = spec.n_layers
    model = cp_model.CpModel()
    n = [model.NewIntVar(0, L, f"n{i}") for i in range(len(costs))]
    used = [model.NewBoolVar(f"used{i}") for i in range(len(costs))]
    end = [model.NewBoolVar(f"ends_{e.embed}_{e.head}") for e in ends]
    model.AddExactlyOne(end)
    model.Add(sum(n) == L)
    for ni, ui in zip(n, used):
        model.Add(ni <= L * ui)
        model.Add(ni >= 1).OnlyEnforceIf(ui)
    biggest = max(max(c.first_staged, c.last_staged) for c in costs)
    staged_end = max(e.staged_embed + e.staged_head for e in ends)
    first = model.NewIntVar(0, biggest, "largest_first_staged_segment")
    last = model.NewIntVar(0, biggest, "largest_last_staged_segment")
    staging = model.NewIntVar(0, 2 * biggest + staged_end, "staging")
    any_acc = model.NewBoolVar("uses_accelerator")
    layers_stream = model.NewBoolVar("layers_stream")
    streaming = [u for c, u in zip(costs, used) if c.staged_pair]
    if streaming:
        model.AddBoolOr(streaming).OnlyEnforceIf(layers_stream)
    else:
        model.Add(layers_stream == 0)
    for c, u in zip(costs, used):
        if c.staged_pair:
            model.Add(first >= c.first_staged).OnlyEnforceIf(u)
            model.Add(last >= c.last_staged).OnlyEnforceIf(u)
            model.Add(staging >= c.staged_pair).OnlyEnforceIf(u)
        if c.uses_accelerator:
            model.AddImplication(u, any_acc)
    model.Add(staging >= first + last)
    for e, x in zip(ends, end):
        if e.uses_accelerator:
            model.AddImplication(x, any_acc)
        if e.staged_embed or e.staged_head:
            model.Add(staging >= e.staged_embed + first).OnlyEnforceIf(x)
            model.Add(staging >= last + e.staged_head).OnlyEnforceIf(x)
            model.Add(staging >= e.staged_embed + e.staged_head).OnlyEnforceIf(
                [x, layers_stream.Not()])
    acc_bytes = (sum(c.resident * ni for c, ni in zip(costs, n))
                 + sum((e.resident + (head_act if e.head != HOST else 0)) * x
                       for e, x in zip(ends, end)) + staging + act * any_acc)
    if capacity is not None:
        model.Add(acc_bytes <= capacity)
    if host_capacity is not None:
        reads = model.NewIntVar(0, max([c.disk_segment for c in costs] + [e.read for e in ends]),
                                "largest_disk_read")
        for c, u in zip(costs, used):
            if c.disk_segment:
                model.Add(reads >= c.disk_segment).OnlyEnforceIf(u)
        for e, x in zip(ends, end):
            if e.read:
                model.Add(reads >= e.read).OnlyEnforceIf(x)
        model.Add(sum(c.host * ni for c, ni in zip(costs, n))
                  + sum(e.host * x for e, x in zip(ends, end)) + 2 * reads <= host_capacity)
    seconds = _step_units(costs, ends, n, end)
    switches = sum(c.switches * ni for c, ni in zip(costs, n))
    return _Model(model, n, end, acc_bytes, seconds, switches)


def _units(seconds: float) -> int:
    return round(seconds / TIME_UNIT)


def _step_units(costs: list[PatternCost], ends: list[EndCost], n: list, end: list):
    """The objective in TIME_UNITs: per-pattern seconds (decode step plus any priced prefill)
    times layer counts, plus the EMBED and HEAD pair's; ``n`` and ``end`` (one per pair) are
    CP-SAT variables (a linear expression) or their values."""
    return (sum(_units(c.seconds + c.prefill) * ni for c, ni in zip(costs, n))
            + sum(_units(e.seconds) * x for e, x in zip(ends, end)))


def _solver(time_limit_s: float, seed: int) -> cp_model.CpSolver:
    """One CP-SAT worker with a seed, stopped by its deterministic time (a count of work, not
    wall-clock seconds): the same model gives the same plan however loaded the machine is
    (a wall-clock limit ended a solve UNKNOWN when the standard grid ran beside other work)."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    return solver


@dataclass(frozen=True)
class Hint:
    """A solution to start a later search from (warm start): layers per pattern and the
    EMBED/HEAD pair (``patterns.end_states``)."""

    counts: dict[Pattern, int]
    embed: str
    head: str


@dataclass
class Solution:
    """CP-SAT's answer: layers per pattern, EMBED's and HEAD's states, and how it got there.

    Attributes:
      counts: layers per pattern (patterns with none left out).
      embed / head: their states (``patterns.end_states``).
      status: ``OPTIMAL`` or ``FEASIBLE`` (time limit hit: best found, not proven optimal).
      objective_s / bound_s: the objective of the optimum and CP-SAT's best bound, seconds.
      chosen_s: the objective of the counts taken (the fewest switches within tolerance).
      solve_s: wall time of both solves; model_bytes: accelerator bytes the model counts for
        the counts taken (activation reserve included).
    """

    counts: dict[Pattern, int]
    embed: str
    head: str
    status: str
    objective_s: float
    bound_s: float
    chosen_s: float
    solve_s: float
    model_bytes: int

    @property
    def hint(self) -> Hint:
        """This solution as a warm start (``solve_counts``' ``hint``)."""
        return Hint(self.counts, self.embed, self.head)


def solve_counts(spec: ModelSpec, costs: list[PatternCost], ends: list[EndCost], act: int,
                 head_act: int, devices: Devices, workload: Workload, time_limit_s: float,
                 seed: int, tolerance: float, hint: Hint | None = None) -> Solution:
    """Minimise the objective over pattern counts under the budgets of ``devices`` with
    ``act`` bytes of activations reserved where anything runs on the accelerator and
    ``head_act`` more where HEAD does (``memory.head_reserve``); then, with ``tolerance`` > 0, the device switches
    among counts within that fraction of the optimum (best effort: the optimum stands if the
    second solve finds nothing). ``hint``: a solution to start the search from (warm start,
    e.g. the previous context's while re-planning: ``_hint``); the rest of the arguments as
    ``cpsat.solve``'s.

    Raises:
      HxError: CP-SAT found nothing in its time limit, or no counts fit (the message gives
        the smallest accelerator budget that admits a plan).
    """
    built = _build(spec, costs, ends, act, head_act, devices.accelerator.capacity,
                   devices.host.capacity)
    built.model.Minimize(built.seconds)
    if hint is not None:
        _hint(built, costs, ends, hint)
    solver = _solver(time_limit_s, seed)
    start = time.perf_counter()
    status = solver.Solve(built.model)
    if status == cp_model.UNKNOWN:
        raise HxError(f"CP-SAT found no plan within its time limit of {time_limit_s:g} "
                      f"deterministic s ({len(costs)} layer patterns, status UNKNOWN: neither a "
                      f"plan nor a proof that none fits); give it more time (--time-limit)")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise HxError(_infeasible(spec, costs, ends, act, head_act, devices, workload,
                                  time_limit_s, seed, solver.StatusName(status)))
    variables = built.n + built.ends
    values = [solver.Value(v) for v in variables]
    model_bytes = solver.Value(built.accelerator_bytes)
    if tolerance > 0:
        values, model_bytes = _fewest_switches(built, solver, variables, values, model_bytes,
                                               tolerance, time_limit_s, seed)
    n, end = values[:len(built.n)], values[len(built.n):]
    pair = next(e for e, x in zip(ends, end) if x)
    return Solution({c.pattern: ni for c, ni in zip(costs, n) if ni}, pair.embed, pair.head,
                    solver.StatusName(status), solver.ObjectiveValue() * TIME_UNIT,
                    solver.BestObjectiveBound() * TIME_UNIT,
                    _step_units(costs, ends, n, end) * TIME_UNIT, time.perf_counter() - start,
                    model_bytes)


def _hint(built: _Model, costs: list[PatternCost], ends: list[EndCost], hint: Hint) -> None:
    """Hint ``built`` with ``hint``'s counts and EMBED/HEAD pair (0 layers of every pattern
    it does not use). A hint is where the search starts: one that does not fit the budgets
    or that names patterns this model does not offer only starts it elsewhere."""
    for c, n in zip(costs, built.n):
        built.model.AddHint(n, hint.counts.get(c.pattern, 0))
    for e, x in zip(ends, built.ends):
        built.model.AddHint(x, int((e.embed, e.head) == (hint.embed, hint.head)))


def _fewest_switches(built: _Model, solver: cp_model.CpSolver, variables: list, values: list,
                     model_bytes: int, tolerance: float, time_limit_s: float, seed: int
                     ) -> tuple[list, int]:
    """The counts with the fewest device switches among those within ``tolerance`` of the
    optimum ``solver`` found (hinted with it, in what is left of the time limit), with their
    accelerator bytes; the optimum's own when this solve finds nothing."""
    built.model.Add(built.seconds <= round(solver.ObjectiveValue() * (1 + tolerance)))
    built.model.Minimize(built.switches)
    for v, x in zip(variables, values):
        built.model.AddHint(v, x)
    simpler = _solver(max(time_limit_s - solver.deterministic_time, 0.1), seed)
    if simpler.Solve(built.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return [simpler.Value(v) for v in variables], simpler.Value(built.accelerator_bytes)
    return values, model_bytes


def _infeasible(spec, costs, ends, act, head_act, devices, workload, time_limit_s, seed,
                status) -> str:
    """Why no plan fits: the smallest accelerator budget that admits one (solved for)."""
    built = _build(spec, costs, ends, act, head_act, None, devices.host.capacity)
    built.model.Minimize(built.accelerator_bytes)
    solver = _solver(time_limit_s, seed)
    if solver.Solve(built.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return (f"no plan fits the host memory budget of {devices.host.capacity} bytes, "
                f"whatever the accelerator budget (CP-SAT: {status})")
    host = devices.host.capacity
    beside = ("" if host is None else
              f" beside the host memory budget of {host} bytes ({host / 2**30:.1f} GiB: what "
              "the accelerator does not hold must fit there, or on a disk tier of the profile)")
    return (f"no plan fits the accelerator memory budget of {devices.accelerator.capacity} "
            f"bytes at batch {workload.batch}, {workload.cache_slots} KV slots; the minimum "
            f"feasible budget is {round(solver.ObjectiveValue())} bytes{beside}")
