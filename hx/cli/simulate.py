"""``hx simulate`` (one plan on a hardware preset) and the simulated grid of ``hx ablate
--hardware`` (``planner.grid``)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from hx.cli.common import (DtypeOption, KvOption, ModelOption, ProfileOption, WeightsOption, app,
                           note, print_table)
from hx.devices import format_bytes
from hx.errors import HxError
from hx.models.loader import load_spec, resolve_dtype
from hx.planner import hardware as presets
from hx.planner import policies
from hx.planner.grid import (MOE, MULTI_GPU, STANDARD, Grid, GridRow, Scenario, markdown_table, point,
                             run_grid, simulate_run, throughput_table, write_csv, write_json)
from hx.planner.hardware import LOCAL, hardware_profile, tensor_parallel_profile
from hx.planner.layouts import layouts
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import as_timeline

_SCENARIO = re.compile(r"(?:(\d+)x)?(\d+):(\d+)\+(\d+)")


def parse_scenarios(text: str) -> tuple[Scenario, ...]:
    """``1:512+128,4x16:512+32``: [N x]B : prompt + new tokens, comma-separated.

    Raises:
      HxError: an entry not of that form.
    """
    scenarios = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = _SCENARIO.fullmatch(part)
        if match is None:
            raise HxError(f"bad workload {part!r}: write [Nx]B:PROMPT+NEW, e.g. 16:512+32 or "
                          "4x16:512+32")
        n, b, p, g = match.groups()
        scenarios.append(Scenario(part, int(b), int(p), int(g), int(n or 1)))
    return tuple(scenarios)


def _dtype(dtype: str) -> str:
    """``auto`` is float16 here: what GPU offloading runs (FlexGen's setting), priced on a
    preset's 16-bit matmul rates."""
    return "float16" if dtype in (None, "auto") else resolve_dtype(dtype)


def _profile(hardware: Optional[str], profile: Optional[Path]) -> HardwareProfile:
    if profile is not None:
        return HardwareProfile.load(str(profile))
    return hardware_profile(hardware or "local")


@app.command("simulate")
def simulate_command(
    model: Optional[str] = ModelOption,
    dtype: str = DtypeOption,
    weights: str = WeightsOption,
    kv: str = KvOption,
    hardware: Optional[str] = typer.Option(
        None, help="Hardware preset: t4, a10g, a100-40gb, l4, h100-80gb, 4xa10g (four A10Gs: "
                   "see --tp), or local (the profile `hx profile` saved); default local."),
    profile: Optional[Path] = ProfileOption,
    policy: str = typer.Option("cpsat", help=f"One of {', '.join(policies.POLICIES)}, or for "
                                             f"an MoE model {', '.join(policies.MOE_POLICIES)}."),
    budget: float = typer.Option(1.0, help="Accelerator budget, a fraction of its memory."),
    workload: str = typer.Option("1:512+32", help="[Nx]B:PROMPT+NEW, e.g. 4x16:512+32."),
    time_limit: float = typer.Option(
        5.0, help="CP-SAT time limit per solve, deterministic seconds (see hx plan)."),
    trace: Optional[Path] = typer.Option(None, help="Write the simulated decode step as a "
                                                    "Chrome/Perfetto trace (as --trace of "
                                                    "hx generate)."),
    tp: int = typer.Option(1, help="Tensor parallelism over this many GPUs of a several-GPU "
                                   "machine (--hardware 4xa10g): the plan is one GPU's shard, "
                                   "its budget one GPU's memory."),
    allreduce_bandwidth: Optional[float] = typer.Option(
        None, help="With --tp: the all-reduce bus bandwidth in bytes/s in place of the "
                   "machine's (a what-if, e.g. 19.5e9: 4xa10g's PCIe link rather than its "
                   "measured 3.10 GB/s)."),
) -> None:
    """Plan a model on a machine and simulate a run: tokens/s, TTFT, TPOT, the run's seconds,
    utilisation."""
    spec = load_spec(model, _dtype(dtype), weights, kv).shard(tp)
    if tp > 1 and profile is not None:
        raise HxError("--tp prices a several-GPU preset (--hardware 4xa10g); a measured "
                      "profile (--profile) is one accelerator's")
    if allreduce_bandwidth is not None and (tp == 1 or allreduce_bandwidth <= 0):
        raise HxError("--allreduce-bandwidth prices --tp's all-reduces: give --tp 2 or more "
                      "and a bandwidth above 0 bytes/s")
    hw = tensor_parallel_profile(hardware or LOCAL, tp) if tp > 1 else _profile(hardware,
                                                                                 profile)
    if allreduce_bandwidth is not None:
        hw = dataclasses.replace(hw, name=f"{hw.name}, all-reduce at "
                                          f"{allreduce_bandwidth / 1e9:g} GB/s",
                                 allreduce_bandwidth=allreduce_bandwidth)
    if hw.accelerator_memory is None:
        raise HxError(f"profile {hw.name!r} gives no accelerator memory: pass --hardware")
    (scenario,) = parse_scenarios(workload)
    budget_bytes = int(budget * hw.accelerator_memory)
    machine = LOCAL if profile is not None else hardware or LOCAL
    plan, need = policies.plan_on(policy, spec, machine, hw, budget_bytes, scenario.workload(),
                                  time_limit)
    run = simulate_run(plan, spec, hw, scenario)
    table = Table(title=f"{spec.name} on {hw.name} (simulated), {scenario.name}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in (
            ("plan", plan.name), ("budget", format_bytes(budget_bytes)),
            ("accelerator bytes", f"{format_bytes(need.accelerator)} ({need.breakdown()})"),
            ("host bytes", format_bytes(need.host)),
            ("tokens/s", f"{run.tokens_per_s:.2f}"), ("TTFT s", f"{run.ttft_s:.3f}"),
            ("TPOT ms", f"{run.tpot_s * 1e3:.1f}"), ("run s", f"{run.total_s:.3f}"),
            *((f"{r} busy", f"{u:.0%}") for r, u in sorted(run.utilisation.items()))):
        table.add_row(name, value)
    print_table(table)
    if trace is not None:
        as_timeline(run.decode).to_chrome(str(trace))
        note(f"simulated decode step -> {trace}")


def ablate_grid(grid: Grid, json_out: Optional[Path], csv_out: Optional[Path],
                markdown_out: Optional[Path], figures: Optional[Path],
                time_limit: float, workers: int = 1) -> list[GridRow]:
    """Run ``grid`` (``hx ablate --hardware``), print its table and write what was asked."""
    steps: dict[tuple, dict] = {}

    def keep(row, plan, run):
        steps.setdefault(point(row), {})[row.policy] = run.decode

    note(f"simulating {grid.size} runs ({len(grid.models)} models x {len(grid.hardware)} "
         f"machines x {len(grid.budgets)} budgets x {len(grid.scenarios)} workloads x "
         f"{len(grid.policies)} policies x {len(grid.formats)} formats)")
    rows = run_grid(grid, time_limit, log=note, keep=keep, workers=workers)
    table = Table(title="simulated generation throughput (tokens/s)")
    head, cells = throughput_table(rows, grid.policies, "*%s*")
    for col in head:
        table.add_column(col, justify="right")
    for line in cells:
        table.add_row(*line)
    print_table(table)
    if json_out:
        write_json(rows, grid, str(json_out))
    if csv_out:
        write_csv(rows, str(csv_out))
    if markdown_out:
        markdown_out.write_text(markdown_table(rows, grid.policies) + "\n")
    if figures:
        write_figures(rows, grid, steps, figures)
        note(f"figures -> {figures}")
    return rows


def write_figures(rows: list[GridRow], grid: Grid, steps: dict[tuple, dict], figures: Path
                  ) -> None:
    """Per (model, formats, machine, scenario): throughput against the budget (several
    budgets) and the Gantt chart of one decode step at the largest budget (``steps``: each
    grid point's decode predictions by policy)."""
    from hx.planner.figures import decode_gantt, throughput_vs_memory

    figures.mkdir(parents=True, exist_ok=True)
    top = max(grid.budgets)
    for model, weights, kv in dict.fromkeys((r.model, r.weights, r.kv) for r in rows):
        held = "" if (weights, kv) == ("dense", "dense") else f" {weights} kv-{kv}"
        for machine in grid.hardware:
            for scenario in grid.scenarios:
                part = [r for r in rows if (r.model, r.weights, r.kv, r.hardware, r.scenario)
                        == (model, weights, kv, machine, scenario.name)]
                name = f"{model}{held}"
                stem = re.sub(r"[^a-z0-9]+", "-", f"{name} {machine} {scenario.name}"
                              .lower()).strip("-")
                if len(grid.budgets) > 1:
                    throughput_vs_memory(part, str(figures / f"throughput-{stem}.png"),
                                         f"{name} on {machine}, {scenario.name}")
                decode = steps.get((model, machine, top, scenario.name, weights, kv))
                if decode:
                    decode_gantt(decode, str(figures / f"gantt-{stem}.png"),
                                 f"{name} on {machine} at {top:.0%}, {scenario.name}: "
                                 "one decode step")


def grid_from_options(models: Optional[str], hardware: str, policy_names: str, budgets: str,
                      workloads: str, dtype: str, weights: str = "dense", kv: str = "dense"
                      ) -> Grid:
    """The grid ``hx ablate --hardware`` asks for (``weights`` and ``kv``: comma-separated
    formats, two axes; ``auto`` is ``dense`` on a preset; ``MACHINE:all``: ``every_layout``);
    ``--hardware standard`` is ``STANDARD`` in those formats, ``--hardware multi-gpu``
    ``MULTI_GPU``, ``--hardware moe`` ``MOE``, each in its own formats unless ``weights`` or
    ``kv`` name others than dense."""
    axes = dict(weights=tuple("dense" if w == "auto" else w for w in _names(weights)),
                kv=_names(kv))
    named = {"standard": STANDARD, "multi-gpu": MULTI_GPU, "moe": MOE}
    if hardware.strip() in named:
        given = {k: v for k, v in axes.items() if v != ("dense",)}
        return dataclasses.replace(named[hardware.strip()], **given)
    return Grid(models=_names(models or "llama2-7b"), hardware=every_layout(_names(hardware)),
                policies=_names(policy_names),
                budgets=tuple(float(b) for b in budgets.split(",")),
                scenarios=parse_scenarios(workloads), dtype=_dtype(dtype), **axes)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list's names, stripped; empty ones dropped."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def every_layout(names: tuple[str, ...]) -> tuple[str, ...]:
    """Grid hardware entries with each ``MACHINE:all`` in place of every tp x pp layout of 1
    to all of the machine's GPUs (``layouts.layouts``): ``4xa10g:all`` is ``4xa10g``,
    ``4xa10g:pp2``, ``4xa10g:tp2``, ... ``4xa10g:tp4``.

    Raises:
      HxError: ``:all`` after a one-GPU preset.
    """
    entries: list[str] = []
    for name in names:
        machine_name, _, layout = name.partition(":")
        if layout.strip().lower() != "all":
            entries.append(name)
            continue
        several = presets.machine(machine_name)
        if several is None:
            raise HxError(f"{name!r}: ':all' takes a several-GPU machine "
                          f"({', '.join(presets.MACHINES)})")
        for gpus in range(1, several.gpus + 1):
            for each in layouts(gpus):
                shape = "x".join(f"{axis}{n}" for axis, n in (("tp", each.tp), ("pp", each.pp))
                                 if n > 1)
                entries.append(f"{machine_name}:{shape}" if shape else machine_name)
    return tuple(entries)
