"""hx against Hugging Face ``transformers.generate`` and llama.cpp on the same weights and
threads.

Usage: python scripts/bench_peers.py [--batches 1,8,32] [--prompt-tokens 64] [--new-tokens 32]
           [--rounds 3] [--llama-python PYTHON] [--json out/bench_peers.json]

Takes about 5-10 minutes with the defaults on the 2-core development VM (estimated from
``--batches 1 --rounds 1``: 74 s beside other work, of which about 50 s loading and compiling;
each round times three engines at each batch, the batch-32 runs generating 32x the tokens);
``--llama-python`` adds the llama.cpp rows.

SmolLM2-135M-Instruct from its GGUF, float32, greedy: hx (the plan ``auto`` picks without a
budget: all-accelerator) as one static batch (``Engine.generate_ids``, latency mode) and with
iteration-level scheduling over one micro-batch of the batch's rows (throughput mode), and
transformers (CPU torch loading the same GGUF with ``gguf_file=``, ``torch.set_num_threads`` =
this machine's cores), the same prompt token ids in all, every row ``--prompt-tokens`` long.
Each round times one whole generate (prefill + decode) of each engine at each batch,
interleaved so a slow spell of the machine hits all; tokens/s = generated tokens / seconds;
medians over the rounds, and the median of the per-round ratios. hx's first call per shape
compiles and is not timed.

With ``--llama-python`` (an interpreter with ``llama-cpp-python``; its wheel is built from
source), batch-1 decode tokens/s of hx (``Completion.decode_tok_s``) and of llama.cpp on an F32
GGUF of the same weights (``scripts/f32_gguf.py``; ``scripts/llama_cpp_decode.py``), with the
same threads, interleaved; the two greedy continuations are compared.
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

from hx.devices import configure_runtime

configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import hx  # noqa: E402
from hx.cli.console import print_table
from hx.continuous import ContinuousBatcher
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
    parser.add_argument("--llama-python", help="python with llama_cpp, for the batch-1 row")
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

    def run_hx_throughput(batch: int) -> tuple[int, float]:
        batcher = ContinuousBatcher(engine, batch)
        start = time.perf_counter()
        out = batcher.run([ids] * batch, sampling)
        return (sum(len(c.token_ids) for c in out),
                time.perf_counter() - start - out[0].compile_s)

    def run_hf(batch: int) -> tuple[int, float]:
        tokens = torch.tensor([ids] * batch)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                              max_new_tokens=args.new_tokens, pad_token_id=0)
        return int(np.prod(out[:, tokens.shape[1]:].shape)), time.perf_counter() - start

    rows = []
    engines = {"hx latency": run_hx, "hx throughput": run_hx_throughput,
               "transformers": run_hf}
    for batch in (int(b) for b in args.batches.split(",")):
        run_hx(batch)  # compiles this batch's shapes
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, run in engines.items():
                tokens, seconds = run(batch)
                rates[name].append(tokens / seconds)
        row = {"batch": batch, "rounds": args.rounds}
        for name in engines:
            row[f"{name} tok/s"] = statistics.median(rates[name])
        for name in ("hx latency", "hx throughput"):
            row[f"{name} / transformers"] = statistics.median(
                a / b for a, b in zip(rates[name], rates["transformers"]))
        rows.append(row)
        print(f"batch {batch} done", file=sys.stderr)
    llama = decode_vs_llama_cpp(args, engine, ids, threads) if args.llama_python else None

    table = Table(title=f"greedy generate, SmolLM2-135M float32, {args.prompt_tokens} prompt + "
                        f"{args.new_tokens} new tokens per row, {threads} threads "
                        f"{escape('[' + hx.discover().describe() + ']')}")
    columns = [k for k in rows[0] if k != "rounds"]
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(str(r[c]) if c == "batch" else f"{r[c]:.2f}" if "/" in c
                        else f"{r[c]:.1f}" for c in columns))
    print_table(table)
    if llama:
        Console().print(f"batch-1 decode: hx {llama['hx_decode_tok_s']:.1f} tok/s, llama.cpp F32 "
                        f"{llama['llama_cpp_decode_tok_s']:.1f} tok/s, ratio "
                        f"{llama['ratio']:.2f} (same {llama['same_tokens']} of "
                        f"{args.new_tokens} greedy tokens)", markup=False, soft_wrap=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "rows": rows,
                                               "batch1_decode": llama}, indent=1))
    return 0


def decode_vs_llama_cpp(args, engine: Engine, ids: list[int], threads: int) -> dict:
    """Batch-1 decode tokens/s of hx and of llama.cpp (F32 GGUF of the same weights, run by
    ``args.llama_python``), interleaved over ``args.rounds``."""
    import subprocess
    import tempfile

    from f32_gguf import write_f32

    folder = tempfile.mkdtemp(prefix="hx-f32-")
    gguf = os.path.join(folder, "smollm2-f32.gguf")
    write_f32(default_model_path(), gguf)
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_decode.py")
    sampling = SamplingParams(max_new_tokens=args.new_tokens, stop_ids=())
    hx_rates, llama_rates, same = [], [], 0
    try:
        for _ in range(args.rounds):
            mine = engine.generate_ids([ids], sampling)[0]
            hx_rates.append(mine.decode_tok_s)
            done = subprocess.run([args.llama_python, helper, gguf, json.dumps(ids),
                                   str(args.new_tokens), str(threads)],
                                  capture_output=True, text=True, check=True)
            theirs = json.loads(done.stdout)
            llama_rates.append(theirs["decode_tok_s"])
            same = sum(a == b for a, b in zip(mine.token_ids, theirs["tokens"]))
    finally:
        os.remove(gguf)
        os.rmdir(folder)
    return {"hx_decode_tok_s": statistics.median(hx_rates),
            "llama_cpp_decode_tok_s": statistics.median(llama_rates),
            "ratio": statistics.median(a / b for a, b in zip(hx_rates, llama_rates)),
            "same_tokens": same, "rounds": args.rounds}


if __name__ == "__main__":
    sys.exit(main())
