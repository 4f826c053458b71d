"""Tensor parallelism on a several-GPU preset, simulated: latency against the number of GPUs.

Usage: python scripts/tensor_parallel.py [--machine 4xa10g] [--model llama2-70b] [--batch 4]
           [--prompt 512] [--new 32] [--time-limit 5] [--json OUT.json]

For k = 1 .. the machine's GPUs, CP-SAT plans one GPU's shard of the model (``ModelSpec.shard``)
within one GPU's memory and its share of the host (``planner.mesh.tensor_parallel``), float16,
``--batch`` rows of ``--prompt`` tokens and ``--new`` new tokens; ``simulator.predict_run``
prices the run: TTFT (prefill), the decode step at mid-generation, and the latency (the whole
run: prefill and every decode step). Beside each, the same at the interconnect's what-if of
its PCIe link's bandwidth (``--what-if-bandwidth``, default the A10's measured H2D rate): how
much of the latency the all-reduces are. The survey's table (issue 28) has Llama-70B at batch 4
on 1-4 GPUs, 5.95 / 3.45 / 2.43 / 2.03 s for TwinPilots' TP; its prompt and generation lengths
were not found, so the rows here are hx's simulator in the stated setting, not a reproduction.
Runtime: about 6 minutes on the 2-core VM (CP-SAT at 70B shapes, twice per k > 1; no JAX
computation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rich.table import Table

from hx.cli.console import print_table
from hx.devices import discover
from hx.models.spec import PRESETS
from hx.planner.cpsat import plan_cpsat
from hx.planner.hardware import hardware_profile, machine, memory_sizing
from hx.planner.mesh import tensor_parallel
from hx.planner.simulator import predict_run
from hx.plan import RESIDENT
from hx.workload import Workload


def row(name: str, model: str, tp: int, link, workload: Workload, time_limit_s: float
        ) -> dict:
    """CP-SAT's plan of one GPU's shard at TP degree ``tp`` over ``link``, priced."""
    spec = PRESETS[model].replace(dtype="float16").shard(tp)
    view = tensor_parallel(hardware_profile(name), tp, link)
    devices = discover(accelerator_memory=view.accelerator_memory,
                       host_memory=view.host_memory)
    with memory_sizing(name):
        plan = plan_cpsat(spec, view, devices, workload, time_limit_s).plan
    run = predict_run(plan, spec, view, workload)
    resident = sum(plan.weights.get(layer, op) == RESIDENT for layer in range(spec.n_layers)
                   for op in ("Q", "K", "V", "OUT", "MLP1", "MLP2"))
    return {"tp": tp, "ttft_s": run.ttft_s, "tpot_s": run.tpot_s, "latency_s": run.total_s,
            "resident_ops": resident, "ops": 6 * spec.n_layers, "plan": plan.name}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="4xa10g")
    parser.add_argument("--model", default="llama2-70b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--what-if-bandwidth", type=float, default=19.5e9,
                        help="all-reduce bus bandwidth of the what-if column, bytes/s")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    several = machine(args.machine)
    if several is None:
        raise SystemExit(f"{args.machine!r} is not a several-GPU machine preset")
    workload = Workload(args.batch, args.prompt, args.prompt + args.new, new_tokens=args.new)
    what_if = dataclasses.replace(several.interconnect, bandwidth=args.what_if_bandwidth)
    rows = []
    for tp in range(1, several.gpus + 1):
        r = row(args.machine, args.model, tp, several.interconnect, workload, args.time_limit)
        r["what_if_latency_s"] = row(args.machine, args.model, tp, what_if, workload,
                                     args.time_limit)["latency_s"] if tp > 1 else r["latency_s"]
        rows.append(r)
        print(f"tp={tp}: latency {r['latency_s']:.2f} s", file=sys.stderr, flush=True)
    table = Table(title=f"{args.model} float16 on {several.name}: batch {args.batch}, "
                        f"{args.prompt} + {args.new} tokens, tensor parallel (simulated)")
    for col in ("GPUs (TP)", "resident ops / GPU", "TTFT s", "decode step s", "latency s",
                f"latency s, all-reduce at {args.what_if_bandwidth / 1e9:g} GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["tp"]), f"{r['resident_ops']} / {r['ops']}", f"{r['ttft_s']:.2f}",
                      f"{r['tpot_s']:.3f}", f"{r['latency_s']:.2f}",
                      f"{r['what_if_latency_s']:.2f}")
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": args.machine, "interconnect": dataclasses.asdict(
                several.interconnect), "model": args.model, "batch": args.batch,
                "prompt": args.prompt, "new_tokens": args.new, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
