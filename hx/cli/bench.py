"""``hx bench``: decode tokens/s, executor overhead and copy/compute overlap per plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from hx.cli.common import (AcceleratorMemoryOption, DtypeOption, HostMatmulOption, KvOption,
                           ModelOption, app, describe_dtype, note, out, plan_by_name,
                           print_table)
from hx.devices import discover
from hx.models.loader import load, resolve_dtype


@app.command()
def bench(
    model: Optional[str] = ModelOption,
    dtype: str = DtypeOption,
    weights: str = typer.Option(
        "auto", "--weights",
        help="Weight format, as hx generate's --weights; a comma-separated list benches each "
             "(e.g. dense,int8,int4,auto: the H2D MB column compares the bytes each streams "
             "per step under one plan and budget)."),
    host_matmul: str = HostMatmulOption,
    kv: str = KvOption,
    batches: str = typer.Option("1,16", help="Comma-separated batch sizes."),
    plans: str = typer.Option("all-accelerator,all-host,stream-all,host:SCORE+MLP1",
                              help="Comma-separated plans: a policy name, layer-split:N, or "
                                   "host:OP+OP (those ops on the host)."),
    context: int = typer.Option(128, help="Tokens in the KV cache when timing starts."),
    steps: int = typer.Option(32, help="Timed decode steps per measurement (median)."),
    accelerator_memory: Optional[str] = AcceleratorMemoryOption,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results as JSON."),
) -> None:
    """Decode tokens/s per weight format, plan and batch, the executor's overhead vs one
    whole-model jit, the copy/compute overlap fraction and the weight bytes streamed per step."""
    from hx.measure.bench import bench_decode, bench_workload, rows_to_json
    from hx.memory import check_fits

    devices = discover(accelerator_memory)
    rows = []
    for fmt in (w.strip() for w in weights.split(",") if w.strip()):
        loaded = load(model, resolve_dtype(dtype, devices), fmt, host_matmul=host_matmul, kv=kv)
        spec = loaded.spec
        for b in (int(x) for x in batches.split(",")):
            workload = bench_workload(b, context, steps)
            for name in (p.strip() for p in plans.split(",") if p.strip()):
                plan = plan_by_name(name, spec, devices, workload)
                check_fits(plan, spec, devices, workload)
                rows.append(bench_decode(spec, loaded.params, plan, b, devices, context, steps))
                note(f"measured {plan.name} batch {b}, weights {rows[-1].weights}")
        del loaded  # one format's weights at a time

    table = Table(title=f"decode step, {spec.name}, {spec.dtype}, KV {spec.kv_format}, "
                        f"context {context}, median of "
                        f"{steps} steps; ratio = executor / one jit of the whole model "
                        f"(resident); H2D MB = weights copied in per step")
    for col in ("plan", "weights", "host matmul"):
        table.add_column(col, no_wrap=True)
    for col in ("batch", "tok/s", "executor ms", "1-jit ms", "ratio", "segments", "overlap",
                "H2D MB", "acc peak MiB"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.plan, r.weights, r.host_matmul, str(r.batch), f"{r.decode_tok_s:.1f}",
                      f"{r.executor_step_s * 1e3:.2f}", f"{r.whole_model_step_s * 1e3:.2f}",
                      f"{r.ratio:.3f}", str(r.segments_per_step),
                      "-" if r.overlap is None else f"{r.overlap:.2f}",
                      f"{r.h2d_weight_bytes / 1e6:.2f}",
                      f"{r.accelerator_peak_bytes / 2**20:.1f}")
    print_table(table)
    out.print(f"{describe_dtype(spec.dtype, dtype, devices)} | {devices.describe()}",
              soft_wrap=True)
    if json_out:
        json_out.write_text(json.dumps(rows_to_json(rows, devices, spec), indent=1))
