"""Ablation: every policy's plan at several budgets and batches, predicted and measured.

For each (budget, batch) every policy builds its plan (or reports that none fits); each
feasible plan gets a simulator prediction of its decode step and is measured on the executor:
``runs`` rounds, each round measuring every plan once (so slow spells of a shared machine hit
all policies alike), and the median over rounds of each round's median step time is reported.
Policies that produce the same plan share one measurement (their plans are equal, so is their
speed; measuring them apart would only rank the noise).

One executor lives at a time: each measurement builds the plan's executor (the compiled
programs are shared, so only the weights are placed again) and drops it before the next. The
budget is per run; on a GPU, executors of several policies alive at once would hold their
resident weights side by side in one memory pool and run out of it (seen on an H100 with
Llama-2-7B shapes in bfloat16), while the emulator, whose budgets are per executor, would not
notice.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

from hx.devices import discover
from hx.errors import HxError
from hx.executor import Executor
from hx.measure.bench import DecodeProbe, time_decode
from hx.measure.calibrate import predicted_decode, probe_slots
from hx.memory import estimate
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.profile import HardwareProfile
from hx.workload import Workload

@dataclass
class AblationRow:
    """One policy at one budget and batch. Times in seconds; None where it does not fit."""

    policy: str
    budget_fraction: float
    budget_bytes: int
    batch: int
    plan: str | None
    accelerator_bytes: int | None
    predicted_s: float | None
    measured_s: float | None
    runs_s: list[float]
    error: str | None = None
    plan_json: dict | None = None  # ``ExecutionPlan.to_json``: re-priced offline

    @property
    def tokens_per_s(self) -> float | None:
        return self.batch / self.measured_s if self.measured_s else None


def same_placement(a: ExecutionPlan, b: ExecutionPlan) -> bool:
    """Equal plans but for their names."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")


def ablate(spec: ModelSpec, params: dict[str, Any], profile: HardwareProfile,
           fractions: tuple[float, ...], batches: tuple[int, ...],
           policy_names: tuple[str, ...] = policies.COMPARED, runs: int = 3,
           steps: int = 12, context: int = 128,
           log: Callable[[str], None] = lambda m: None) -> list[AblationRow]:
    """Rows for every (fraction of weight bytes as accelerator budget, batch, policy)."""
    rows = []
    slots = probe_slots(context, steps)
    # the first budgeted ``discover`` sizes XLA's pool on a GPU: let it be the largest budget
    discover(accelerator_memory=int(spec.weight_bytes * max(fractions)))
    for fraction in fractions:
        budget = int(spec.weight_bytes * fraction)
        devices = discover(accelerator_memory=budget)
        for batch in batches:
            workload = Workload(batch, context, slots)
            group: list = []  # (row, whether it shares a twin's runs, plan)
            for name in policy_names:
                try:
                    plan = policies.build(name, spec, devices, workload, profile=profile)
                except HxError as e:
                    rows.append(AblationRow(name, fraction, budget, batch, None, None, None,
                                            None, [], str(e)))
                    continue
                predicted = predicted_decode(plan, spec, profile, batch, steps, context)
                twin = next((r for r, _, p in group if same_placement(p, plan)), None)
                row = AblationRow(name, fraction, budget, batch, plan.name,
                                  estimate(plan, spec, workload).accelerator, predicted, None,
                                  twin.runs_s if twin else [], plan_json=plan.to_json())
                group.append((row, twin is not None, plan))
                rows.append(row)
            for r in range(runs):
                for row, shared, plan in group:
                    if shared:
                        continue  # same plan as an earlier policy: shares its runs
                    executor = Executor(spec, params, plan, devices)
                    times = time_decode(executor, DecodeProbe(spec, batch, context, seed=r),
                                        slots, steps)
                    row.runs_s.append(statistics.median(times))
                    if executor.accountant.peak > budget:
                        raise RuntimeError(f"{row.policy} passed its budget")  # a bug
                    del executor
                    gc.collect()  # its accelerator buffers go before the next one's arrive
            for row, shared, _ in group:
                row.measured_s = statistics.median(row.runs_s)
                if not shared:
                    log(f"{fraction:.0%} batch {batch} {row.policy}: predicted "
                        f"{row.predicted_s * 1e3:.1f} ms, measured "
                        f"{row.measured_s * 1e3:.1f} ms")
    return rows


def rows_to_json(rows: list[AblationRow], spec: ModelSpec, profile: HardwareProfile) -> dict:
    """The JSON document ``hx ablate`` writes."""
    return {"model": spec.name, "weights": spec.weight_format, "embedding": spec.embedding_format,
            "kv": spec.kv_format, "profile": profile.name, "emulated": profile.emulated,
            "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]}
