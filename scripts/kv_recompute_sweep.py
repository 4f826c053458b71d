"""Partial KV recompute (KVPR) on the hardware presets: the predicted decode step against r.

Usage:
  .venv/bin/python scripts/kv_recompute_sweep.py [--points 16] [--attention-at-bandwidth] \
      [--out docs/measurements/vm-2026-11-25/kv-recompute-sweep.json]

For the T4 and A10G presets (``planner.hardware``), Llama-2-7B and OPT-30B in float16, prompts of
512 and 2,048 tokens (32 generated: cache S = P + 64 slots, decode priced at P + 32 in use),
batch 1 (latency: one micro-batch) and a throughput block of 4 x 32 rows: every layer's ops on
the accelerator, its KV cache ``streamed`` (host memory, attended on the accelerator: FlexGen's
and KVPR's setting), weights streamed (``weights=streamed``, FlexGen's) or resident
(``weights=resident``). Per row: the simulated decode step (``simulator.predict``) at r = 0 and
at ``--points`` + 1 values of r over [0, P + 31], the sweep's best, the planner's r
(``planner.recompute.choose_recompute``) and its step, the gain of the planner's r over
r = 0, and whether the plan fits the preset's memory (``memory.estimate``, unsized
temporaries). KVPR reports -35.8 % decode latency and +46.2 % throughput against its best
offloading baselines (Jiang et al. 2024, abstract); the rows here are hx's simulator on its
presets, not measurements.

``--attention-at-bandwidth`` is a what-if, not a preset: the accelerator's attention rate set
to its memory bandwidth at every S (a fused GPU kernel reading the cache once), where the
presets scale hx's own XLA attention measured on the H100 (a T4's 17 GB/s at 4,096 slots):
there the accelerator, busy attending, has no idle time to recompute in. Its JSON goes to
``kv-recompute-sweep-attention-bw.json`` unless ``--out`` names one.
Runtime: about 30 s each on the 2-core VM (no JAX computation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from hx.devices import ACCELERATOR
from hx.memory import UNSIZED, estimate
from hx.models.spec import PRESETS
from hx.plan import STREAMED, ExecutionPlan, Placement
from hx.planner.hardware import hardware_profile
from hx.planner.profile import HardwareProfile
from hx.planner.recompute import choose_recompute
from hx.planner.simulator import predict
from hx.workload import Workload

MACHINES = ("t4", "a10g")
MODELS = ("llama2-7b", "opt-30b")
PROMPTS = (512, 2048)
BATCHES = ((1, 1), (32, 4))  # (rows per micro-batch, micro-batches): latency, throughput
GENERATED = 64  # cache slots beyond the prompt; decode priced half-way
OUT = "docs/measurements/vm-2026-11-25/kv-recompute-sweep.json"
OUT_WHAT_IF = "docs/measurements/vm-2026-11-25/kv-recompute-sweep-attention-bw.json"
PAPER = {"latency": -0.358, "throughput": 0.462}  # KVPR's reported gains


def streamed_cache_plan(n_layers: int, weights: str) -> ExecutionPlan:
    """Every op on the accelerator, weights ``streamed`` or ``resident``, KV ``streamed``."""
    base = ExecutionPlan.from_placement(Placement.uniform(n_layers, lambda op: ACCELERATOR),
                                        streamed=weights == "streamed", name="kv-streamed")
    return dataclasses.replace(base, kv=(STREAMED,) * n_layers)


def attention_at_bandwidth(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with the accelerator attending at its memory bandwidth at every S."""
    acc = profile.accelerator
    rate = acc.memory_bandwidth
    return dataclasses.replace(profile, name=f"{profile.name}, attention at bandwidth",
                               accelerator=dataclasses.replace(
                                   acc, attention=((256, rate), (4096, rate)), attention_low=()))


def row(machine: str, model: str, prompt: int, batch: int, micro: int, weights: str,
        points: int, what_if: bool = False) -> dict:
    """One sweep: the step at each r, the planner's r and the gain over r = 0."""
    spec, profile = PRESETS[model].replace(dtype="float16"), hardware_profile(machine)
    profile = attention_at_bandwidth(profile) if what_if else profile
    plan = streamed_cache_plan(spec.n_layers, weights)
    S, context = prompt + GENERATED, prompt + GENERATED // 2

    def step(r: int) -> float:
        return predict(plan.with_recompute(r), spec, profile, "decode", batch, 1, S, context,
                       micro).seconds

    rs = sorted({round(i * (context - 1) / points) for i in range(points + 1)})
    sweep = {r: step(r) for r in rs}
    chosen = choose_recompute(plan, spec, profile, batch, S, context, micro).recompute(0)
    best = min(sweep, key=sweep.get)
    need = estimate(plan.with_recompute(chosen), spec, Workload(batch, prompt, S, micro),
                    sizing=UNSIZED)
    at = step(chosen)
    return {"hardware": machine, "model": model, "prompt": prompt, "batch": batch,
            "micro_batches": micro, "weights": weights,
            "mode": "latency" if batch * micro == 1 else "throughput",
            "sweep_s": {str(r): s for r, s in sweep.items()}, "r0_s": sweep[0],
            "best_r": best, "best_s": sweep[best], "planner_r": chosen, "planner_s": at,
            "planner_vs_best": at / sweep[best] - 1, "step_gain": 1 - at / sweep[0],
            "tokens_per_s_gain": sweep[0] / at - 1,
            "fits": (need.accelerator <= (profile.accelerator_memory or float("inf"))
                     and need.host <= (profile.host_memory or float("inf"))),
            "accelerator_bytes": need.accelerator, "host_bytes": need.host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=16)
    parser.add_argument("--attention-at-bandwidth", action="store_true",
                        help="what-if: the accelerator attends at its memory bandwidth")
    parser.add_argument("--out")
    args = parser.parse_args()
    what_if = args.attention_at_bandwidth
    args.out = args.out or (OUT_WHAT_IF if what_if else OUT)
    start, rows = time.time(), []
    print(f"{'hw':5} {'model':9} {'P':>5} {'rows':>6} {'weights':8} {'r=0 ms':>9} "
          f"{'best r':>6} {'best ms':>9} {'plan r':>6} {'plan ms':>9} {'vs best':>8} "
          f"{'gain':>7} fits")
    for machine in MACHINES:
        for model in MODELS:
            for prompt in PROMPTS:
                for batch, micro in BATCHES:
                    for weights in ("streamed", "resident"):
                        r = row(machine, model, prompt, batch, micro, weights, args.points,
                                what_if)
                        rows.append(r)
                        print(f"{machine:5} {model:9} {prompt:5} {f'{micro}x{batch}':>6} "
                              f"{weights:8} {r['r0_s'] * 1e3:9.1f} {r['best_r']:6} "
                              f"{r['best_s'] * 1e3:9.1f} {r['planner_r']:6} "
                              f"{r['planner_s'] * 1e3:9.1f} {r['planner_vs_best']:+8.2%} "
                              f"{r['step_gain']:+7.2%} {'yes' if r['fits'] else 'no'}",
                              flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"script": "scripts/kv_recompute_sweep.py", "paper_gains": PAPER,
                   "attention_at_bandwidth": what_if,
                   "generated_slots": GENERATED, "rows": rows,
                   "seconds": time.time() - start}, f, indent=1)
    print(f"{len(rows)} rows in {time.time() - start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
