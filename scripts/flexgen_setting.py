"""FlexGen's setting, simulated: OPT-30B and OPT-175B on the T4 preset (16 GB GPU, 208 GB host,
NVMe), prompt 512, generation 32, each under FlexGen's published policy and under hx's CP-SAT
plan with the same memory and block.

Usage: python scripts/flexgen_setting.py [--json OUT.json] [--time-limit 5]

Takes 1.5-2.5 minutes on the 2-core development VM (1 min 26 s idle, 2 min 19 s beside other
work): two settings, each planned under FlexGen's policy and by CP-SAT and simulated. Prints
only the table (a spinner on a terminal's stderr meanwhile); ``--json`` writes the rows.

FlexGen's policies (Sheng et al. 2023 §6.1, FMInference/FlexiGen benchmark/flexgen/
bench_suite.py), as ``planner.policies`` names them:

* OPT-30B: ``flexgen:20`` -- weights 20 % GPU / 80 % CPU, KV cache and activations on the CPU,
  attention on the CPU, GPU batch 48 x 3 micro-batches. Published: 7.32 tokens/s.
* OPT-175B: ``flexgen:0:50:kv-disk`` -- weights 0 % GPU / 50 % CPU / 50 % disk, the KV cache
  on disk (bench_suite.py ``--percent 0 50 0 0 0 100``: 256 sequences of 544 tokens hold
  ~650 GB of KV, far past the host's 208 GB; the issue's "KV on CPU" cannot fit), activations
  on the CPU, attention on the CPU, 32 x 8. Published: 0.69 tokens/s.

Both sides run in float16 and are priced by the same simulator and profile, so the comparison
is between placements; the published figures are FlexGen's own measurements on a real T4.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from hx.cli.console import print_table
from hx.errors import HxError
from hx.models.spec import preset
from hx.planner.grid import Scenario, plan_on, simulate_run
from hx.planner.hardware import hardware_profile

SETTINGS = (("opt-30b", "flexgen:20", Scenario("48x3", 48, 512, 32, 3), 7.32),
            ("opt-175b", "flexgen:0:50:kv-disk", Scenario("32x8", 32, 512, 32, 8), 0.69))


def settings():
    """(spec in float16, policy, scenario, published tokens/s or None) of every row: each
    setting under FlexGen's policy, then under CP-SAT."""
    for model, flexgen, scenario, published in SETTINGS:
        spec = preset(model).replace(dtype="float16")
        yield spec, flexgen, scenario, published
        yield spec, "cpsat", scenario, None


def setting_row(spec, policy: str, scenario: Scenario, published: float | None, profile,
                time_limit: float, status) -> dict:
    """One row: the policy's plan on the T4 preset and its simulated run (or why none fits).
    ``status`` is told what is being planned."""
    status(f"planning and simulating {spec.name} under {policy}")
    row = {"model": spec.name, "policy": policy, "block": scenario.name,
           "published_tok_s": published}
    try:
        plan, _ = plan_on(policy, spec, "t4", profile, profile.accelerator_memory,
                          scenario.workload(), time_limit)
        run = simulate_run(plan, spec, profile, scenario)
        row.update(tokens_per_s=run.tokens_per_s, ttft_s=run.ttft_s, tpot_s=run.tpot_s,
                   utilisation=run.utilisation)
    except HxError as e:
        row["error"] = str(e).splitlines()[0]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per solve")
    args = parser.parse_args()
    profile = hardware_profile("t4")
    with Console(stderr=True).status("planning") as status:
        rows = [setting_row(spec, policy, scenario, published, profile, args.time_limit,
                            status.update)
                for spec, policy, scenario, published in settings()]
    table = Table(title=f"FlexGen's setting on {profile.name}, prompt 512, generation 32 "
                        "(simulated)")
    for col in ("model", "policy", "block", "tokens/s", "TPOT s", "host busy",
                "published tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["policy"], r["block"],
                      f"{r['tokens_per_s']:.2f}" if "tokens_per_s" in r else "no plan",
                      f"{r['tpot_s']:.1f}" if "tpot_s" in r else r.get("error", "")[:60],
                      f"{r['utilisation'].get('host', 0):.0%}" if "utilisation" in r else "",
                      str(r["published_tok_s"] or ""))
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
