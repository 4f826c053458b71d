"""The CP-SAT model over layer-pattern counts (``planner.patterns`` prices the patterns).

CP-SAT picks how many layers take each pattern and HEAD's state (a full per-op interval model
does not scale: no solution in 60 s for 30 x 7 ops: docs/measurements/log.md, "Planner").
Minimised: the predicted decode step (Σ n_p decode_p + HEAD) or, where prefill is a large part
of the run, the run per decode step (Σ n_p (decode_p + prefill_p · prefill steps / decode
steps) + HEAD's), subject to:

  Σ n_p = L;  accelerator: Σ n_p (resident_p + kv_p) + HEAD + staging + activations ≤ capacity;
  host: Σ n_p host_p + EMBED + HEAD + 2 x largest disk segment ≤ host capacity;
  staging ≥ 2 m and ≥ m + HEAD if HEAD is streamed, m ≥ largest staged segment of every used
  pattern (two consecutive segments are staged at once; a conservative bound across pattern
  boundaries).

A second solve then takes, among plans predicted within a tolerance of that optimum, the one
with the fewest device switches (``solve_counts``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from hx.devices import Devices
from hx.errors import HxError
from hx.models.spec import ModelSpec
from hx.plan import RESIDENT, STREAMED
from hx.planner.patterns import OP_STATES, Pattern, PatternCost
from hx.workload import Workload

TIME_UNIT = 1e-7  # seconds per integer unit of the objective (0.1 µs)


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


@dataclass
class Solution:
    """CP-SAT's answer: layers per pattern, HEAD's state, and how it got there.

    Attributes:
      counts: layers per pattern (patterns with none left out); head: HEAD's ``OP_STATES``.
      status: ``OPTIMAL`` or ``FEASIBLE`` (time limit hit: best found, not proven optimal).
      objective_s / bound_s: the objective of the optimum and CP-SAT's best bound, seconds.
      chosen_s: the objective of the counts taken (the fewest switches within tolerance).
      solve_s: wall time of both solves; model_bytes: accelerator bytes the model counts for
        the counts taken (activation reserve included).
    """

    counts: dict[Pattern, int]
    head: str
    status: str
    objective_s: float
    bound_s: float
    chosen_s: float
    solve_s: float
    model_bytes: int


def solve_counts(spec: ModelSpec, costs: list[PatternCost], heads: dict[str, float], act: int,
                 devices: Devices, workload: Workload, time_limit_s: float, seed: int,
                 tolerance: float) -> Solution:
    """Minimise the objective over pattern counts under the budgets of ``devices`` with
    ``act`` bytes of activations reserved; then, with ``tolerance`` > 0, the device switches
    among counts within that fraction of the optimum (best effort: the optimum stands if the
    second solve finds nothing). Arguments as ``cpsat.solve``'s.

    Raises:
      HxError: CP-SAT found nothing in its time limit, or no counts fit (the message gives
        the smallest accelerator budget that admits a plan).
    """
    built = _build(spec, costs, heads, act, devices.accelerator.capacity, devices.host.capacity)
    built.model.Minimize(built.seconds)
    solver = _solver(time_limit_s, seed)
    start = time.perf_counter()
    status = solver.Solve(built.model)
    if status == cp_model.UNKNOWN:
        raise HxError(f"CP-SAT found no plan within its time limit of {time_limit_s:g} "
                      f"deterministic s ({len(costs)} layer patterns, status UNKNOWN: neither a "
                      f"plan nor a proof that none fits); give it more time (--time-limit)")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise HxError(_infeasible(spec, costs, heads, act, devices, workload, time_limit_s,
                                  seed, solver.StatusName(status)))
    variables = built.n + list(built.head.values())
    values = [solver.Value(v) for v in variables]
    model_bytes = solver.Value(built.accelerator_bytes)
    if tolerance > 0:
        values, model_bytes = _fewest_switches(built, solver, variables, values, model_bytes,
                                               tolerance, time_limit_s, seed)
    n, head = values[:len(built.n)], dict(zip(built.head, values[len(built.n):]))
    return Solution({c.pattern: ni for c, ni in zip(costs, n) if ni},
                    next(s for s in OP_STATES if head[s]), solver.StatusName(status),
                    solver.ObjectiveValue() * TIME_UNIT, solver.BestObjectiveBound() * TIME_UNIT,
                    _step_units(costs, heads, n, head) * TIME_UNIT, time.perf_counter() - start,
                    model_bytes)


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


def _infeasible(spec, costs, heads, act, devices, workload, time_limit_s, seed, status) -> str:
    """Why no plan fits: the smallest accelerator budget that admits one (solved for)."""
    built = _build(spec, costs, heads, act, None, devices.host.capacity)
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
