"""Every check against its real run: dtype x mode x policy x budget, for real.

For each model, dtype {float32, bfloat16, float16}, mode {one prompt, a static batch of 2,
throughput mode: 2 x 2 rows over 5 prompts}, policy (``hx.planner.policies.POLICIES``) and
budget {25, 50, 120 %} of the weights, the policy plans the mode's workload, the run checks its
plan (a dry run of its Schedule with XLA's temporaries of the executables it runs) and
generates; the accountant's peak is compared with the check (``hx.budget_check``). Every run
must peak at exactly its check or, where a short run does not reach the check's peak moment,
below it; none may raise ``BudgetExceeded``. Prints a table and a summary; ``--json`` writes
every cell.

Policies that price ops use the profile ``hx profile`` saved, else the ``h100-80gb`` preset
(only the bytes matter here).

Run time on the 2-core VM: about 25 minutes for SmolLM2 (3 x 3 x 8 x 3 = 216 runs), about an
hour more with ``-m llama2-7b:2L`` (1.9 GB per layer set in float32). ``--dtypes``,
``--policies``, ``--budgets`` and ``--modes`` narrow it.

    .venv/bin/python scripts/bench_memory_matrix.py --json out/memory_matrix.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hx.devices import configure_runtime

configure_runtime()

from hx.budget_check import MODES, check_run  # noqa: E402
from hx.models.loader import load  # noqa: E402
from hx.planner import policies  # noqa: E402
from hx.planner.hardware import hardware_profile  # noqa: E402
from hx.planner.profile import load_default  # noqa: E402

LENGTHS = (40, 23, 57, 9, 31)  # prompt tokens; a mode takes as many prompts as it needs
NEW_TOKENS = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--models", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--policies", default=",".join(policies.POLICIES))
    parser.add_argument("--budgets", default="0.25,0.5,1.2")
    parser.add_argument("--json")
    args = parser.parse_args()
    profile = load_default()
    source = "this machine's saved profile"
    if profile is None:
        profile, source = hardware_profile("h100-80gb"), "the h100-80gb preset"
    print(f"policies that price ops use {source}", file=sys.stderr)
    rows, start = [], time.perf_counter()
    print(f"{'model':<24} {'dtype':<9} {'mode':<13} {'policy':<16} {'budget':>6} "
          f"{'outcome':<8} {'checked':>12} {'peak':>12}  phase / detail")
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            model = load(name, dtype=dtype)
            for mode in args.modes.split(","):
                for policy in args.policies.split(","):
                    for fraction in map(float, args.budgets.split(",")):
                        run = check_run(model, mode, policy, fraction, LENGTHS, NEW_TOKENS,
                                        profile)
                        rows.append(run.row())
                        note = run.phase if run.outcome in ("exact", "below") else \
                            run.detail[:90]
                        print(f"{run.model[:24]:<24} {dtype:<9} {mode:<13} {policy:<16} "
                              f"{fraction:>6.0%} {run.outcome:<8} {run.checked:>12} "
                              f"{run.peak:>12}  {note}", flush=True)
    counts = {o: sum(r["outcome"] == o for r in rows)
              for o in ("exact", "below", "over", "refused")}
    seconds = time.perf_counter() - start
    print(f"{len(rows)} runs in {seconds / 60:.1f} min: " +
          ", ".join(f"{n} {o}" for o, n in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": source, "lengths": LENGTHS, "new_tokens": NEW_TOKENS,
                       "counts": counts, "seconds": seconds, "rows": rows}, f, indent=1)
    sys.exit(1 if counts["over"] else 0)


if __name__ == "__main__":
    main()
