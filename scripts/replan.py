"""Re-planning as the context grows, simulated on the presets and measured here.

Usage: python scripts/replan.py [--every 512] [--machines t4,a10g] [--models llama2-7b,opt-30b]
           [--batches 1,16] [--local-every 256] [--local-prompt 256] [--local-new 1024]
           [--local-batch 8] [--local-budget 100MiB] [--rounds 2] [--json OUT.json]

Part 1 (simulated, issue 27 acceptance D): the long-generation workload (a 256-token prompt,
4,096 new tokens) of each model and batch on each preset, its accelerator memory the budget:
``planner.replan.cpsat_schedule`` (CP-SAT every ``--every`` decode steps, a dynamic program over
the windows' plans with switch costs) against the best single plan of those windows and the plan
hx takes without re-planning (``cpsat.plan_cpsat``: solved once for the whole run, a candidate
of every window too). Tokens/s = rows x new tokens / predicted run (prefill, then each window's
steps at its middle context, and the switches).

Part 2 (measured here): SmolLM2 greedy from ``--local-batch`` random prompts of
``--local-prompt`` tokens, ``--local-new`` tokens each (EOS ignored), under the accelerator
budget ``--local-budget``, planned on the saved hardware profile: the engine re-planned every
``--local-every`` steps against the best single plan, in interleaved rounds after a warm-up run
each (compilation excluded): decode tokens/s (median) and whether the tokens are equal. Where the
schedule is one plan (re-planning is predicted not to pay) nothing is run: it is the fixed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np
from rich.table import Table

from hx.cli.console import print_table
from hx.devices import discover
from hx.generate import Engine
from hx.models.loader import load
from hx.models.spec import PRESETS
from hx.plan import Stint
from hx.planner.hardware import hardware_profile, memory_sizing
from hx.planner.profile import load_default
from hx.planner.replan import cpsat_schedule
from hx.sampling import SamplingParams
from hx.workload import Workload

PROMPT, NEW = 256, 4096


def simulated(machines: list[str], models: list[str], batches: list[int], every: int
              ) -> list[dict]:
    """Part 1: one row per (machine, model, batch)."""
    rows = []
    for machine in machines:
        profile = hardware_profile(machine)
        for name in models:
            spec = PRESETS[name].replace(dtype="float16")
            for batch in batches:
                workload = Workload(batch, PROMPT, PROMPT + NEW, new_tokens=NEW)
                devices = discover(accelerator_memory=profile.accelerator_memory,
                                   host_memory=profile.host_memory)
                with memory_sizing(machine):
                    schedule = cpsat_schedule(spec, profile, devices, workload, every)
                tokens = batch * NEW
                row = {"machine": machine, "model": name, "batch": batch, "every": every,
                       "stints": [(s.start, s.plan.name) for s in schedule.stints],
                       "replanned_tok_s": tokens / schedule.predicted_s,
                       "best_fixed_tok_s": tokens / schedule.fixed[1],
                       "best_fixed_plan": schedule.fixed[0].name,
                       "cpsat_once_tok_s": tokens / schedule.single_s["cpsat@run"],
                       "solve_s": schedule.solve_s}
                rows.append(row)
                print(f"{machine} {name} b{batch}: re-planned {row['replanned_tok_s']:.2f} "
                      f"tok/s ({len(schedule.stints)} plans), best fixed "
                      f"{row['best_fixed_tok_s']:.2f}, CP-SAT once {row['cpsat_once_tok_s']:.2f}",
                      file=sys.stderr, flush=True)
    return rows


def measured(args) -> dict:
    """Part 2: the re-planned and the best fixed run of SmolLM2 here."""
    profile = load_default(args.profile)
    if profile is None:
        raise SystemExit("no hardware profile: run `hx profile` first")
    model = load(None, "float32", "auto")
    model = dataclasses.replace(model, tokenizer=dataclasses.replace(model.tokenizer,
                                                                     eos_id=None))
    spec = model.spec
    devices = discover(accelerator_memory=args.local_budget)
    B, P, G = args.local_batch, args.local_prompt, args.local_new
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(5, spec.vocab_size, P)] for _ in range(B)]
    workload = Workload.for_prompts(B, P, G, spec)
    schedule = cpsat_schedule(spec, profile, devices, workload, args.local_every)
    result = {"model": spec.name, "profile": profile.name, "emulated": profile.emulated,
              "batch": B, "prompt": P, "new_tokens": G, "budget": args.local_budget,
              "every": args.local_every, "solve_s": schedule.solve_s,
              "stints": [(s.start, s.plan.name) for s in schedule.stints],
              "predicted_tok_s": {"re-planned": B * G / schedule.predicted_s,
                                  "best fixed": B * G / schedule.fixed[1]}}
    if len(schedule.stints) == 1:  # the best fixed plan itself: one run would be timed twice
        print("one plan for the whole run: the re-planned run is the fixed run",
              file=sys.stderr, flush=True)
        return result
    runs = {"re-planned": schedule.stints, "best fixed": (Stint(0, schedule.fixed[0]),)}
    sampling = SamplingParams(max_new_tokens=G)
    engines = {name: Engine(model, devices=devices, stints=stints)
               for name, stints in runs.items()}
    tokens, rates = {}, {name: [] for name in runs}
    for name, engine in engines.items():  # warm-up: compiles every plan's segments
        tokens[name] = [c.token_ids for c in engine.generate_ids(prompts, sampling)]
    for _ in range(args.rounds):
        for name, engine in engines.items():
            started = time.perf_counter()
            out = engine.generate_ids(prompts, sampling)
            wall = time.perf_counter() - started
            rates[name].append(B * G / wall)
            print(f"{name}: {B * G / wall:.1f} tok/s ({wall:.1f} s), plans {engine.plan_log}",
                  file=sys.stderr, flush=True)
            assert [c.token_ids for c in out] == tokens[name]
    return result | {"measured_tok_s": {name: statistics.median(r) for name, r in rates.items()},
                     "rounds": rates,
                     "tokens_equal": tokens["re-planned"] == tokens["best fixed"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=512)
    parser.add_argument("--machines", default="t4,a10g")
    parser.add_argument("--models", default="llama2-7b,opt-30b")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--local-every", type=int, default=256)
    parser.add_argument("--local-prompt", type=int, default=256)
    parser.add_argument("--local-new", type=int, default=1024)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--local-budget", default="100MiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", help="hardware profile of this machine (default: saved)")
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    sim = simulated(args.machines.split(","), args.models.split(","),
                    [int(b) for b in args.batches.split(",")], args.every)
    local = None if args.skip_local else measured(args)
    table = Table(title=f"Re-planning every {args.every} decode steps, simulated: "
                        f"{PROMPT}-token prompt, {NEW} new tokens (tokens/s)")
    for col in ("machine", "model", "batch", "plans", "re-planned", "best fixed",
                "CP-SAT once", "gain over best fixed"):
        table.add_column(col, justify="right")
    for r in sim:
        table.add_row(r["machine"], r["model"], str(r["batch"]), str(len(r["stints"])),
                      f"{r['replanned_tok_s']:.2f}", f"{r['best_fixed_tok_s']:.2f}",
                      f"{r['cpsat_once_tok_s']:.2f}",
                      f"{r['replanned_tok_s'] / r['best_fixed_tok_s'] - 1:+.1%}")
    print_table(table)
    if local:
        print(f"here ({local['profile']}): plans {local['stints']}, predicted "
              f"{local['predicted_tok_s']} tokens/s, measured "
              f"{local.get('measured_tok_s', 'not run: one plan')}, tokens equal "
              f"{local.get('tokens_equal', '-')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"simulated": sim, "measured": local}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
