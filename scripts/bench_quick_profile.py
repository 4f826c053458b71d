"""How long the quick hardware profile takes (target: at most 20 s on this 2-core VM).

Usage: python scripts/bench_quick_profile.py [--runs 3] [--json OUT.json]

Takes about 20 s per run on the 2-core development VM (18 s for ``--runs 1``: a fresh
process and the quick profile), about a minute with the default three runs.

A command that needs a profile and finds none saved measures a quick one
(``hx.measure.profiler.quick``) before it starts; this times that measurement ``--runs`` times,
each in a fresh Python process (as a user's first command meets it: nothing compiled yet) on
the devices ``hx.discover`` finds, and prints each run's seconds, their median and its ratio to
the 20 s target. Run it alone: a concurrent test suite or benchmark
slows every figure the profiler times (a fully loaded 2-core VM took 23 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from rich.table import Table

from hx.cli.console import print_table

TARGET_S = 20.0
ONE_RUN = """
import json, time
from hx.devices import configure_runtime

configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import hx  # noqa: E402
from hx.devices import discover
from hx.measure import profiler
devices = discover()
start = time.perf_counter()
profile = profiler.quick(devices)
print(json.dumps({"seconds": time.perf_counter() - start, "device": profile.name}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the runs as JSON")
    args = parser.parse_args()
    runs = [json.loads(subprocess.run([sys.executable, "-c", ONE_RUN], check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(args.runs)]
    seconds = [run["seconds"] for run in runs]
    device = runs[0]["device"]
    median = statistics.median(seconds)
    table = Table(title=f"quick profile on {device}")
    table.add_column("run")
    table.add_column("seconds", justify="right")
    for i, s in enumerate(seconds, 1):
        table.add_row(str(i), f"{s:.1f}")
    table.add_row("median", f"{median:.1f} ({median / TARGET_S:.2f} of the {TARGET_S:.0f} s target)")
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "seconds": seconds, "median_s": median,
                       "target_s": TARGET_S}, f, indent=1)


if __name__ == "__main__":
    main()
