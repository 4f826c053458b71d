"""Simulated ablation grid: models x hardware x placement policies x budgets x workloads, each
run priced by ``planner.simulator`` on a hardware preset (docs/architecture.md, "Planner"), at
scales this machine
cannot run (``hx.measure.ablate`` measures plans on this machine instead).

A run of a workload (B rows per micro-batch, N micro-batches, P prompt tokens, G new tokens)
under a plan is its prefill -- one block step per prefill chunk -- then G - 1 decode steps of
the block, priced at the mid-generation context P + G/2 (FlexGen's generation throughput,
Sheng et al. 2023 §6: generated tokens over prefill plus decode time):

    tokens/s = B·N·G / (t_prefill + (G - 1)·t_decode),   TTFT = t_prefill,   TPOT = t_decode

Utilisation is each resource's busy time over the decode step's makespan.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from hx.errors import HxError
from hx.models.formats import DENSE
from hx.models.loader import load_spec
from hx.models.spec import ModelSpec, preset
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.experts import ExpertActivity, activity_named
from hx.planner.hardware import hardware_profile
from hx.planner.layouts import Layout, price, split_hardware
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import RunPrediction, predict_run
from hx.workload import CACHE_BUCKET, Workload, round_up


@dataclass(frozen=True)
class Scenario:
    """A workload of the grid: ``micro_batches`` x ``batch`` rows, prompts of
    ``prompt_tokens``, ``new_tokens`` generated each."""

    name: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    micro_batches: int = 1

    def workload(self) -> Workload:
        """The planner's ``Workload``: KV slots for the prompt and every new token."""
        slots = round_up(self.prompt_tokens + self.new_tokens, CACHE_BUCKET)
        return Workload(self.batch, self.prompt_tokens, slots, self.micro_batches,
                        new_tokens=self.new_tokens)


@dataclass(frozen=True)
class Grid:
    """What to run: names of model presets (``models.spec.PRESETS``, ``NAME[:NL]``), hardware
    presets (``planner.hardware``), policies (``planner.policies``), accelerator budgets as
    fractions of the preset's accelerator memory, and scenarios; models run in ``dtype``, their
    matrices held in each of ``weights`` and their KV caches in each of ``kv``
    (``models.formats``: ``dense`` or a compressed format), two more axes; a Mixture of
    Experts' routed experts picked as ``expert_activity`` says (``planner.experts.
    activity_named``: ``uniform``, ``zipf:S[:SEED]``), for its plans and their runs."""

    models: tuple[str, ...]
    hardware: tuple[str, ...]
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    scenarios: tuple[Scenario, ...]
    dtype: str = "float16"
    weights: tuple[str, ...] = (DENSE,)
    kv: tuple[str, ...] = (DENSE,)
    expert_activity: str = "uniform"

    @property
    def size(self) -> int:
        return (len(self.models) * len(self.hardware) * len(self.policies) * len(self.budgets)
                * len(self.scenarios) * len(self.weights) * len(self.kv))

    @property
    def formats(self) -> list[tuple[str, str]]:
        """(weight format, KV format) of every point of the two format axes."""
        return [(w, k) for w in self.weights for k in self.kv]


# 4 models x 3 machines x 6 policies x 4 workloads: the grid docs/ablation.md shows. The long
# generation is where a plan goes stale as the context grows (scripts/replan.py re-plans it).
STANDARD = Grid(
    models=("llama2-7b", "llama3-8b", "opt-30b", "llama2-70b"),
    hardware=("t4", "a10g", "h100-80gb"),
    policies=policies.COMPARED,
    budgets=(1.0,),
    scenarios=(Scenario("chat b1 512+128", 1, 512, 128),
               Scenario("batch b16 512+32", 16, 512, 32),
               Scenario("offline 4x16 512+32", 16, 512, 32, micro_batches=4),
               Scenario("long b1 256+4096", 1, 256, 4096)))


# The standard grid's several-GPU part: Llama-2-70B on 2 and 4 GPUs of two machines, each
# layout of them (``layouts.split_hardware``), each stage planned by CP-SAT, FlexGen's LP
# (FlexGen's layers per GPU as pipeline stages) or TwinPilots' load balancing; bfloat16 (a
# float16 model's host ops would hold float32 copies).
MULTI_GPU = Grid(
    models=("llama2-70b",),
    hardware=tuple(f"{m}:{layout}" for m in ("4xa10g", "8xh100")
                   for layout in ("tp2", "pp2", "tp4", "pp4", "tp2xpp2")),
    policies=("cpsat", "flexgen-lp", "min-max"),
    budgets=(1.0,),
    scenarios=(Scenario("chat b4 512+32", 4, 512, 32),
               Scenario("batch b16 512+32", 16, 512, 32)),
    dtype="bfloat16")


# The standard grid's Mixture-of-Experts part: Qwen3-30B-A3B and Mixtral-8x7B, 4-bit (GGUF's
# q4_0: the host multiplies its blocks by ggml), on the machines of issue 40's published
# figures, every routed expert placed by CP-SAT or by llama.cpp's, kTransformers' and
# Fiddler's rules (docs/ablation.md); float16, which the Turing GPUs have (no bfloat16).
MOE = Grid(
    models=("qwen3-30b-a3b", "mixtral-8x7b"),
    hardware=("rtx2080-i9-10900x", "quadro-rtx6000-48c", "rtx4090d-2x6454s"),
    policies=("cpsat", "cpu-moe", "n-cpu-moe", "ktransformers", "fiddler"),
    budgets=(1.0,),
    scenarios=(Scenario("chat b1 512+128", 1, 512, 128),
               Scenario("batch b16 512+32", 16, 512, 32)),
    weights=("q4_0",))


def simulate_run(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                 scenario: Scenario, activity: ExpertActivity | None = None) -> RunPrediction:
    """Prefill then decode of ``scenario`` under ``plan`` (``simulator.predict_run``: the
    module docstring's formula; an MoE model's experts picked as ``activity`` says)."""
    return predict_run(plan, spec, profile, scenario.workload(), activity)


@dataclass
class GridRow:
    """One (model, hardware, budget, scenario, policy, weight format, KV format); None fields
    where no plan fits (``error`` says why)."""

    model: str
    hardware: str
    budget_fraction: float
    budget_bytes: int
    scenario: str
    policy: str
    weights: str = DENSE
    kv: str = DENSE
    plan: str | None = None
    accelerator_bytes: int | None = None
    tokens_per_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    utilisation: dict[str, float] = field(default_factory=dict)
    error: str | None = None


Outcome = tuple[GridRow, ExecutionPlan | None, RunPrediction | None]  # a row, its plan, run


def run_grid(grid: Grid, time_limit_s: float = 2.0,
             log: Callable[[str], None] = lambda line: None,
             keep: Callable[[GridRow, ExecutionPlan, RunPrediction], None] | None = None,
             workers: int = 1) -> list[GridRow]:
    """Plan and simulate every point of ``grid``; ``keep`` sees each feasible row with its plan
    and prediction (e.g. for Gantt charts). CP-SAT gets ``time_limit_s`` deterministic seconds
    per solve (its best plan when the limit is hit; the same rows however loaded the machine).

    With ``workers`` > 1, the (model, hardware) parts run in that many processes (spawned),
    largest model first; rows come back in the grid's order, equal to a serial run's, and each
    part's log lines when it is done.

    Raises:
      HxError: an unknown model, hardware preset or policy name.
    """
    parts = [(model, machine) for model in grid.models for machine in grid.hardware]
    done: dict[tuple[str, str], list[Outcome]]
    if workers <= 1 or len(parts) == 1:
        done = {part: run_part(grid, *part, time_limit_s, log) for part in parts}
    else:
        largest_first = sorted(parts, key=lambda part: -preset(part[0]).weight_bytes)
        done = {}
        with ProcessPoolExecutor(min(workers, len(parts)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_logged_part, grid, *part, time_limit_s): part
                       for part in largest_first}
            for future in as_completed(futures):
                done[futures[future]], lines = future.result()
                for line in lines:
                    log(line)
    rows = []
    for part in parts:
        for row, plan, run in done[part]:
            rows.append(row)
            if keep is not None and plan is not None:
                keep(row, plan, run)
    return rows


def _logged_part(grid: Grid, model: str, machine: str, time_limit_s: float
                 ) -> tuple[list[Outcome], list[str]]:
    lines: list[str] = []
    return run_part(grid, model, machine, time_limit_s, lines.append), lines


def run_part(grid: Grid, model: str, machine: str, time_limit_s: float,
             log: Callable[[str], None]) -> list[Outcome]:
    """The rows of ``grid`` for one model on one machine, each with its plan and simulated run
    (None where no plan fits)."""
    out: list[Outcome] = []
    for weights, kv in grid.formats:
        spec = load_spec(model, grid.dtype, weights, kv)
        out += _run_formats(grid, spec, machine, time_limit_s, log)
    return out


def _run_formats(grid: Grid, spec: ModelSpec, machine: str, time_limit_s: float,
                 log: Callable[[str], None]) -> list[Outcome]:
    """``run_part``'s rows for ``spec``, a model in one (weight format, KV format); a
    ``machine`` with a layout (``layouts.split_hardware``) prices each policy's layout
    (``layouts.price``: each stage planned by the policy, the row's bytes the largest stage's
    on one GPU, its utilisation the slowest stage's)."""
    machine_name, tp, pp = split_hardware(machine)
    profile = hardware_profile(machine_name)
    formats = (spec.weight_format, spec.kv_format)
    named = "" if formats == (DENSE, DENSE) else f", weights {formats[0]}, KV {formats[1]}"
    activity = activity_named(spec, grid.expert_activity) if spec.moe else None
    out: list[Outcome] = []
    for fraction in grid.budgets:
        budget = int(fraction * profile.accelerator_memory)
        for scenario in grid.scenarios:
            for policy in grid.policies:
                row = GridRow(spec.name, machine, fraction, budget, scenario.name, policy,
                              *formats)
                try:
                    if (tp, pp) == (1, 1):
                        plan, need = policies.plan_on(policy, spec, machine, profile, budget,
                                                      scenario.workload(), time_limit_s,
                                                      activity)
                        run = simulate_run(plan, spec, profile, scenario, activity)
                        accelerator, whole = need.accelerator, run
                    else:
                        whole = price(spec, machine_name, Layout(tp, pp, policy),
                                      scenario.workload(), time_limit_s, budget=budget)
                        plan, run = None, whole.slowest.run
                        accelerator = max(s.need.accelerator for s in whole.stages)
                except HxError as e:
                    row.error = str(e).splitlines()[0]
                    out.append((row, None, None))
                    continue
                row.plan = policy if plan is None else plan.name
                row.accelerator_bytes = accelerator
                row.tokens_per_s, row.ttft_s, row.tpot_s = (
                    whole.tokens_per_s, whole.ttft_s, whole.tpot_s)
                row.utilisation = run.utilisation
                out.append((row, plan, run))
            best = max((r for r, _, _ in out[-len(grid.policies):] if r.tokens_per_s),
                       key=lambda r: r.tokens_per_s, default=None)
            log(f"{spec.name} on {machine} at {fraction:.0%}, {scenario.name}{named}: "
                + (f"best {best.policy} {best.tokens_per_s:.1f} tokens/s" if best
                   else "nothing fits"))
    return out


def write_csv(rows: Sequence[GridRow], path: str) -> None:
    """One line per row; utilisation as ``util_<resource>`` columns."""
    resources = sorted({r for row in rows for r in row.utilisation})
    names = [f.name for f in dataclasses.fields(GridRow) if f.name != "utilisation"]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(names + [f"util_{r}" for r in resources])
        for row in rows:
            out.writerow([getattr(row, n) for n in names]
                         + [row.utilisation.get(r, "") for r in resources])


def write_json(rows: Sequence[GridRow], grid: Grid, path: str) -> None:
    """The grid and its rows."""
    with open(path, "w") as f:
        json.dump({"grid": asdict(grid), "rows": [asdict(r) for r in rows]}, f, indent=1)


def point(row: GridRow) -> tuple:
    """The grid point a row is one policy's run of: (model, hardware, budget fraction,
    scenario, weight format, KV format)."""
    return row.model, row.hardware, row.budget_fraction, row.scenario, row.weights, row.kv


def throughput_table(rows: Sequence[GridRow], policies_order: Sequence[str], best: str
                     ) -> tuple[list[str], list[list[str]]]:
    """(header, cells): tokens/s per policy (columns) for each (model, hardware, budget,
    scenario[, weight format, KV format]) (rows; the formats when any row is not dense); the
    best of a row written as ``best`` % its text, ``-`` where the policy finds no plan that
    fits."""
    formats = any((r.weights, r.kv) != (DENSE, DENSE) for r in rows)
    head = ["model", "hardware", "budget", "workload", *(("weights", "kv") if formats else ()),
            *policies_order]
    table: list[list[str]] = []
    groups: dict[tuple, dict[str, GridRow]] = {}
    for r in rows:
        groups.setdefault(point(r), {})[r.policy] = r
    for (model, machine, fraction, scenario, *held), by_policy in groups.items():
        top = max((r.tokens_per_s or 0.0 for r in by_policy.values()), default=0.0)
        cells = []
        for p in policies_order:
            r = by_policy.get(p)
            if r is None or r.tokens_per_s is None:
                cells.append("-")
            else:
                text = f"{r.tokens_per_s:.2f}" if r.tokens_per_s < 10 else f"{r.tokens_per_s:.1f}"
                cells.append(best % text if r.tokens_per_s == top else text)
        table.append([model, machine, f"{fraction:.0%}", scenario, *(held if formats else ()),
                      *cells])
    return head, table


def markdown_table(rows: Sequence[GridRow], policies_order: Sequence[str]) -> str:
    """``throughput_table`` as markdown, the best of each row in bold."""
    head, table = throughput_table(rows, policies_order, "**%s**")
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cells) + " |" for cells in table])
