"""CP-SAT planning time and status at ten budgets, for SmolLM2-135M and a Llama-2-70B shape.

Usage: python scripts/bench_planner.py [--profile out/profile.json] [--json out/planner.json]

Takes about a minute on the 2-core development VM (56 s measured with a test profile,
beside other work).

Budgets run from "barely feasible" (1 % of the weight bytes) to "fits" (120 %). Prints, per
model and budget: solver status, objective and bound, solve time, and total planning time
(pricing the layer patterns with the simulator, then solving).
"""

from __future__ import annotations

import argparse
import json
import time

from rich.markup import escape
from rich.table import Table

from hx.devices import configure_runtime

configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import hx  # noqa: E402
from hx.cli.console import print_table
from hx.models.spec import PRESETS
from hx.planner.cpsat import plan_cpsat
from hx.planner.profile import load_default
from hx.workload import Workload

FRACTIONS = (0.01, 0.03, 0.06, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="hardware profile JSON (default: hx profile's)")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    profile = load_default(args.profile)
    if profile is None:
        raise SystemExit("no hardware profile: run `hx profile` or pass --profile")
    rows = []
    table = Table(title="CP-SAT planning, batch 1, 128 + 128 tokens "
                        + escape(f"[{profile.name}]"))
    for col in ("model", "budget", "status", "objective ms", "bound ms", "chosen ms", "solve s",
                "total s"):
        table.add_column(col, justify="left" if col in ("model", "status") else "right")
    for name in ("smollm2-135m", "llama2-70b"):
        spec = PRESETS[name]
        workload = Workload.for_prompts(1, 128, 128, spec)
        for fraction in FRACTIONS:
            devices = hx.discover(accelerator_memory=int(spec.weight_bytes * fraction))
            start = time.perf_counter()
            result = plan_cpsat(spec, profile, devices, workload, time_limit_s=5.0)
            total = time.perf_counter() - start
            rows.append({"model": name, "budget_fraction": fraction, "status": result.status,
                         "objective_s": result.objective_s, "bound_s": result.bound_s,
                         "chosen_s": result.chosen_s, "solve_s": result.solve_s, "total_s": total})
            table.add_row(name, f"{fraction:.0%}", result.status,
                          f"{result.objective_s * 1e3:.2f}", f"{result.bound_s * 1e3:.2f}",
                          f"{result.chosen_s * 1e3:.2f}", f"{result.solve_s:.3f}", f"{total:.2f}")
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": profile.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
