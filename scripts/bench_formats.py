"""Bytes on the link per weight format: SmolLM2 under one plan, each format side by side.

Usage: python scripts/bench_formats.py [--policy stream-all] [--budget 0.25] [--tokens 16]
       [--formats dense,int8,int4,auto] [--json OUT.json]

For each weight format (``--weights``: ``dense`` is the GGUF expanded to float32, ``auto`` its
own Q4_1/Q8_0 blocks), loads SmolLM2-135M-Instruct in float32, builds the plan of ``--policy``
with an accelerator budget of ``--budget`` x the float32 weight bytes (the same bytes for every
format, so the plans agree), generates ``--tokens`` greedy tokens from one prompt with a
``Timeline``, and reports the weight bytes copied host -> accelerator per decode step (the
timeline's H2D weight events), their ratio to ``dense``, the decode tokens/s (emulated
accelerator: a second XLA CPU device, not a GPU), and how many greedy tokens equal the dense
run's. Takes about a minute per format on the 2-core development VM.
"""

from __future__ import annotations

import argparse
import json
import statistics

from rich.table import Table

from hx.cli.console import print_table
from hx.devices import configure_runtime, discover
from hx.generate import Engine
from hx.models.loader import load, load_spec
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.timeline import H2D, Timeline
from hx.workload import Workload

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def measure(weights: str, policy: str, budget: int, tokens: int) -> dict:
    """One format's run: H2D weight bytes per decode step, decode tokens/s, greedy ids."""
    model = load(dtype="float32", weights=weights)
    devices = discover(accelerator_memory=budget)
    ids = model.tokenizer.encode(PROMPT)
    workload = Workload.for_prompts(1, len(ids), tokens, model.spec)
    plan = policies.build(policy, model.spec, devices, workload)
    timeline = Timeline()
    engine = Engine(model, plan, devices, timeline)
    (completion,) = engine.generate_ids([ids], SamplingParams(max_new_tokens=tokens))
    timeline.wait()
    decode = timeline.steps("decode")
    moved = [sum(e.args["bytes"] for e in step if e.resource == H2D
                 and e.name.startswith("weights")) for step in decode]
    return {"weights": weights, "weight_format": model.spec.weight_format,
            "embedding_format": model.spec.embedding_format,
            "weight_bytes": model.spec.weight_bytes, "plan": plan.name,
            "h2d_weight_bytes_per_decode_step": statistics.median(moved) if moved else 0,
            "decode_tok_s": completion.decode_tok_s, "token_ids": completion.token_ids,
            "accelerator_peak_bytes": engine.accountant.peak, "budget_bytes": budget}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="stream-all")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--formats", default="dense,int8,int4,auto")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    configure_runtime()
    dense_bytes = load_spec(dtype="float32", weights="dense").weight_bytes
    budget = int(args.budget * dense_bytes)
    rows = [measure(w, args.policy, budget, args.tokens) for w in args.formats.split(",")]
    base = next((r for r in rows if r["weights"] == "dense"), rows[0])
    for r in rows:
        r["h2d_ratio_to_dense"] = (r["h2d_weight_bytes_per_decode_step"]
                                   / max(base["h2d_weight_bytes_per_decode_step"], 1))
        r["tokens_equal_dense"] = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
    table = Table(title=f"SmolLM2, {args.policy}, accelerator budget {budget} bytes "
                        f"({args.budget:g} x float32 weights), {args.tokens} greedy tokens "
                        "[EMULATED accelerator]")
    for column in ("weights", "held (matrices / tables)", "weight MB", "H2D MB per step",
                   "ratio", "decode tok/s", "tokens = dense"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["weights"], f"{r['weight_format']} / {r['embedding_format']}",
                      f"{r['weight_bytes'] / 1e6:.1f}",
                      f"{r['h2d_weight_bytes_per_decode_step'] / 1e6:.2f}",
                      f"{r['h2d_ratio_to_dense']:.3f}", f"{r['decode_tok_s']:.1f}",
                      f"{r['tokens_equal_dense']}/{len(r['token_ids'])}")
    print_table(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
