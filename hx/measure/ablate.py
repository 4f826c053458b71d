"""Ablation: every policy's plan at several budgets and batches, predicted and measured.

For each (budget, batch) every policy builds its plan (or reports that none fits); each
feasible plan gets a simulator prediction of its decode step and is measured on the executor:
a batch's step after a prefill (``time_decode``), a block of N micro-batches' step (throughput
mode's zig-zag schedule, ``Executor.run_block``) over zero-filled caches at the same positions
(``time_block_decode``: a decode step does the same work whatever the cache holds);
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
from hx.measure.bench import DecodeProbe, time_block_decode, time_decode
from hx.measure.calibrate import predicted_decode, probe_slots
from hx.memory import estimate
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.profile import HardwareProfile
from hx.workload import Workload

TOLERANCE = 0.15  # a prediction within 15 % of its measured step counts as validated


@dataclass
class AblationRow:
    """One policy at one budget and batch (``micro_batches`` > 1: a block of that many
    micro-batches of ``batch`` rows). Times in seconds; None where it does not fit."""

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
    micro_batches: int = 1

    @property
    def tokens_per_s(self) -> float | None:
        return self.batch * self.micro_batches / self.measured_s if self.measured_s else None

    @property
    def within(self) -> bool | None:
        """Whether the prediction is within ``TOLERANCE`` of the measured step (None: not
        measured)."""
        if not self.measured_s:
            return None
        return abs(self.predicted_s / self.measured_s - 1) <= TOLERANCE


def same_placement(a: ExecutionPlan, b: ExecutionPlan) -> bool:
    """Equal plans but for their names."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")


def ablate(spec: ModelSpec, params: dict[str, Any], profile: HardwareProfile,
           fractions: tuple[float, ...], batches: tuple[tuple[int, int], ...],
           policy_names: tuple[str, ...] = policies.COMPARED, runs: int = 3,
           steps: int = 12, context: int = 128,
           log: Callable[[str], None] = lambda m: None) -> list[AblationRow]:
    """Rows for every (fraction of weight bytes as accelerator budget, batch, policy);
    ``batches``: (rows, micro-batches) of each step, (16, 1) a batch of 16, (8, 2) a block of
    two micro-batches of 8."""
    rows = []
    slots = probe_slots(context, steps)
    # the first budgeted ``discover`` sizes XLA's pool on a GPU: let it be the largest budget
    discover(accelerator_memory=int(spec.weight_bytes * max(fractions)))
    for fraction in fractions:
        budget = int(spec.weight_bytes * fraction)
        devices = discover(accelerator_memory=budget)
        for batch, micro in batches:
            workload = Workload(batch, context, slots, micro)
            group: list = []  # (row, whether it shares a twin's runs, plan)
            for name in policy_names:
                try:
                    plan = policies.build(name, spec, devices, workload, profile=profile)
                except HxError as e:
                    rows.append(AblationRow(name, fraction, budget, batch, None, None, None,
                                            None, [], str(e), micro_batches=micro))
                    continue
                predicted = predicted_decode(plan, spec, profile, batch, steps, context, micro)
                twin = next((r for r, _, p in group if same_placement(p, plan)), None)
                row = AblationRow(name, fraction, budget, batch, plan.name,
                                  estimate(plan, spec, workload).accelerator, predicted, None,
                                  twin.runs_s if twin else [], plan_json=plan.to_json(),
                                  micro_batches=micro)
                group.append((row, twin is not None, plan))
                rows.append(row)
            for r in range(runs):
                for row, shared, plan in group:
                    if shared:
                        continue  # same plan as an earlier policy: shares its runs
                    executor = Executor(spec, params, plan, devices)
                    probe = DecodeProbe(spec, batch, context, seed=r)
                    times = (time_decode(executor, probe, slots, steps) if micro == 1 else
                             time_block_decode(executor, probe, slots, steps, micro))
                    row.runs_s.append(statistics.median(times))
                    if executor.accountant.peak > budget:
                        raise RuntimeError(f"{row.policy} passed its budget")  # a bug
                    del executor
                    gc.collect()  # its accelerator buffers go before the next one's arrive
            for row, shared, _ in group:
                row.measured_s = statistics.median(row.runs_s)
                if not shared:
                    log(f"{fraction:.0%} batch {shape(row)} {row.policy}: predicted "
                        f"{row.predicted_s * 1e3:.1f} ms, measured "
                        f"{row.measured_s * 1e3:.1f} ms")
    return rows


def shape(row: AblationRow) -> str:
    """A row's step as ``hx ablate --batches`` writes it: ``16``, or ``2x8`` for a block of
    two micro-batches of 8 rows."""
    return f"{row.micro_batches}x{row.batch}" if row.micro_batches > 1 else str(row.batch)


def rows_to_json(rows: list[AblationRow], spec: ModelSpec, profile: HardwareProfile) -> dict:
    """The JSON document ``hx ablate`` writes."""
    return {"model": spec.name, "weights": spec.weight_format, "embedding": spec.embedding_format,
            "kv": spec.kv_format, "profile": profile.name, "emulated": profile.emulated,
            "tolerance": TOLERANCE,
            "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s, "within": r.within}
                     for r in rows]}
