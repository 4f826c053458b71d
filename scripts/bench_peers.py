"""hx against Hugging Face ``transformers.generate`` and llama.cpp on the same weights and
threads.

Usage: python scripts/bench_peers.py [--batches 1,8,32] [--prompt-tokens 64] [--new-tokens 32]
           [--rounds 3] [--llama-python PYTHON] [--json out/bench_peers.json]

Takes about 10-20 minutes with the defaults on the 2-core development VM (each round times five
engines at each batch, the batch-32 runs generating 32x the tokens); ``--llama-python`` adds the
llama.cpp rows.

SmolLM2-135M-Instruct from its GGUF, greedy, two hx paths:

* **hx f32** -- the float32 path: the GGUF expanded to dense float32 (``weights="dense"``), the
  plan ``auto`` picks without a budget (all-accelerator);
* **hx q4_1** -- the GGUF's weights kept compressed (``weights="auto"``: its Q4_1 matrices and
  Q8_0 embedding as they are), float32 (what ``hx.load`` picks on a CPU), all-host, each run
  of decoder layers one ggml graph over the file's blocks (``host_matmul`` auto:
  ``hx.host_compute.ggml_layer``; bfloat16 with torch's CPU int4 kernel before session 21,
  bfloat16 with ggml's products in session 21).

Each as one static batch (``Engine.generate_ids``, latency mode) and with iteration-level
scheduling over one micro-batch of the batch's rows (throughput mode); transformers is CPU
torch loading the same GGUF with ``gguf_file=`` in float32, ``torch.set_num_threads`` = this
machine's cores; the same prompt token ids in all, every row ``--prompt-tokens`` long. Each
round times one whole generate (prefill + decode) of each engine at each batch, interleaved so
a slow spell of the machine hits all; tokens/s = generated tokens / seconds; medians over the
rounds, and the median of the per-round ratios. hx's first call per shape compiles and is not
timed.

Batch-1 decode tokens/s (``Completion.decode_tok_s``: the tokens after the first, over their
seconds) of both hx paths, interleaved; with ``--llama-python`` (an interpreter with
``llama-cpp-python``; its wheel is built from source) beside them llama.cpp on the shipped Q4_1
GGUF and on an F32 GGUF of the same weights (``scripts/f32_gguf.py``;
``scripts/llama_cpp_decode.py``), with the same threads; the greedy continuations are compared
with hx f32's.
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
    f32 = Engine(hx.load(dtype="float32", weights="dense"))
    q4 = hx.load()  # the GGUF's blocks, float32 (auto on a CPU); host_matmul auto
    devices = hx.discover()
    q4_plan = hx.policies.build("all-host", q4.spec, devices, hx.Workload(1, 1, 1))
    q4_1 = Engine(q4, q4_plan, devices)
    ids = prompt_ids(q4.tokenizer, args.prompt_tokens)
    sampling = SamplingParams(max_new_tokens=args.new_tokens)

    def latency(engine: Engine):
        def run(batch: int) -> tuple[int, float]:
            start = time.perf_counter()
            out = engine.generate_ids([ids] * batch, sampling)
            return sum(len(c.token_ids) for c in out), time.perf_counter() - start
        return run

    def throughput(engine: Engine):
        def run(batch: int) -> tuple[int, float]:
            batcher = ContinuousBatcher(engine, batch)
            start = time.perf_counter()
            out = batcher.run([ids] * batch, sampling)
            return (sum(len(c.token_ids) for c in out),
                    time.perf_counter() - start - out[0].compile_s)
        return run

    def run_hf(batch: int) -> tuple[int, float]:
        tokens = torch.tensor([ids] * batch)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                              max_new_tokens=args.new_tokens, pad_token_id=0)
        return int(np.prod(out[:, tokens.shape[1]:].shape)), time.perf_counter() - start

    rows = []
    engines = {"hx f32 latency": latency(f32), "hx f32 throughput": throughput(f32),
               "hx q4_1 latency": latency(q4_1), "hx q4_1 throughput": throughput(q4_1),
               "transformers": run_hf}
    for batch in (int(b) for b in args.batches.split(",")):
        for engine in (f32, q4_1):
            latency(engine)(batch)  # compiles this batch's shapes
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, run in engines.items():
                tokens, seconds = run(batch)
                rates[name].append(tokens / seconds)
        row = {"batch": batch, "rounds": args.rounds}
        for name in engines:
            row[f"{name} tok/s"] = statistics.median(rates[name])
        for name in engines:
            if name != "transformers":
                row[f"{name} / transformers"] = statistics.median(
                    a / b for a, b in zip(rates[name], rates["transformers"]))
        rows.append(row)
        print(f"batch {batch} done", file=sys.stderr)
    decode = batch1_decode(args, {"hx f32": f32, "hx q4_1": q4_1}, ids, threads)

    table = Table(title=f"greedy generate, SmolLM2-135M, {args.prompt_tokens} prompt + "
                        f"{args.new_tokens} new tokens per row, {threads} threads "
                        f"{escape('[' + hx.discover().describe() + ']')}")
    columns = [k for k in rows[0] if k != "rounds"]
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(str(r[c]) if c == "batch" else f"{r[c]:.2f}" if "/" in c
                        else f"{r[c]:.1f}" for c in columns))
    print_table(table)
    decode_table = Table(title=f"batch-1 decode tokens/s, median of {args.rounds} rounds "
                               f"(ratio: median of per-round ratios to hx f32)")
    for col in ("engine", "decode tok/s", "/ hx f32", "same greedy tokens as hx f32"):
        decode_table.add_column(col, justify="right")
    for name, r in decode.items():
        decode_table.add_row(name, f"{r['decode_tok_s']:.1f}", f"{r['vs_hx_f32']:.2f}",
                             f"{r['same_tokens']} of {args.new_tokens}")
    print_table(decode_table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "rows": rows,
                                               "batch1_decode": decode}, indent=1))
    return 0


def batch1_decode(args, engines: dict[str, Engine], ids: list[int], threads: int) -> dict:
    """{engine: {decode_tok_s, vs_hx_f32, same_tokens}}: batch-1 decode tokens/s of each hx
    engine (the first is ``hx f32``) and, with ``args.llama_python``, of llama.cpp on the
    shipped Q4_1 GGUF and on an F32 GGUF of the same weights, interleaved over
    ``args.rounds``; ``same_tokens``: greedy tokens equal to hx f32's, position by position."""
    import subprocess
    import tempfile

    from f32_gguf import write_f32

    sampling = SamplingParams(max_new_tokens=args.new_tokens, stop_ids=())
    ggufs, folder = {}, None
    if args.llama_python:
        folder = tempfile.mkdtemp(prefix="hx-f32-")
        ggufs = {"llama.cpp Q4_1": default_model_path(),
                 "llama.cpp F32": os.path.join(folder, "smollm2-f32.gguf")}
        write_f32(default_model_path(), ggufs["llama.cpp F32"])
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_decode.py")
    names = [*engines, *ggufs]
    rates: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    try:
        for _ in range(args.rounds):
            for name, engine in engines.items():
                done = engine.generate_ids([ids], sampling)[0]
                rates[name].append(done.decode_tok_s)
                tokens[name] = list(done.token_ids)
            for name, gguf in ggufs.items():
                done = subprocess.run([args.llama_python, helper, gguf, json.dumps(ids),
                                       str(args.new_tokens), str(threads)],
                                      capture_output=True, text=True, check=True)
                theirs = json.loads(done.stdout)
                rates[name].append(theirs["decode_tok_s"])
                tokens[name] = theirs["tokens"]
    finally:
        if folder:
            os.remove(ggufs["llama.cpp F32"])
            os.rmdir(folder)
    base = names[0]
    return {n: {"decode_tok_s": statistics.median(rates[n]),
                "vs_hx_f32": statistics.median(a / b for a, b in zip(rates[n], rates[base])),
                "same_tokens": sum(a == b for a, b in zip(tokens[n], tokens[base]))}
            for n in names}


if __name__ == "__main__":
    sys.exit(main())
