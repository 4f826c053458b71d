"""Batch-generation throughput: latency vs throughput mode, static vs iteration-level batches.

Usage: python scripts/bench_throughput.py [--rounds 3] [--budget 0.25] [--prompts 64]
           [--new-tokens 64] [--mixed 48] [--mixed-batch 8] [--only B|C] [--model NAME]
           [--dtype float32] [--weights auto] [--throughput-only] [--json OUT.json]

Takes about an hour with the defaults on the 2-core development VM (estimated, not run in
full here: a 5-round C on 2026-11-22 decoded 6781 tokens per side per round at 19-27
tokens/s, about 10 minutes a round, and B's latency side answers its 64 prompts one at a
time); ``--only B``, ``--rounds 1`` or ``--throughput-only`` shorten it.

SmolLM2-135M-Instruct (its GGUF; ``--model`` takes any ``hx.load`` name, a preset's random
weights get random token ids), float32, greedy, on whatever accelerator ``hx.discover``
finds (this VM: the emulated one), two comparisons, each round running both sides back to back
(interleaved, so a slow spell of a shared machine hits both):

* **B** -- ``--prompts`` prompts of 32-128 tokens, ``--new-tokens`` each, with the accelerator
  budget at ``--budget`` of the weights' bytes. Latency mode: one prompt at a time, the plan
  ``auto`` picks for batch 1. Throughput mode: iteration-level scheduling over the block (and
  plan) ``planner.throughput.choose_block`` picks on the saved (or a quick) hardware profile.
* **C** -- a mixed-length workload: ``--mixed`` prompts of 32-512 tokens, each generating
  16-256 tokens (uniform, its own limit), full budget, all-accelerator plan. Static batches of
  ``--mixed-batch`` prompts (longest first, as ``hx generate --mode latency --batch-size``
  runs them) against iteration-level scheduling over one micro-batch of as many rows. The
  completions must be identical.

Tokens/s = generated tokens / seconds of the run without compilation (each run's
``Completion.compile_s`` is taken off); the table gives medians over the rounds and the median
of the per-round ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hx.devices import configure_runtime

configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import hx  # noqa: E402
from hx.cli.console import print_table
from hx.continuous import JOIN_CHUNK, ContinuousBatcher, run_slots
from hx.devices import discover
from hx.generate import Engine
from hx.measure.profiler import load_or_measure
from hx.memory import held_weight_bytes
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.throughput import choose_block
from hx.sampling import SamplingParams
from hx.workload import Workload, new_tokens

TEXT = ("The history of the printing press begins with movable type, which let a workshop set "
        "a page from reusable letters and print it many times over. Paper mills grew along "
        "rivers, ink makers learned to mix oil and soot, and merchants carried the new books "
        "from town to town, where readers argued about what they found in them. ")


def make_prompts(model, n: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``shortest``..``longest`` token ids: windows of ``TEXT`` repeated
    (random ids for a model without a tokenizer), lengths and offsets drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    if model.tokenizer.eos_id is None:  # random weights of a preset's shapes
        corpus = [int(t) for t in rng.integers(0, model.spec.vocab_size, 4 * longest)]
    else:
        corpus = model.tokenizer.encode(TEXT * 12)
    prompts = []
    for _ in range(n):
        length = int(rng.integers(shortest, longest + 1))
        start = int(rng.integers(0, len(corpus) - length))
        prompts.append(corpus[start:start + length])
    return prompts


def static_run(engine: Engine, prompts, limits, batch: int) -> tuple[list, float]:
    """Static batches of ``batch`` prompts, longest first: (token ids per prompt, seconds
    without compilation)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    spec = engine.model.spec
    slots = Workload.for_prompts(batch, max(map(len, prompts)), max(limits), spec).cache_slots
    out: list = [None] * len(prompts)
    seconds = 0.0
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        began = time.perf_counter()
        done = engine.generate_ids([prompts[i] for i in rows], SamplingParams(max(limits)),
                                   slots, max_new_tokens=[limits[i] for i in rows])
        seconds += time.perf_counter() - began - done[0].compile_s
        for i, c in zip(rows, done):
            out[i] = c.token_ids
    return out, seconds


def continuous_run(engine: Engine, block: Workload, prompts, limits, join_min: int = 1
                   ) -> tuple[list, float]:
    """Iteration-level scheduling over ``block``, joins waiting for ``join_min`` free rows:
    (token ids per prompt, seconds without compilation)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batcher = ContinuousBatcher.for_block(engine, block, join_min)
    began = time.perf_counter()
    done = batcher.run([prompts[i] for i in order], SamplingParams(max(limits)),
                       cache_slots=block.cache_slots, max_new_tokens=[limits[i] for i in order])
    seconds = time.perf_counter() - began - done[0].compile_s
    out: list = [None] * len(prompts)
    for i, c in zip(order, done):
        out[i] = c.token_ids
    return out, seconds


def rate(outputs: list, seconds: float) -> float:
    return sum(len(t) for t in outputs) / seconds


def compare(name: str, runs: dict, rounds: int) -> dict:
    """Run each side of ``runs`` once per round, interleaved; medians and ratio."""
    rates: dict[str, list[float]] = {side: [] for side in runs}
    outputs: dict[str, list] = {}
    for r in range(rounds):
        for side, run in runs.items():
            out, seconds = run()
            rates[side].append(rate(out, seconds))
            outputs[side] = out
            print(f"{name} round {r + 1}: {side} {rates[side][-1]:.1f} tokens/s "
                  f"({sum(map(len, out))} tokens)", file=sys.stderr, flush=True)
    first, last = list(runs)[0], list(runs)[-1]
    return {"sides": list(runs), "tok_s": {s: statistics.median(v) for s, v in rates.items()},
            "rounds": {s: v for s, v in rates.items()},
            "ratio": statistics.median(b / a for a, b in zip(rates[first], rates[last])),
            "identical_outputs": outputs[first] == outputs[last],
            "tokens": sum(map(len, outputs[last]))}


def bench_b(model, args) -> dict:
    spec = model.spec
    budget = int(args.budget * sum(held_weight_bytes(ExecutionPlan.all_accelerator(
        spec.n_layers), spec)))
    devices = discover(accelerator_memory=budget)
    profile = load_or_measure(None, devices, lambda line: print(line, file=sys.stderr))
    prompts = make_prompts(model, args.prompts, 32, 128, seed=1)
    limits = [args.new_tokens] * len(prompts)
    lengths = [len(p) for p in prompts]
    single = policies.build("auto", spec, devices,
                            Workload.for_prompts(1, max(lengths), args.new_tokens, spec),
                            profile=profile)
    slots = run_slots(lengths, [new_tokens(L, args.new_tokens, spec) for L in lengths], spec,
                      JOIN_CHUNK)
    choice = choose_block(spec, profile, len(prompts), float(np.mean(lengths)),
                          float(args.new_tokens), slots, JOIN_CHUNK,
                          lambda w: policies.build("auto", spec, devices, w, profile=profile))
    print(f"B: latency plan {single.name}; throughput {choice.describe()}", file=sys.stderr)
    peaks: dict[str, int] = {}

    def alone(side: str, plan: ExecutionPlan, run):
        """``run(engine)`` on an engine of its own, dropped after: one engine's weights on
        the accelerator at a time (a GPU's memory pool holds one budget, not two)."""
        def go():
            engine = Engine(model, plan, devices)
            try:
                return run(engine)
            finally:
                peaks[side] = max(peaks.get(side, 0), engine.accountant.peak)
                del engine
                gc.collect()
        return go

    runs = {"throughput": alone("throughput", choice.plan, lambda engine: continuous_run(
        engine, choice.workload, prompts, limits, choice.join_min))}
    if not args.throughput_only:
        runs = {"latency": alone("latency", single, lambda engine: static_run(
            engine, prompts, limits, 1))} | runs
    result = compare("B", runs, args.rounds)
    result.update(devices=devices.describe(), budget_bytes=budget, latency_plan=single.name,
                  block=choice.describe(), join_min=choice.join_min, peaks=peaks)
    return result


def bench_c(model, args) -> dict:
    spec = model.spec
    devices = discover()
    rng = np.random.default_rng(2)
    prompts = make_prompts(model, args.mixed, 32, 512, seed=2)
    limits = [int(x) for x in rng.integers(16, 257, len(prompts))]
    engine = Engine(model, ExecutionPlan.all_accelerator(spec.n_layers), devices)
    lengths = [len(p) for p in prompts]
    slots = run_slots(lengths, [new_tokens(L, n, spec) for L, n in zip(lengths, limits)], spec,
                      JOIN_CHUNK)
    block = Workload(args.mixed_batch, JOIN_CHUNK, slots, 1, spare_rows=args.mixed_batch)
    result = compare("C", {
        "static": lambda: static_run(engine, prompts, limits, args.mixed_batch),
        "iteration-level": lambda: continuous_run(engine, block, prompts, limits)}, args.rounds)
    result.update(devices=devices.describe(), batch=args.mixed_batch)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--mixed", type=int, default=48)
    parser.add_argument("--mixed-batch", type=int, default=8)
    parser.add_argument("--only", choices=("B", "C"))
    parser.add_argument("--model", default=None, help="hx.load name (default SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="auto",
                        help="weight format: auto, dense, int8, int4, q8_0, q4_0 or q4_1")
    parser.add_argument("--throughput-only", action="store_true",
                        help="B: skip the latency-mode side (long on big models)")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    model = hx.load(args.model, dtype=args.dtype, weights=args.weights)
    results = {}
    if args.only in (None, "B"):
        results["B"] = bench_b(model, args)
    if args.only in (None, "C"):
        results["C"] = bench_c(model, args)

    table = Table(title=f"{model.spec.name} {args.dtype}, {model.spec.weight_format} weights, "
                        f"greedy, {args.rounds} rounds")
    for col in ("comparison", "side", "tokens/s (median)", "ratio (median)", "same outputs"):
        table.add_column(col, justify="right")
    labels = {"B": f"B: {args.prompts} prompts, {args.budget:.0%} budget",
              "C": f"C: {args.mixed} mixed prompts, batch {args.mixed_batch}"}
    for key, r in results.items():
        for k, side in enumerate(r["sides"]):
            table.add_row(labels[key] if k == 0 else "", side, f"{r['tok_s'][side]:.1f}",
                          f"{r['ratio']:.2f}" if k == 1 else "",
                          str(r["identical_outputs"]) if k == 1 else "")
    console = Console()
    print_table(table)
    for key, r in results.items():
        console.print(f"{key}: {r['devices']}" + (f"; {r['block']}" if "block" in r else ""),
                      markup=False, soft_wrap=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
