"""Simulated vs measured decode step on this machine: policies x budgets x batch 1/16, and blocks
of micro-batches (throughput mode's zig-zag schedule) at two block sizes.

Usage: python scripts/validate_simulator.py [--model smollm2-135m] [--dtype auto]
           [--weights auto] [--profile PATH] [--runs 3] [--steps 8] [--budgets 0.25,0.5]
           [--json OUT.json]

Takes about 4-5 minutes with the defaults on the 2-core development VM (``hx profile``
then this took 7 min 43 s together on 2026-11-24); an 8-layer Llama-2-7B shape took over
7 minutes on an H100.

A model (default SmolLM2-135M; ``llama2-7b:8L`` and other specs run by shape with random
weights) on whatever accelerator ``hx.discover`` finds (this VM: the emulated one), priced
with the saved (or given) hardware profile. Part 1 is ``hx.measure.ablate``: every
policy's plan at each budget (a fraction of the weights' bytes) and batch, the simulator's
prediction against the median measured step (interleaved rounds). Part 2 times
``Executor.run_block`` decode steps of N micro-batches of B rows over zero-filled caches
(``hx.measure.bench.time_block_decode``: the work of a decode step does not depend on what the
cache holds) against ``simulator.predict(..., micro_batches=N)``. A row is within tolerance when predicted /
measured is within 1 +- 0.15.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hx.cli.console import print_table
from hx.measure.ablate import ablate
from hx.measure.calibrate import probe_slots
from hx.models.loader import load, resolve_dtype
from hx.planner import policies
from hx.planner.profile import load_default
from hx.planner.simulator import predict
from rich.table import Table

from hx.devices import discover
from hx.executor import Executor
from hx.measure.bench import DecodeProbe, time_block_decode
from hx.workload import Workload

TOLERANCE = 0.15
CONTEXT = 128
BLOCKS = ((8, 2), (4, 4))  # (rows per micro-batch, micro-batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (float32 on a CPU accelerator, bfloat16 on a GPU), float32, "
                             "bfloat16 or float16")
    parser.add_argument("--weights", default="auto",
                        help="weight format: auto, dense, int8, int4, q8_0, q4_0 or q4_1")
    parser.add_argument("--profile", help="hardware profile (default: the saved one)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budgets", default="0.25,0.5")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    profile = load_default(args.profile)
    if profile is None:
        print("no hardware profile: run `hx profile` first", file=sys.stderr)
        return 2
    model = load(args.model, resolve_dtype(args.dtype), args.weights)
    spec = model.spec
    fractions = tuple(float(x) for x in args.budgets.split(","))
    rows = []
    for r in ablate(spec, model.params, profile, fractions, (1, 16), runs=args.runs,
                    steps=args.steps, context=CONTEXT,
                    log=lambda line: print(line, file=sys.stderr, flush=True)):
        if r.measured_s:
            rows.append({"plan": r.plan, "policy": r.policy, "budget": r.budget_fraction,
                         "block": f"{r.batch}", "predicted_s": r.predicted_s,
                         "measured_s": r.measured_s, "plan_json": r.plan_json})
    slots = probe_slots(CONTEXT, args.steps)
    devices = discover(accelerator_memory=int(spec.weight_bytes * min(fractions)))
    for batch, micro in BLOCKS:
        workload = Workload(batch, CONTEXT, slots, micro)
        plan = policies.build("cpsat", spec, devices, workload, profile=profile)
        executor = Executor(spec, model.params, plan, devices)
        probe = DecodeProbe(spec, batch, CONTEXT)
        measured = statistics.median(
            statistics.median(time_block_decode(executor, probe, slots, args.steps, micro))
            for _ in range(args.runs))
        predicted = predict(plan, spec, profile, "decode", batch, 1, slots,
                            CONTEXT + args.steps // 2, micro).seconds
        rows.append({"plan": plan.name, "policy": "cpsat (block)", "budget": min(fractions),
                     "block": f"{micro} x {batch}", "predicted_s": predicted,
                     "measured_s": measured, "plan_json": plan.to_json()})
        print(f"block {micro} x {batch}: predicted {predicted * 1e3:.1f} ms, measured "
              f"{measured * 1e3:.1f} ms", file=sys.stderr, flush=True)
        del executor
    table = Table(title=f"{spec.name} ({spec.weight_format} weights): simulated vs measured "
                        f"decode step on "
                        f"{profile.name}{' (EMULATED accelerator)' if profile.emulated else ''}")
    for col in ("policy", "plan", "budget", "batch / block", "predicted ms", "measured ms",
                "pred/meas", f"within {TOLERANCE:.0%}"):
        table.add_column(col, justify="right")
    for r in rows:
        ratio = r["predicted_s"] / r["measured_s"]
        r["ratio"], r["within"] = ratio, abs(ratio - 1) <= TOLERANCE
        table.add_row(r["policy"], r["plan"], f"{r['budget']:.0%}", r["block"],
                      f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                      f"{ratio:.2f}", "yes" if r["within"] else "no")
    print_table(table)
    print(f"{sum(r['within'] for r in rows)} of {len(rows)} within {TOLERANCE:.0%}")
    if args.json:
        head = json.dumps({"profile": profile.name, "model": spec.name,
                           "weights": spec.weight_format})
        with open(args.json, "w") as f:  # a row a line: each row carries its plan's JSON
            f.write(head[:-1] + ', "rows": [\n' + ",\n".join(
                json.dumps(r, separators=(",", ":")) for r in rows) + "]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
