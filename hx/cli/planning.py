"""``hx profile``, ``hx plan`` and ``hx ablate``: measure the hardware, choose a plan, compare
policies."""

from __future__ import annotations

import dataclasses

import json
import os
import re
import time
from itertools import groupby
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from hx.cli.common import (AcceleratorMemoryOption, DtypeOption, ExpertActivityOption,
                           HostMemoryOption, KvOption, ModelOption, ProfileOption, WeightsOption,
                           app, describe_dtype, err, note, out, plan_by_name, print_table, say)
from hx.devices import Devices, discover, format_bytes
from hx.errors import HxError
from hx.memory import estimate
from hx.schedule import disk_bytes, staged_bytes
from hx.models.loader import load, load_spec, resolve_dtype
from hx.models.spec import LAYER_OPS, ModelSpec
from hx.plan import EXPERT_HOMES, ExecutionPlan
from hx.planner import policies
from hx.planner.experts import ExpertActivity, activity_named
from hx.planner.profile import DEFAULT_PATH, HardwareProfile, load_default
from hx.planner.simulator import predict, predict_prefill, predict_run
from hx.segments import split_segments
from hx.workload import Workload


def _batches(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def batch_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``1,16,2x8``: batches of B rows, or blocks NxB of N micro-batches of B rows (throughput
    mode's block), as (B, N) pairs.

    Raises:
      HxError: an entry not of that form, or a size of 0.
    """
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(?:(\d+)x)?(\d+)", part)
        rows, micro = (int(match[2]), int(match[1] or 1)) if match else (0, 0)
        if not rows or not micro:
            raise HxError(f"bad batch {part!r}: write B or NxB (N micro-batches of B rows), "
                          "e.g. 16 or 2x8")
        shapes.append((rows, micro))
    return tuple(shapes)


def profile_for(path: Optional[Path], devices: Devices, policy: Optional[str] = None
                ) -> Optional[HardwareProfile]:
    """``--profile FILE``, else the saved default; where neither exists and a profile is
    needed (``policy`` prices ops with one, or no policy is named), a quick one
    (``profiler.load_or_measure``: measured now in <= 20 s or earlier, kept apart from the
    default; one line on stderr says so)."""
    from hx.measure.profiler import for_policy, load_or_measure

    where = str(path) if path else None
    if policy is None:
        return load_or_measure(where, devices, say)
    return for_policy(policy, where, devices, say)


@app.command("profile")
def profile_command(
    model: Optional[str] = ModelOption,
    output: Path = typer.Option(Path(DEFAULT_PATH), "--output", "-o",
                                help="Where to write the profile JSON."),
    refine: bool = typer.Option(True, help="Fit the profile to the model's own decode steps."),
    batches: str = typer.Option("1,16", help="Batches the refinement observes."),
) -> None:
    """Measure the accelerator, host and link rates (and fit them to a model): about 3.5
    minutes on a 2-core VM; a line on stderr as each stage starts."""
    from hx.measure.calibrate import refine as refine_profile
    from hx.measure.profiler import excursion_line, measure

    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task("starting", total=None)
        start = time.perf_counter()

        def log(message: str) -> None:  # a line above the spinner, which shows the stage
            note(f"{time.perf_counter() - start:6.1f} s  {message}")
            progress.update(task, description=message)

        devices = discover()
        profile = measure(devices, log, launch=not refine)
        if refine:
            log(f"loading {model or 'the default model'} to fit the profile to its steps")
            loaded = load(model)
            profile = refine_profile(profile, loaded.spec, loaded.params, devices,
                                     _batches(batches), log)
    profile.save(str(output))
    table = Table(title=f"hardware profile: {profile.name}"
                        + (" (EMULATED accelerator)" if profile.emulated else ""))
    table.add_column("quantity")
    table.add_column("accelerator", justify="right")
    table.add_column("host", justify="right")
    acc, host = profile.accelerator, profile.host
    for name, curve in (("float32", "matmul"), ("bfloat16", "matmul_low")):
        table.add_row(f"matmul GFLOP/s ({name}) at M=1 / 16 / 256",
                      *(" / ".join(f"{r / 1e9:.0f}" for m, r in getattr(d, curve)
                                   if m in (1, 16, 256)) or "-" for d in (acc, host)))
    table.add_row("memory GB/s", f"{acc.memory_bandwidth / 1e9:.1f}",
                  f"{host.memory_bandwidth / 1e9:.1f}")
    table.add_row("compute scale (batch: factor)",
                  *(" ".join(f"{b}:{f:.2f}" for b, f in d.compute_scale) or "-"
                    for d in (acc, host)))
    table.add_row("launch overhead us (batch: us)",
                  *(" ".join(f"{b}:{t * 1e6:.0f}" for b, t in d.launch_overhead) or "-"
                    for d in (acc, host)))
    print_table(table)
    out.print(f"H2D (pinned_host -> device) {profile.h2d_bandwidth / 2**30:.1f} GiB/s + "
              f"{profile.h2d_latency * 1e6:.0f} us per staged copy, D2H (device -> host) "
              f"{profile.d2h_bandwidth / 2**30:.1f} GiB/s + {profile.d2h_latency * 1e6:.0f} us, "
              f"transfer latency {profile.transfer_latency * 1e6:.0f} us"
              f"{' (fitted)' if refine else ''}, contention {profile.contention:.2f} "
              f"(compute {profile.compute_contention:.2f}), sync overhead "
              f"{profile.sync_overhead * 1e6:.0f} us -> {output}", soft_wrap=True)
    out.print(excursion_line(profile), soft_wrap=True)


def _cell(plan: ExecutionPlan, layer: int, op: str) -> str:
    device = plan.decode.get(layer, op)
    home = plan.weights.get(layer, op)
    if op == "SCORE" or device == "host":
        return "host" if device == "host" else "acc"
    return f"acc:{home[:3]}"


def _experts_cell(plan: ExecutionPlan, layer: int) -> str:
    homes = plan.experts.of(layer)
    if not homes:
        return "MLP2's"
    return ", ".join(f"{homes.count(home)} {home}" for home in EXPERT_HOMES if home in homes)


def describe_plan(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile | None,
                  workload: Workload, activity: ExpertActivity | None = None) -> None:
    """Print a plan per group of identical layers, its memory and its predicted times (an MoE
    model's experts picked as ``activity`` says, default a random router's)."""
    table = Table(title=f"plan {plan.name}: decode placement (acc:res resident, acc:str "
                        f"streamed), KV home")
    table.add_column("layers")
    for op in LAYER_OPS:
        table.add_column(op)
    table.add_column("KV")
    if plan.experts.layers:  # routed experts placed one by one: how many at each home
        table.add_column("routed experts")
    rows = [tuple(_cell(plan, i, op) for op in LAYER_OPS) + (plan.kv[i],)
            + ((_experts_cell(plan, i),) if plan.experts.layers else ())
            for i in range(spec.n_layers)]
    start = 0
    for row, group in groupby(rows):
        count = len(list(group))
        table.add_row(f"{start}-{start + count - 1}", *row)
        start += count
    print_table(table)
    need = estimate(plan, spec, workload)
    chunking = ("whole prompt per step" if plan.prefill_chunk is None
                else f"in chunks of {plan.prefill_chunk} tokens")
    decode_segments = split_segments(plan, "decode")
    streamed = sum(staged_bytes(spec, s) for s in decode_segments)
    read = sum(disk_bytes(plan, spec, s) for s in decode_segments)
    out.print(f"EMBED on {plan.decode.embed} ({plan.weights.embed}), HEAD on {plan.decode.head} "
              f"({plan.weights.head}); prefill "
              f"{'as decode' if plan.prefill == plan.decode else 'with weighted ops offloaded'}, "
              f"{chunking}", soft_wrap=True)
    out.print(f"accelerator: {format_bytes(need.accelerator)} ({need.breakdown()} bytes); "
              f"host: {format_bytes(need.host)}; streamed per decode step: "
              f"{format_bytes(streamed)}"
              + (f", of which read from disk: {format_bytes(read)}" if read else ""),
              soft_wrap=True)
    if profile is not None:
        slots = workload.cache_slots
        decode = predict(plan, spec, profile, "decode", workload.batch, 1, slots,
                         workload.decode_context, activity=activity)
        prefill = predict_prefill(plan, spec, profile, workload.batch, workload.prompt_tokens,
                                  slots, activity=activity)
        busy = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(decode.busy.items()))
        run = predict_run(plan, spec, profile, workload, activity).total_s
        steps = workload.decode_steps
        out.print(f"predicted (the simulator, whole plan): decode step "
                  f"{decode.seconds * 1e3:.2f} ms ({workload.batch / decode.seconds:.1f} "
                  f"tokens/s; busy: {busy}); prefill {prefill * 1e3:.1f} ms; run (prefill, then "
                  f"{steps} decode steps) {run:.2f} s = {run / steps * 1e3:.2f} ms per decode "
                  "step "
                  + escape(f"[{profile.name}{', EMULATED' if profile.emulated else ''}]"),
                  soft_wrap=True)


@app.command("plan")
def plan_command(
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="A GGUF file, HF folder or preset name "
                                             "(smollm2-135m, llama2-70b); only shapes are read."),
    dtype: str = DtypeOption,
    weights: str = WeightsOption,
    kv: str = KvOption,
    accelerator_memory: Optional[str] = AcceleratorMemoryOption,
    host_memory: Optional[str] = HostMemoryOption,
    policy: str = typer.Option("cpsat", help=f"One of {', '.join(policies.POLICIES)}, "
                                             "layer-split:N, or for an MoE model "
                                             f"{', '.join(policies.MOE_POLICIES)}."),
    profile: Optional[Path] = ProfileOption,
    expert_activity: Optional[str] = ExpertActivityOption,
    batch: int = typer.Option(1, help="Batch the plan is sized and priced for."),
    prompt_tokens: int = typer.Option(128, help="Prompt tokens (padded) of the workload."),
    max_new_tokens: int = typer.Option(128, help="New tokens per prompt of the workload."),
    time_limit: float = typer.Option(
        5.0, help="CP-SAT time limit in deterministic seconds (its measure of work, the same "
                  "however loaded the machine is; one is about 2 s of one core)."),
    seed: int = typer.Option(0, help="CP-SAT random seed."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the plan JSON."),
) -> None:
    """Choose a plan under the memory budget and show it with its predicted time."""
    from hx.planner.cpsat import plan_cpsat

    devices = discover(accelerator_memory, host_memory)
    spec = load_spec(model, resolve_dtype(dtype, devices), weights, kv)
    workload = Workload.for_prompts(batch, prompt_tokens, max_new_tokens, spec)
    hardware = profile_for(profile, devices, policy)
    if host_memory is None and profile is not None and hardware.host_memory:
        # plan for the machine a --profile file describes (default: this one's budget)
        devices = dataclasses.replace(devices, host=dataclasses.replace(
            devices.host, capacity=hardware.host_memory))
    activity = activity_named(spec, expert_activity)
    if policy == "cpsat" and spec.moe is None:
        result = plan_cpsat(spec, hardware, devices, workload, time_limit, seed)
        plan = result.plan
        proven = "" if result.status == "OPTIMAL" else " (time limit: NOT proven optimal)"
        out.print(f"CP-SAT {result.status}{proven}: objective {result.objective_s * 1e3:.3f} ms "
                  f"= the planner's own price of the run per decode step (each layer's "
                  f"placement pattern priced alone and summed: a decode step, plus the run's "
                  f"prefill spread over its decode steps where prefill weighs), best bound "
                  f"{result.bound_s * 1e3:.3f} ms, gap {result.gap:.2%}; plan taken "
                  f"{result.chosen_s * 1e3:.3f} ms (fewest device switches within "
                  f"{result.tolerance:.1%}, the profile's model error); solved in "
                  f"{result.solve_s:.3f} s over {result.patterns} layer patterns. The "
                  f"simulator's prediction of the whole plan follows.", soft_wrap=True)
    else:
        plan = plan_by_name(policy, spec, devices, workload, hardware, activity)
    describe_plan(plan, spec, hardware, workload, activity)
    out.print(describe_dtype(spec.dtype, dtype, devices), soft_wrap=True)
    if output:
        plan.save(str(output))
        note(f"plan written to {output}")


@app.command("ablate")
def ablate_command(
    model: Optional[str] = ModelOption,
    dtype: str = DtypeOption,
    weights: str = typer.Option(
        "auto", "--weights", help="Weight format, as hx generate's --weights; with --hardware, "
                                  "a comma-separated list: an axis of the grid (auto: dense "
                                  "on a preset)."),
    kv: str = typer.Option("auto", "--kv", help="KV cache format, as hx generate's --kv; with "
                                                 "--hardware, a comma-separated list: an axis."),
    profile: Optional[Path] = ProfileOption,
    budgets: str = typer.Option("0.2,0.4,0.7", help="Accelerator budgets as fractions of the "
                                                    "model's weight bytes."),
    batches: str = typer.Option(
        "1,16", help="Batch sizes; measured, NxB is a block of N micro-batches of B rows "
                     "(throughput mode's schedule), e.g. 1,16,2x8,4x4."),
    policy_names: str = typer.Option(",".join(policies.COMPARED), "--policies",
                                     help="Policies to compare."),
    runs: int = typer.Option(3, help="Measurement rounds (median reported)."),
    steps: int = typer.Option(12, help="Decode steps per measurement (median)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the rows as JSON."),
    hardware: Optional[str] = typer.Option(
        None, help="Simulate instead of measuring: hardware presets (comma-separated: t4, "
                   "a10g, a100-40gb, l4, h100-80gb, rtx2080-i9-10900x, quadro-rtx6000-48c, "
                   "rtx4090d-2x6454s, local; a several-GPU machine with its "
                   "layout, e.g. 4xa10g:tp2xpp2, 8xh100:tp4, 4xa10g:pp4, or 4xa10g:all for "
                   "every layout of 1 to 4 GPUs), `standard` for the "
                   "standard grid of docs/ablation.md, `multi-gpu` for its several-GPU part, "
                   "or `moe` for its Mixture-of-Experts part. "
                   "-m then takes presets, comma-separated; --budgets are fractions of each "
                   "GPU's memory."),
    workloads: str = typer.Option("1:512+128,16:512+32,4x16:512+32",
                                  help="Simulated workloads, [Nx]B:PROMPT+NEW each."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Simulated: write CSV."),
    markdown_out: Optional[Path] = typer.Option(None, "--markdown",
                                                help="Simulated: write the markdown table."),
    figures: Optional[Path] = typer.Option(None, help="Simulated: write PNG figures here."),
    time_limit: float = typer.Option(
        2.0, help="Simulated: CP-SAT time limit per solve, deterministic seconds (hx plan)."),
    workers: int = typer.Option(
        os.cpu_count() or 1, help="Simulated: processes the (model, machine) parts run in "
                                  "(default: one per CPU core)."),
) -> None:
    """Every policy's plan at several budgets and batches: predicted vs measured decode step
    on this machine (and how many predictions are within tolerance), or (--hardware) simulated
    runs on hardware presets."""
    if hardware is not None:
        from hx.cli.simulate import ablate_grid, grid_from_options

        grid = grid_from_options(model, hardware, policy_names, budgets, workloads, dtype,
                                 weights, kv)
        ablate_grid(grid, json_out, csv_out, markdown_out, figures, time_limit, workers)
        return
    if "," in weights or "," in kv:
        raise HxError("a measured ablation runs one weight format and one KV format: lists of "
                      "--weights or --kv are axes of the simulated grid (--hardware)")
    shapes = batch_shapes(batches)
    # auto decides without starting the backends
    loaded = load(model, resolve_dtype(dtype), weights=weights, kv=kv)
    measure_policies(loaded, profile, tuple(float(x) for x in budgets.split(",")), shapes,
                     tuple(p.strip() for p in policy_names.split(",")), runs, steps, json_out)


def measure_policies(loaded, profile: Optional[Path], fractions: tuple[float, ...],
                     batches: tuple[tuple[int, int], ...], policy_names: tuple[str, ...],
                     runs: int, steps: int, json_out: Optional[Path]) -> None:
    """``hx ablate`` on this machine: each policy's plan of the ``loaded`` model at budgets
    ``fractions`` of its weight bytes and ``batches`` ((rows, micro-batches) pairs), predicted
    vs measured decode step (``hx.measure.ablate``); prints the table, how many predictions
    are within ``TOLERANCE``, and writes ``json_out``."""
    from hx.measure.ablate import TOLERANCE, ablate, rows_to_json, shape

    hardware = load_default(str(profile) if profile else None)
    if hardware is None:  # started at the largest budget, as ``ablate`` would (XLA's GPU pool)
        hardware = profile_for(profile, discover(int(loaded.spec.weight_bytes * max(fractions))))
    rows = ablate(loaded.spec, loaded.params, hardware, fractions, batches, policy_names, runs,
                  steps, log=note)
    table = Table(title=f"{loaded.spec.name} ({loaded.spec.weight_format} weights, "
                        f"{loaded.spec.kv_format} KV): decode step per policy (median of "
                        f"{runs} runs) "
                        + escape(f"[{hardware.name}{', EMULATED' if hardware.emulated else ''}]"))
    for col in ("budget", "batch / block", "policy", "plan", "acc MiB", "predicted ms",
                "measured ms", "pred/meas", "tok/s", "best"):
        table.add_column(col, justify="left" if col in ("policy", "plan") else "right")
    for (fraction, batch), group in groupby(rows, key=lambda r: (r.budget_fraction, shape(r))):
        group = list(group)
        fastest = min((r.measured_s for r in group if r.measured_s), default=None)
        for r in group:
            if r.measured_s is None:
                table.add_row(f"{fraction:.0%}", batch, r.policy, "does not fit",
                              *("-",) * 6)
                continue
            table.add_row(f"{fraction:.0%}", batch, r.policy, r.plan,
                          f"{r.accelerator_bytes / 2**20:.0f}", f"{r.predicted_s * 1e3:.1f}",
                          f"{r.measured_s * 1e3:.1f}", f"{r.predicted_s / r.measured_s:.2f}",
                          f"{r.tokens_per_s:.1f}", "*" if r.measured_s == fastest else "")
    print_table(table)
    measured = [r for r in rows if r.measured_s]
    out.print(f"{sum(r.within for r in measured)} of {len(measured)} predictions within "
              f"{TOLERANCE:.0%} of the measured step")
    if json_out:
        json_out.write_text(json.dumps(rows_to_json(rows, loaded.spec, hardware), indent=1))
