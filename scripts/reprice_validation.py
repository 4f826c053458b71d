"""Re-price a measured validation on a profile with decompression rates, without re-measuring.

Usage: python scripts/reprice_validation.py VALIDATION.json --profile P.json
           --dequantize DEQUANTIZE.json [--model llama2-7b:8L] [--dtype bfloat16] [--weights int4]

``VALIDATION.json`` holds measured rows of the former ``scripts/validate_simulator.py``
(policy, budget, batch, predicted_s, measured_s), the records in docs/measurements taken with
code that priced no decompression (``hx ablate --json``, which replaced the script, names its
columns budget_fraction, batch and micro_batches and prices decompression itself).
``DEQUANTIZE.json`` holds decompression figures measured on the same machine, keyed
"accelerator bfloat16", "accelerator float32", "host float32": per format a curve
(``DeviceProfile.dequantize``) or one per-weight number (the first probe's form). Each row's plan (its
recorded ``plan_json``, or rebuilt from its name: stream-all, layer-split:N) is priced twice:
as then (every format's decompression free) and with the measured decompression. Runs in
seconds: shapes only, nothing is executed (plans are not re-chosen: their memory sizing is the
measuring backend's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from hx.cli.console import print_table
from hx.measure.calibrate import predicted_decode
from hx.models.formats import FORMATS
from hx.models.loader import load_spec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.profile import HardwareProfile
from rich.table import Table

CONTEXT, STEPS = 128, 8  # validate_simulator's probe


def with_dequantize(profile: HardwareProfile, rates: dict[str, list]) -> HardwareProfile:
    """``profile`` with the decompression figures of ``rates`` (all free when empty)."""
    def per(key: str) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
        table = rates.get(key, [(f, 0.0) for f in FORMATS])  # a number: one per-weight figure
        return tuple((f, ((1, float(c)),) if isinstance(c, (int, float))
                      else tuple((int(n), float(r)) for n, r in c)) for f, c in table)

    return dataclasses.replace(
        profile,
        accelerator=dataclasses.replace(profile.accelerator,
                                        dequantize=per("accelerator float32"),
                                        dequantize_low=per("accelerator bfloat16")),
        host=dataclasses.replace(profile.host, dequantize=per("host float32")))


def recorded_plan(row: dict, spec) -> ExecutionPlan | None:
    """The row's plan: its recorded ``plan_json``, else rebuilt from a name that says it all
    (stream-all, layer-split:N), else None."""
    if row.get("plan_json"):
        return ExecutionPlan.from_json(row["plan_json"], spec.n_layers)
    if row["plan"] == "stream-all":
        return policies.stream_all(spec.n_layers)
    if row["plan"].startswith("layer-split:"):
        return policies.layer_split(spec.n_layers, int(row["plan"].split(":")[1]))
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validation")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--dequantize", required=True)
    parser.add_argument("--model", default="llama2-7b:8L")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default="int4")
    args = parser.parse_args()
    spec = load_spec(args.model, args.dtype, args.weights)
    profile = HardwareProfile.load(args.profile)
    then, now = with_dequantize(profile, {}), with_dequantize(profile, json.load(
        open(args.dequantize)))
    rows = json.load(open(args.validation))["rows"]
    table = Table(title=f"{spec.name} ({spec.weight_format}) on {profile.name}: measured "
                        "steps re-priced with decompression")
    for col in ("policy", "plan", "budget", "batch / block", "measured ms", "priced then",
                "then/meas", "priced now", "now/meas"):
        table.add_column(col, justify="right")
    skipped = []
    for r in rows:
        plan = recorded_plan(r, spec)
        if plan is None:
            skipped.append(f"{r['policy']} ({r['plan']})")
            continue
        micro, _, rows_ = r["block"].rpartition(" x ")
        batch, micro = int(rows_), int(micro or 1)
        old, new = (predicted_decode(plan, spec, p, batch, STEPS, CONTEXT, micro)
                    for p in (then, now))
        table.add_row(r["policy"], plan.name, f"{r['budget']:.0%}", r["block"],
                      f"{r['measured_s'] * 1e3:.1f}", f"{old * 1e3:.1f}",
                      f"{old / r['measured_s']:.2f}", f"{new * 1e3:.1f}",
                      f"{new / r['measured_s']:.2f}")
    print_table(table)
    if skipped:
        print(f"not re-priced (plan not recorded in the file): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
