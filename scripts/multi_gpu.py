"""Several GPUs, simulated: the survey's table (issue 28) in hx's terms, latency against GPUs.

Usage: python scripts/multi_gpu.py [--machine 4xa10g] [--gpus 1,2,3,4] [--model llama2-70b]
           [--dtype bfloat16] [--batch 4] [--prompt 512] [--new 32] [--time-limit 2]
           [--what-if-bandwidth 19.5e9]
           [--markdown OUT.md] [--json OUT.json]

For k of ``--gpus`` (default 1 .. the machine's GPUs), Llama-2-70B in ``--dtype`` (bfloat16:
the host's ops then hold its own weights; float16 ones hold float32 copies, which a 70B model's
host share does not fit at one GPU) at ``--batch`` rows of ``--prompt`` +
``--new`` tokens (one micro-batch: latency), the run's predicted seconds (prefill and every
decode step: "user response latency") under each layout of ``planner.layouts``:

* FlexGen, layers per GPU: k pipeline stages, each planned by FlexGen's LP (``flexgen-lp``);
* TwinPilots PP / TP: k stages, or one stage split k ways, each planned by TwinPilots' load
  balancing (``min-max``);
* CP-SAT PP / TP: the same layouts planned by CP-SAT;
* CP-SAT's layout: the best tp x pp of the k GPUs (``layouts.best_layout``).

The survey (issue 28: Llama-70B, batch 4, 1-4 GPUs) has FlexGen 11.80 / 8.15 / 7.29 / 7.19 s,
TwinPilots PP 5.44 / 5.29 / 4.39 / 3.57, TP 5.95 / 3.45 / 2.43 / 2.03; its prompt and generation
lengths were not found (docs/hardware-sources.md §8), so the rows are compared by shape: TP falls
fastest, PP stays below FlexGen's layers per GPU, CP-SAT's layout is at least the best of them.
``--what-if-bandwidth`` adds CP-SAT TP at an all-reduce bus bandwidth of the PCIe link (the A10's
measured H2D rate) beside the sourced 3.10 GB/s. Runtime: about 20 minutes on the 2-core VM
(CP-SAT at 70B shapes; no JAX computation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rich.table import Table

from hx.cli.console import print_table
from hx.errors import HxError
from hx.models.spec import PRESETS
from hx.planner import hardware
from hx.planner.layouts import Layout, best_layout, price
from hx.workload import Workload

SURVEY = {"FlexGen PP": (11.80, 8.15, 7.29, 7.19), "TwinPilots PP": (5.44, 5.29, 4.39, 3.57),
          "TwinPilots TP": (5.95, 3.45, 2.43, 2.03)}
COLUMNS = {"FlexGen PP": lambda k: Layout(1, k, "flexgen-lp"),
           "TwinPilots PP": lambda k: Layout(1, k, "min-max"),
           "TwinPilots TP": lambda k: Layout(k, 1, "min-max"),
           "CP-SAT PP": lambda k: Layout(1, k, "cpsat"),
           "CP-SAT TP": lambda k: Layout(k, 1, "cpsat")}


def latency(spec, machine: str, layout: Layout, workload: Workload, time_limit_s: float,
            link=None) -> float | None:
    """The layout's predicted run in seconds, or None where no plan of its policy fits."""
    try:
        return price(spec, machine, layout, workload, time_limit_s, link).total_s
    except HxError as e:
        print(f"{layout.name}: {e}", file=sys.stderr)
        return None


def cell(row: dict, name: str) -> str:
    """A table cell: seconds (the survey's beside, in brackets, where it has the column)."""
    value = row[name]
    text = value if isinstance(value, str) else "no fit" if value is None else f"{value:.2f}"
    survey = SURVEY.get(name)
    return f"{text} [{survey[row['gpus'] - 1]}]" if survey and row["gpus"] <= 4 else text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="4xa10g")
    parser.add_argument("--gpus", help="GPU counts, comma-separated (default: 1 .. all)")
    parser.add_argument("--model", default="llama2-70b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--what-if-bandwidth", type=float, default=19.5e9)
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--markdown", help="append the table as Markdown to this file")
    args = parser.parse_args()
    several = hardware.machine(args.machine)
    if several is None:
        raise SystemExit(f"{args.machine!r} is not a several-GPU machine preset")
    spec = PRESETS[args.model].replace(dtype=args.dtype)
    workload = Workload(args.batch, args.prompt, args.prompt + args.new, new_tokens=args.new)
    fast = dataclasses.replace(several.interconnect, bandwidth=args.what_if_bandwidth)
    rows = []
    counts = ([int(k) for k in args.gpus.split(",")] if args.gpus
              else range(1, several.gpus + 1))
    for k in counts:
        row = {"gpus": k} | {name: latency(spec, args.machine, make(k), workload,
                                            args.time_limit)
                             for name, make in COLUMNS.items()}
        best = best_layout(spec, args.machine, k, workload, args.time_limit)
        row |= {"CP-SAT layout": best.total_s, "CP-SAT layout is": best.layout.name,
                f"CP-SAT TP, all-reduce at {args.what_if_bandwidth / 1e9:g} GB/s":
                    latency(spec, args.machine, Layout(k, 1), workload, args.time_limit, fast)}
        rows.append(row)
        print(f"k={k}: {row}", file=sys.stderr, flush=True)
    table = Table(title=f"{spec.name} {args.dtype} on {several.name}: batch {args.batch}, "
                        f"{args.prompt} + {args.new} tokens, latency s (simulated; survey's "
                        "in brackets)")
    names = [n for n in rows[0] if n != "gpus"]
    table.add_column("GPUs", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(str(row["gpus"]), *(cell(row, n) for n in names))
    print_table(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{table.title}\n\n| GPUs | " + " | ".join(names) + " |\n|"
                    + "---|" * (len(names) + 1) + "\n")
            for row in rows:
                f.write(f"| {row['gpus']} | " + " | ".join(cell(row, n) for n in names)
                        + " |\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": args.machine, "interconnect": dataclasses.asdict(
                several.interconnect), "model": args.model, "dtype": args.dtype,
                "batch": args.batch,
                "prompt": args.prompt, "new_tokens": args.new, "survey": SURVEY,
                "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
