"""``hx generate``: one prompt, or a JSONL file of prompts resumed where it stopped."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from hx.cli.common import (AcceleratorMemoryOption, DtypeOption, ExpertActivityOption,
                           HostMatmulOption, HostMemoryOption, KvOption, ModelOption,
                           ProfileOption, WeightsOption,
                           app, describe_dtype, err, note, out, print_table, resolve_plan, say)
from hx.devices import discover, format_bytes
from hx.errors import HxError
from hx.models.loader import load, resolve_dtype, resolve_kv
from hx.models.spec import EMBED, HEAD, LAYER_OPS
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.segments import split_segments
from hx.workload import Workload


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One prompt."),
    prompts: Optional[Path] = typer.Option(None, "--prompts",
                                           help="JSONL file of {\"id\", \"prompt\"} lines."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o",
        help="JSONL results file: with --prompts, one line per prompt, an existing file "
             "resumed; with --prompt, the result's line (the same keys, id \"prompt\"), "
             "replacing the file."),
    model: Optional[str] = ModelOption,
    dtype: str = DtypeOption,
    weights: str = WeightsOption,
    kv: str = KvOption,
    host_matmul: str = HostMatmulOption,
    max_new_tokens: int = typer.Option(128, help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="Sample from the k most likely tokens (0 = all)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    seed: int = typer.Option(0, help="Sampling seed."),
    chat: bool = typer.Option(False, "--chat", help="Wrap prompts in the model's chat template."),
    accelerator_memory: Optional[str] = AcceleratorMemoryOption,
    host_memory: Optional[str] = HostMemoryOption,
    policy: Optional[str] = typer.Option(
        None, help=f"Placement policy: {', '.join((*policies.POLICIES, *policies.MOE_POLICIES))}"
                   " (default auto)."),
    gpu_layers: Optional[int] = typer.Option(
        None, help="Layers on the accelerator for --policy layer-split (default: most that "
                   "fit)."),
    host_ops: str = typer.Option("", "--host-ops",
                                 help=f"Comma-separated ops to run on the host CPU, from "
                                      f"{','.join((EMBED,) + LAYER_OPS + (HEAD,))}."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Execution plan JSON file."),
    profile: Optional[Path] = ProfileOption,
    mode: str = typer.Option(
        "auto", help="latency: static batches of --batch-size prompts (default 1), the plan "
                     "chosen for them; throughput: iteration-level scheduling over a block of "
                     "micro-batches, block and plan chosen for the most tokens/s; auto: "
                     "throughput for --prompts unless --batch-size is given, latency for "
                     "--prompt."),
    batch_size: Optional[int] = typer.Option(
        None, help="Prompts per static batch in latency mode (with --prompts; default 1)."),
    micro_batch: Optional[int] = typer.Option(
        None, help="Rows per micro-batch in throughput mode (default: planned)."),
    micro_batches: Optional[int] = typer.Option(
        None, help="Micro-batches per block in throughput mode (default: planned)."),
    expert_activity: Optional[str] = ExpertActivityOption,
    replan_every: int = typer.Option(
        0, "--replan-every",
        help="With --prompt: re-plan every N decode steps as the context grows (CP-SAT per "
             "window of N steps at its middle context; the plan switches between steps where "
             "the predicted gain beats moving weights and KV caches); 0: one plan."),
    trace: Optional[Path] = typer.Option(None, "--trace",
                                         help="Write a Chrome/Perfetto trace of the run."),
    accelerators: int = typer.Option(
        1, "--devices", help="Accelerators to run on, tensor parallel over their mesh "
                             "(emulated: CPU devices); --accelerator-memory is each one's "
                             "budget, and plans are made for one accelerator's shard."),
    mesh: Optional[str] = typer.Option(
        None, "--mesh", help="tp=A,pp=B: A x B accelerators, the layers in B pipeline stages "
                             "of A tensor-parallel accelerators each (instead of --devices); "
                             "each stage planned for its own layers on one accelerator's "
                             "budget and its share of the host."),
    coordinator: Optional[str] = typer.Option(
        None, "--coordinator", help="HOST:PORT of process 0: run --mesh's B stages in B "
                                    "processes joined by jax.distributed, this one the stage "
                                    "of --process-id (the same command in each, e.g. on each "
                                    "host; README, \"Several accelerators\")."),
    process_id: int = typer.Option(0, "--process-id", help="This process's stage, with "
                                                            "--coordinator."),
    spill_dir: Optional[Path] = typer.Option(
        None, "--spill-dir",
        help="Directory of the unnamed file that disk-homed weights are written to once when "
             "they are not checkpoint tensors stored as hx holds them (random, converted or "
             "compressed weights) (default: the system's temporary directory)."),
) -> None:
    """Generate completions for one prompt or a JSONL file of prompts.

    With --prompts, each result line is appended to --output as its batch ends; an interrupted
    run resumes where it stopped. Piped, stdout carries exactly those JSONL lines; on a
    terminal, each prompt and completion. With --prompt, the completion goes to stdout and,
    with --output, its result line to that file."""
    from hx.batch import check_output_path, output_lock, read_prompts

    if (prompt is None) == (prompts is None):
        raise HxError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompts is not None and output is None:
        raise HxError("--prompts needs --output OUT.jsonl")
    tp, stages = _mesh(mesh, accelerators)
    if coordinator is not None:  # before any JAX computation
        _join(coordinator, process_id, tp, stages, prompts is None)
    if replan_every and (prompt is None or plan is not None or policy not in (None, "cpsat")
                         or tp * stages > 1):
        raise HxError("--replan-every plans with CP-SAT for one --prompt on one accelerator: "
                      "drop --prompts, --devices, --mesh, --plan and --policy other than cpsat")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed)
    lock = contextlib.nullcontext()
    if prompts is not None:  # before the model loads: fail fast
        read_prompts(str(prompts))
    if output is not None:  # before the model loads: fail fast, and one run per output
        check_output_path(None if prompts is None else str(prompts), str(output))
        lock = output_lock(str(output))
    options = RunOptions(model, dtype, weights, sampling, chat, accelerator_memory, host_memory,
                         policy, gpu_layers, host_ops, plan, profile, batch_size or 1,
                         _block(mode, prompts is not None, batch_size, micro_batch,
                                micro_batches), trace, spill_dir, resolve_kv(kv), host_matmul,
                         replan_every, tp if coordinator else tp * stages, stages,
                         coordinator is not None, expert_activity)
    if stages > 1 and options.block is not None and None in options.block:
        raise HxError("throughput mode over pipeline stages runs the block you give: add "
                      "--micro-batch and --micro-batches (or use --batch-size)")
    with lock:
        if prompt is not None:
            _generate_one(prompt, options, output)
        else:
            _generate_file(prompts, output, options)


@dataclass(frozen=True)
class RunOptions:
    """The options of ``hx generate`` that shape a run, checked (see its --help).

    Attributes:
      block: (rows per micro-batch, micro-batches) in throughput mode, each None where the
        block is to be planned; None in latency mode.
      batch_size: prompts per static batch in latency mode.
    """

    model: Optional[str]
    dtype: str
    weights: str
    sampling: SamplingParams
    chat: bool
    accelerator_memory: Optional[str]
    host_memory: Optional[str]
    policy: Optional[str]
    gpu_layers: Optional[int]
    host_ops: str
    plan: Optional[Path]
    profile: Optional[Path]
    batch_size: int
    block: Optional[tuple[Optional[int], Optional[int]]]
    trace: Optional[Path]
    spill_dir: Optional[Path] = None
    kv: str = "auto"
    host_matmul: str = "auto"
    replan_every: int = 0
    accelerators: int = 1
    stages: int = 1
    processes: bool = False
    expert_activity: Optional[str] = None

    def place(self, spec, devices, workload: Workload, hardware):
        """The plan these options ask for (``common.resolve_plan``), made for what each
        accelerator holds; over pipeline stages, each stage's part planned for its own layers
        on its devices, joined (``hx.pipeline.place``; a --plan file is the whole model's)."""
        from hx.executor import per_accelerator
        from hx.pipeline import place

        if self.plan is not None:
            return resolve_plan(*per_accelerator(spec, devices), workload, self.plan,
                                self.host_ops, self.policy, self.gpu_layers, hardware)
        return place(spec, self.devices_of(devices),
                     lambda part, on: resolve_plan(part, on, workload, None, self.host_ops,
                                                   self.policy, self.gpu_layers, hardware,
                                                   self.expert_activity))

    @property
    def chooser(self) -> Optional[str]:
        """The policy that chooses the plan: --policy, else ``auto`` where neither --plan nor
        --host-ops gives one (None)."""
        return None if self.plan is not None or self.host_ops else self.policy or "auto"

    def devices_of(self, devices):
        """The engine's devices: ``devices``, or over pipeline stages one per stage
        (``hx.pipeline.stage_devices``; over processes, each process's:
        ``hx.distributed.process_devices``)."""
        from hx.distributed import process_devices
        from hx.pipeline import stage_devices

        if self.processes:
            return process_devices(devices)
        return devices if self.stages == 1 else stage_devices(devices, self.stages)


def _join(coordinator: str, process_id: int, tp: int, stages: int, one_prompt: bool) -> None:
    """Join the run's other processes (``hx.distributed.initialize``), one per stage.

    Raises:
      HxError: --prompts (a batch run in several processes: not yet), or a mesh of one stage.
    """
    from hx.distributed import initialize

    if not one_prompt:
        raise HxError("--coordinator runs one --prompt over several processes; a --prompts "
                      "batch runs in one process (--mesh without --coordinator)")
    if stages < 2 or tp > 1:
        raise HxError("--coordinator runs --mesh's pipeline stages one per process, on one "
                      "accelerator each: give --mesh pp=B with B processes (tensor parallel "
                      "stages over several processes: not yet)")
    initialize(coordinator, stages, process_id, tp)


def _mesh(mesh: Optional[str], accelerators: int) -> tuple[int, int]:
    """(tp, pp) of --mesh, or (--devices, 1).

    Raises:
      HxError: both given, or a mesh that does not parse.
    """
    from hx.cli.mesh import mesh_shape

    if mesh is None:
        return accelerators, 1
    if accelerators != 1:
        raise HxError("give --devices N (tensor parallel) or --mesh tp=A,pp=B, not both")
    try:
        return mesh_shape(mesh)
    except ValueError as e:
        raise HxError(str(e)) from None


def _block(mode: str, prompts_file: bool, batch_size: Optional[int],
           micro_batch: Optional[int], micro_batches: Optional[int]
           ) -> Optional[tuple[Optional[int], Optional[int]]]:
    """``RunOptions.block`` from --mode and its options.

    Raises:
      HxError: an unknown mode, or options that belong to the other mode.
    """
    if mode not in ("auto", "latency", "throughput"):
        raise HxError(f"--mode must be auto, latency or throughput, got {mode!r}")
    if mode == "auto":
        mode = "throughput" if prompts_file and batch_size is None else "latency"
    if mode == "throughput" and (not prompts_file or batch_size is not None):
        raise HxError("--mode throughput runs a --prompts file, in a block sized by "
                      "--micro-batch and --micro-batches (not --batch-size)")
    if mode == "latency" and (micro_batch or micro_batches):
        raise HxError("--micro-batch and --micro-batches belong to --mode throughput")
    if (micro_batch is None) != (micro_batches is None):
        raise HxError("give both --micro-batch and --micro-batches, or neither (planned)")
    return (micro_batch, micro_batches) if mode == "throughput" else None


def _load(options: RunOptions):
    """(devices, loaded model) for a run."""
    devices = discover(options.accelerator_memory, options.host_memory, options.accelerators)
    return devices, load(options.model, resolve_dtype(options.dtype, devices), options.weights,
                         options.kv, options.host_matmul)


def _hardware(options: RunOptions, spec, devices, workload: Workload | None):
    """The hardware profile a run plans with: choosing a block compares predicted tokens/s,
    which always needs one (``workload`` None); otherwise as the policy needs for
    ``workload`` (``profiler.for_policy``: ``auto`` with a host budget that holds no layer
    split measures a quick one)."""
    from hx.measure.profiler import for_policy, load_or_measure
    from hx.pipeline import plan_targets

    path = str(options.profile) if options.profile else None
    if workload is None:
        return load_or_measure(path, devices, say)
    return for_policy(options.chooser, path, devices, say,
                      [(part, on, workload)
                       for part, on in plan_targets(spec, options.devices_of(devices))])


def _engine(loaded, chosen, devices, workload: Workload, options: RunOptions, hardware,
            stints=()):
    """The engine of a run on plan ``chosen`` (or on ``stints``, the first ``chosen``),
    checked against the budget, with its header line (and, when a layer split stands in for
    CP-SAT, why) on stderr."""
    from hx.executor import per_accelerator
    from hx.generate import Engine
    from hx.memory import check_fits
    from hx.pipeline import check_stages
    from hx.timeline import Timeline

    spec, engine_devices = loaded.spec, options.devices_of(devices)
    if options.stages > 1:
        needs = [e.accelerator for e in check_stages(spec, chosen, engine_devices, workload)]
        where = (f"{devices.describe()}, {options.stages} pipeline stages | needs "
                 f"{', '.join(format_bytes(n) for n in needs)} on each stage's accelerators")
    else:
        need = check_fits(chosen, *per_accelerator(spec, devices), workload).accelerator
        where = f"{devices.describe()} | needs {format_bytes(need)} on the accelerator"
    engine = Engine(loaded, None if stints else chosen, engine_devices,
                    Timeline() if options.trace else None,
                    str(options.spill_dir or tempfile.gettempdir()), stints)
    segments = len(split_segments(chosen, "decode"))
    note(f"{spec.name} | {describe_dtype(spec.dtype, options.dtype, devices)} | weights "
         f"{spec.weight_format}/{spec.embedding_format} {format_bytes(spec.weight_bytes)}, "
         f"KV {spec.kv_format}, host matmul {spec.host_matmul}, loaded in {loaded.load_s:.1f} s | "
         f"{'throughput' if options.block else 'latency'} mode | plan {chosen.name}, step "
         f"path: segments ({segments} per decode step) | {where}")
    if hardware is None and chosen.name.startswith("layer-split") and options.policy is None:
        note("no hardware profile: the largest layer split that fits stands in for "
             "the CP-SAT plan; run `hx profile` once to plan with CP-SAT")
    return engine


def _generate_one(prompt: str, options: RunOptions, output: Optional[Path]) -> None:
    """``hx generate --prompt``: the completion on stdout, its figures on stderr and, with
    ``output``, its result line there (``batch.result_row``: the keys of a --prompts run's
    lines, id ``"prompt"``)."""
    from hx.batch import produced_by, result_row, write_result
    from hx.generate import encode_prompt
    from hx.prefill import check_prompts

    devices, loaded = _load(options)
    spec, sampling = loaded.spec, options.sampling
    ids = encode_prompt(loaded.tokenizer, prompt, options.chat)
    check_prompts([len(ids)], spec)
    workload = Workload.for_prompts(1, len(ids), sampling.max_new_tokens, spec)
    hardware = _hardware(options, spec, devices, workload)
    stints = _replan(spec, devices, workload, options, hardware) if options.replan_every else ()
    chosen = stints[0].plan if stints else options.place(spec, devices, workload, hardware)
    engine = _engine(loaded, chosen, devices, workload, options, hardware, stints)
    del loaded  # frees the loader's weight arrays: the executor holds the weights now
    with err.status("starting", spinner="dots") as status:
        engine.on_status = lambda line: status.update(Text(line))
        result = engine.generate_ids([ids], sampling)[0]
    sys.stdout.write(result.text + "\n")  # the exact text: no wrapping, no markup
    sys.stdout.flush()
    if output is not None:
        write_result(str(output), result_row({"id": "prompt", "prompt": prompt}, result,
                                             produced_by(spec, sampling, (), options.chat)))
    rate = f"{result.decode_tok_s:.1f}" if result.decode_tok_s else "-"
    note(f"prompt_tokens={result.prompt_tokens} "
         f"completion_tokens={len(result.token_ids)} ttft={result.ttft_s:.3f}s "
         f"decode={rate} tok/s finish={result.finish_reason} "
         f"compile={result.compile_s:.1f}s")
    if result.finish_reason == "context":
        say(f"stopped at the model's context of {spec.context_length} tokens: "
            f"{len(result.token_ids)} of the {sampling.max_new_tokens} new tokens asked for")
    if options.replan_every:
        ends = [start for start, _ in engine.plan_log[1:]] + [len(result.token_ids) - 1]
        note("plans: " + ", ".join(f"decode steps {start}-{end - 1} {name}" for (start, name), end
                                   in zip(engine.plan_log, ends)))
    _report_memory(engine, options.trace)


def _replan(spec, devices, workload: Workload, options: RunOptions, hardware):
    """The stints of a run re-planned every ``options.replan_every`` decode steps
    (``planner.replan.cpsat_schedule``), with what they are predicted to gain on stderr.

    Raises:
      HxError: no hardware profile (``hx profile`` makes one).
    """
    from hx.planner.replan import cpsat_schedule

    if hardware is None:
        raise HxError("--replan-every plans with CP-SAT, which needs a hardware profile: run "
                      "`hx profile` once")
    schedule = cpsat_schedule(spec, hardware, devices, workload, options.replan_every)
    note(f"re-planned every {options.replan_every} decode steps: {len(schedule.stints)} "
         f"plan(s), predicted run {schedule.predicted_s:.2f} s against "
         f"{schedule.fixed[1]:.2f} s for the best single plan ({schedule.fixed[0].name}); "
         f"solved in {schedule.solve_s:.1f} s")
    return schedule.stints


def _generate_file(prompts: Path, output: Path, options: RunOptions) -> None:
    """``hx generate --prompts``: the prompts not yet in ``output``, each result appended to
    it as it ends (and echoed), then a summary; nothing to plan or run when every prompt is
    already answered."""
    from hx.batch import prepare_batch

    devices, loaded = _load(options)
    spec = loaded.spec
    job = prepare_batch(loaded, str(prompts), str(output), options.sampling, options.chat)
    if not job.todo:
        say(f"0 generated, {job.total} already in {output}, {job.total} prompts")
        return
    workload = _given_workload(job, spec, options)
    hardware = _hardware(options, spec, devices, workload)

    def place(workload: Workload):
        return options.place(spec, devices, workload, hardware)

    join_min = 1
    if workload is None:
        workload, chosen, join_min = _plan_block(job, spec, hardware, place)
    else:
        chosen = place(workload)
    engine = _engine(loaded, chosen, devices, workload, options, hardware)
    del loaded  # frees the loader's weight arrays: the executor holds the weights now
    _run_batch(job, engine, options.batch_size, output,
               workload if options.block is not None else None, join_min)
    _report_memory(engine, options.trace)


def _report_memory(engine, trace: Optional[Path]) -> None:
    """The accelerator memory peak by owner, the process's peak resident set, a Mixture of
    Experts' routed (token, expert) pairs by the device and home of the expert
    (``hx.routed_pairs``) and, with --trace, the trace written."""
    import resource

    from hx.timeline import D2H, H2D, median_overlap, step_traffic

    acct = engine.accountant
    budget = format_bytes(acct.capacity) if acct.capacity is not None else "no budget"
    owners = ", ".join(f"{k} {format_bytes(v)}" for k, v in acct.peak_by_owner.items())
    stages = getattr(acct, "accountants", ())  # pipeline stages: each one's peak
    if stages:
        note("accelerator memory peak by stage: " + ", ".join(
            f"{format_bytes(a.peak)} of {format_bytes(a.capacity) if a.capacity else '-'}"
            for a in stages))
    note(f"accelerator memory peak {format_bytes(acct.peak)} ({budget}): "
         f"{owners or 'the plan puts nothing there'}; process peak RSS "
         f"{format_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}")
    routed = getattr(engine.executor, "routed", None)
    if routed is not None and routed.counts:
        note(f"routed (token, expert) pairs by where the expert ran: {routed.summary()}")
    if trace is not None:
        timeline = engine.executor.timeline
        timeline.to_chrome(str(trace))
        overlap, traffic = median_overlap(timeline), step_traffic(timeline)
        moved = (f"; a decode step moved H2D {format_bytes(int(traffic[H2D]))}, D2H "
                 f"{format_bytes(int(traffic[D2H]))}" if traffic else "")
        copied = (f", {traffic['experts']:g} streamed experts copied"
                  if traffic.get("experts") else "")
        note(f"trace: {len(timeline.events)} events -> {trace}; median decode overlap "
             f"fraction {'-' if overlap is None else f'{overlap:.2f}'}{moved}{copied} "
             "(medians over the decode steps)")


def _given_workload(job, spec, options: RunOptions) -> Workload | None:
    """The workload of a batch run whose shapes the options give: a static batch of
    --batch-size prompts (latency mode), or the block of --micro-batch rows x --micro-batches
    (throughput mode: joins at once, in spare rows); None where the block is to be planned
    (``_plan_block``)."""
    from hx.continuous import JOIN_CHUNK

    if options.block is None:
        return job.workload(options.batch_size, spec)
    rows, count = options.block
    if rows is None:
        return None
    return Workload(rows, JOIN_CHUNK, job.cache_slots(spec, JOIN_CHUNK), count, spare_rows=rows)


def _plan_block(job, spec, hardware, place) -> tuple[Workload, object, int]:
    """The block, plan and join group (free rows a join waits for) of a throughput run:
    the one ``throughput.choose_block`` predicts the most tokens/s for."""
    from hx.continuous import JOIN_CHUNK
    from hx.planner.throughput import choose_block

    slots = job.cache_slots(spec, JOIN_CHUNK)
    prompts = len(job.todo)  # at least one: _generate_file returns before planning none
    lengths = [len(t) for t in job.token_ids]
    new = [p.max_new_tokens for p in job.sampling]
    note(f"choosing a block for {prompts} prompts (mean {np.mean(lengths):.0f} prompt tokens, "
         f"up to {np.mean(new):.0f} new)")
    choice = choose_block(spec, hardware, prompts, float(np.mean(lengths)), float(np.mean(new)),
                          slots, JOIN_CHUNK, place)
    note(f"throughput mode: {choice.describe()}")
    return choice.workload, choice.plan, choice.join_min


def _run_batch(job, engine, batch_size: int, output: Path, block: Workload | None,
               join_min: int) -> None:
    """Run a batch job with a progress bar (prompts, tokens/s, ETA), each result echoed as it
    is written, then a summary table."""
    from hx.batch import json_line

    results: list[dict] = []
    start = time.perf_counter()
    piped = not sys.stdout.isatty()
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                  MofNCompleteColumn(), TextColumn("{task.fields[rate]} tok/s"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=err) as progress:
        task = progress.add_task("starting", total=len(job.todo), rate="-")
        engine.on_status = lambda line: progress.update(task, description=line)

        def show(row: dict) -> None:
            results.append(row)
            tokens = sum(r["completion_tokens"] for r in results)
            progress.update(task, advance=1,
                            rate=f"{tokens / (time.perf_counter() - start):.1f}")
            if piped:  # the very bytes appended to the output file
                sys.stdout.write(json_line(row))
                sys.stdout.flush()
            else:  # user text is never markup: [/INST], [b], [a-z] print as they are
                out.print(Text.assemble((str(row["id"]), "bold"), " ", repr(row["prompt"])),
                          soft_wrap=True, highlight=False)
                out.print(Text(row["completion"]), soft_wrap=True, highlight=False)
                out.print()

        summary = job.run(engine, batch_size, on_result=show, block=block, join_min=join_min)
    wall = time.perf_counter() - start
    say(f"{summary.generated} generated, {summary.skipped} already in {output}, "
        f"{summary.total} prompts")
    if results:
        print_table(summary_table(results, wall, engine.accountant.peak), stderr=True)


def summary_table(results: list[dict], wall_s: float, peak_bytes: int) -> Table:
    """Prompts, tokens, tokens/s and TTFT / TPOT percentiles of the results of one run.

    TPOT (time per output token after the first) of a row is 1 / its decode tokens/s."""
    def percentiles(values: list[float]) -> str:
        if not values:
            return "-"
        return " / ".join(f"{np.percentile(values, q) * 1e3:.1f}" for q in (50, 90, 99))

    tokens = sum(r["completion_tokens"] for r in results)
    table = Table(title="batch run")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("prompts", str(len(results)))
    table.add_row("generated tokens", str(tokens))
    table.add_row("tokens/s (generated / wall)", f"{tokens / wall_s:.1f}" if wall_s else "-")
    table.add_row("TTFT ms p50 / p90 / p99", percentiles([r["ttft_s"] for r in results]))
    table.add_row("TPOT ms p50 / p90 / p99",
                  percentiles([1 / r["decode_tok_s"] for r in results if r["decode_tok_s"]]))
    table.add_row("accelerator peak", format_bytes(peak_bytes))
    table.add_row("wall s", f"{wall_s:.1f}")
    return table
