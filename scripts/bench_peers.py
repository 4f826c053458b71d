"""hx against Hugging Face ``transformers.generate`` on the same weights and threads.

Usage: python scripts/bench_peers.py [--batches 1,8,32] [--prompt-tokens 64] [--new-tokens 32]
                                     [--rounds 3] [--json out/bench_peers.json]

SmolLM2-135M-Instruct from its GGUF, float32, greedy: hx (``Engine.generate_ids``, the plan
``auto`` picks without a budget: all-accelerator) and transformers (CPU torch loading the same
GGUF with ``gguf_file=``, ``torch.set_num_threads`` = this machine's cores), the same prompt
token ids in both, every row ``--prompt-tokens`` long. Each round times one whole generate
(prefill + decode) of each engine at each batch, the two interleaved so a slow spell of the
machine hits both; tokens/s = generated tokens / seconds; medians over the rounds, and the
median of the per-round ratios. hx's first call per shape compiles and is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import hx
from hx.generate import Engine
from hx.models.loader import default_model_path
from hx.sampling import SamplingParams

TEXT = ("The history of the printing press begins with movable type, which let a workshop "
        "set a page from reusable letters and print it many times over. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of ``TEXT`` repeated."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    model = hx.load(dtype="float32")
    engine = Engine(model)
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    sampling = SamplingParams(max_new_tokens=args.new_tokens)

    def run_hx(batch: int) -> tuple[int, float]:
        start = time.perf_counter()
        out = engine.generate_ids([ids] * batch, sampling)
        return sum(len(c.token_ids) for c in out), time.perf_counter() - start

    def run_hf(batch: int) -> tuple[int, float]:
        tokens = torch.tensor([ids] * batch)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                              max_new_tokens=args.new_tokens, pad_token_id=0)
        return int(np.prod(out[:, tokens.shape[1]:].shape)), time.perf_counter() - start

    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        run_hx(batch)  # compiles this batch's shapes
        rates: dict[str, list[float]] = {"hx": [], "transformers": []}
        for _ in range(args.rounds):
            for name, run in (("hx", run_hx), ("transformers", run_hf)):
                tokens, seconds = run(batch)
                rates[name].append(tokens / seconds)
        ratios = [a / b for a, b in zip(rates["hx"], rates["transformers"])]
        rows.append({"batch": batch, "hx_tok_s": statistics.median(rates["hx"]),
                     "transformers_tok_s": statistics.median(rates["transformers"]),
                     "ratio": statistics.median(ratios), "rounds": args.rounds})
        print(f"batch {batch} done", file=sys.stderr)

    table = Table(title=f"greedy generate, SmolLM2-135M float32, {args.prompt_tokens} prompt + "
                        f"{args.new_tokens} new tokens per row, {threads} threads "
                        f"{escape('[' + hx.discover().describe() + ']')}")
    for col in ("batch", "hx tok/s", "transformers tok/s", "hx / transformers"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['hx_tok_s']:.1f}",
                      f"{r['transformers_tok_s']:.1f}", f"{r['ratio']:.2f}")
    Console().print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
