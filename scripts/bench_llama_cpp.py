"""hx's host against llama.cpp on the same GGUF: decode and prefill (issue 39, A to D).

Usage: python scripts/bench_llama_cpp.py [--gguf FILE] [--rounds 3] [--threads 2]
           [--new-tokens 64] [--prompt-tokens 512] [--depth 4096] [--kv float16]
           [--batch 32] [--llama-bench PATH] [--json OUT.json]

Takes 2-4 minutes on the 2-core development VM with SmolLM2 (the default file), after
``python -m hx.host_compute.ggml_build --tools`` has built ``llama-bench`` from the same pinned
llama.cpp source as hx's ggml, with this machine's instructions (``GGML_NATIVE=ON``: a generic
build runs 3x slower and makes the comparison meaningless).

llama.cpp: ``llama-bench -t THREADS -r 1`` of ``-p 0 -n NEW`` (decode tokens/s) and ``-p PROMPT
-n 0`` (prefill tokens/s). hx: the file as ``hx.load`` gives it (``host_matmul`` auto), every op
on the host (``all-host``: what the host's kernels are worth; the emulated accelerator is a CPU
device and says nothing of a GPU), greedy: decode tokens/s of a 16-token prompt generating NEW
tokens (``Completion.decode_tok_s``: the tokens after the first over their seconds) and prefill
tokens/s of one PROMPT-token prompt (``Engine.last_logits``, its plan's prefill chunks). Each
round runs all four once, interleaved, after one untimed warm-up of each (hx compiles); medians
over rounds and the median of the per-round ratios hx / llama.cpp. Before each of hx's timed runs
a 2-token generate runs untimed, as llama-bench runs each test once untimed first: a model near
the machine's memory has the file pages hx keeps mapped (its tables, norms, routers) evicted by
llama-bench's load of the same file between them (Qwen3-30B-A3B:24L, 8.5 GB of 23: hx's decode
rounds 22.9-35.1 tokens/s without it, 33-41 alone). ``--depth D`` adds a third
pair (issue 39 D): decode of NEW tokens after a D-token prompt (hx: ``decode_tok_s`` of that
generate; llama.cpp: ``llama-bench -p 0 -n NEW -d D``); ``--kv`` holds hx's KV cache so
(``float16``: llama.cpp's cache type). ``--batch N`` adds a batch-N pair (issue 39 C): hx's
decode tokens/s of N 64-token prompts generating NEW tokens each (the sum of the rows'
``decode_tok_s``), llama.cpp's ``llama-batched-bench -npp 64 -ntg NEW -npl N`` (its S_TG), from
the ``llama-batched-bench`` beside ``--llama-bench``; ``--transformers`` adds transformers
(float32, CPU torch, the same GGUF through ``gguf_file=``, in its own process) on the same rows to
that pair, its decode alone: N x NEW tokens over the seconds of a greedy generate of NEW + 1 tokens
less one of 1 token (its prefill), interleaved with the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from rich.table import Table

from hx.devices import configure_runtime

# llama-bench runs in the environment this script was started in: hx sets OMP_WAIT_POLICY=PASSIVE
# for torch's threads, which makes llama.cpp's OpenMP threads sleep at every barrier (SmolLM2
# decode 29-34 tokens/s against 108-128)
LLAMA_ENV = dict(os.environ)
BATCH_PROMPT = 64  # tokens of each row's prompt in the batch pair
configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import hx  # noqa: E402
from hx.cli.console import print_table  # noqa: E402
from hx.devices import discover  # noqa: E402
from hx.generate import Engine  # noqa: E402
from hx.host_compute.ggml_build import ggml_dir  # noqa: E402
from hx.models.loader import default_model_path  # noqa: E402
from hx.planner import policies  # noqa: E402
from hx.sampling import SamplingParams  # noqa: E402


def llama_tokens_per_s(bench: str, gguf: str, threads: int, prompt: int, new: int,
                       depth: int = 0) -> float:
    """One ``llama-bench`` run (``-r 1``) of a ``prompt``-token prefill or ``new`` decode steps
    (after ``depth`` tokens in the cache), in ``LLAMA_ENV``: its tokens/s."""
    out = subprocess.run([bench, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n",
                          str(new), "-d", str(depth), "-r", "1", "-o", "json"], check=True,
                         capture_output=True, text=True, env=LLAMA_ENV).stdout
    return float(json.loads(out)[0]["avg_ts"])


def batched_tokens_per_s(bench: str, gguf: str, threads: int, prompt: int, new: int,
                         batch: int) -> float:
    """One ``llama-batched-bench`` run of ``batch`` sequences of ``prompt`` + ``new`` tokens,
    in ``LLAMA_ENV``: its decode tokens/s over all sequences (S_TG)."""
    out = subprocess.run([bench, "-m", gguf, "-t", str(threads), "-npp", str(prompt), "-ntg",
                          str(new), "-npl", str(batch), "-c", str(batch * (prompt + new)),
                          "--output-format", "jsonl"], check=True, capture_output=True,
                         text=True, env=LLAMA_ENV).stdout
    return float(json.loads(out.strip().splitlines()[-1])["speed_tg"])


TRANSFORMERS = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
gguf_dir, gguf_file, new, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                             dtype=torch.float32).eval()
tokens = torch.tensor(rows)
def generate(n):
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return time.perf_counter() - start
generate(2)
print(len(rows) * new / (generate(new + 1) - generate(1)))
"""


def transformers_tokens_per_s(gguf: str, rows: list[list[int]], new: int) -> float:
    """One run of transformers' decode of ``rows`` (float32, CPU torch, the GGUF through
    ``gguf_file=``) in its own process and ``LLAMA_ENV`` (torch's OpenMP threads as they run
    by default): ``len(rows) x new`` tokens over the seconds of a greedy generate of ``new +
    1`` tokens less one of 1 token (after one untimed generate)."""
    out = subprocess.run([sys.executable, "-c", TRANSFORMERS, os.path.dirname(gguf),
                          os.path.basename(gguf), str(new), json.dumps(rows)], check=True,
                         capture_output=True, text=True, env=LLAMA_ENV).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=str(default_model_path()))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--depth", type=int, default=0, help="add decode after this many tokens")
    parser.add_argument("--kv", default="auto", help="hx's KV cache format (hx.load's kv)")
    parser.add_argument("--batch", type=int, default=0, help="add decode of this many rows")
    parser.add_argument("--transformers", action="store_true",
                        help="with --batch: transformers' decode of the same rows too")
    parser.add_argument("--llama-bench", default=str(ggml_dir() / "bin" / "llama-bench"))
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    if not os.path.exists(args.llama_bench):
        raise SystemExit(f"no llama-bench at {args.llama_bench}: build it with "
                         "`python -m hx.host_compute.ggml_build --tools`")
    devices = discover()  # the host's budget before the model takes its memory, as hx's CLI
    model = hx.load(args.gguf, kv=args.kv)
    engine = Engine(model, policies.all_host(model.spec.n_layers), devices)
    ids = model.tokenizer.encode("The history of the printing press begins " * 1000)
    short, long, deep = ids[:16], ids[:args.prompt_tokens], ids[:args.depth]
    greedy = SamplingParams(max_new_tokens=args.new_tokens)

    def hx_decode() -> float:
        return engine.generate_ids([short], greedy)[0].decode_tok_s

    def hx_prefill() -> float:
        start = time.perf_counter()
        engine.last_logits([long])
        return len(long) / (time.perf_counter() - start)

    def hx_deep() -> float:
        return engine.generate_ids([deep], greedy)[0].decode_tok_s

    def hx_batch() -> float:
        rows = [ids[i:i + BATCH_PROMPT] for i in range(args.batch)]
        return sum(c.decode_tok_s for c in engine.generate_ids(rows, greedy))

    runs = {
        ("decode", "hx"): hx_decode,
        ("decode", "llama.cpp"): lambda: llama_tokens_per_s(
            args.llama_bench, args.gguf, args.threads, 0, args.new_tokens),
        ("prefill", "hx"): hx_prefill,
        ("prefill", "llama.cpp"): lambda: llama_tokens_per_s(
            args.llama_bench, args.gguf, args.threads, args.prompt_tokens, 0),
    }
    if args.depth:
        runs[("depth", "hx")] = hx_deep
        runs[("depth", "llama.cpp")] = lambda: llama_tokens_per_s(
            args.llama_bench, args.gguf, args.threads, 0, args.new_tokens, args.depth)
    if args.batch:
        runs[("batch", "hx")] = hx_batch
        runs[("batch", "llama.cpp")] = lambda: batched_tokens_per_s(
            os.path.join(os.path.dirname(args.llama_bench), "llama-batched-bench"), args.gguf,
            args.threads, BATCH_PROMPT, args.new_tokens, args.batch)
    if args.batch and args.transformers:
        runs[("batch", "transformers")] = lambda: transformers_tokens_per_s(
            args.gguf, [ids[i:i + BATCH_PROMPT] for i in range(args.batch)], args.new_tokens)
    for run in runs.values():  # warm-up: hx compiles its shapes
        run()
    seen: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, run in runs.items():
            if key[1] == "hx":  # untimed, as llama-bench warms up before each test
                engine.generate_ids([short], SamplingParams(max_new_tokens=2))
            seen[key].append(run())
    table = Table(title=f"{os.path.basename(args.gguf)}, {args.threads} threads: "
                        f"tokens/s, median of {args.rounds} interleaved rounds")
    for col in ("test", "hx (all-host)", "llama.cpp", "hx / llama.cpp"):
        table.add_column(col, justify="right")
    rows = []
    tests = [("decode", args.new_tokens), ("prefill", args.prompt_tokens)]
    tests += [("depth", args.depth)] if args.depth else []
    tests += [("batch", args.batch)] if args.batch else []
    for test, size in tests:
        ours, theirs = seen[test, "hx"], seen[test, "llama.cpp"]
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        rows.append({"test": test, "tokens": size, "hx_tok_s": statistics.median(ours),
                     "llama_cpp_tok_s": statistics.median(theirs), "ratio": ratio,
                     "hx_rounds": ours, "llama_cpp_rounds": theirs})
        if (test, "transformers") in seen:
            hf = seen[test, "transformers"]
            rows[-1] |= {"transformers_tok_s": statistics.median(hf), "transformers_rounds": hf,
                         "ratio_transformers": statistics.median(a / b for a, b in zip(ours, hf))}
        name = {"depth": f"decode {args.new_tokens} @ d{size}",
                "batch": f"decode {args.new_tokens} x {size} rows"}.get(test, f"{test} {size}")
        table.add_row(name, f"{rows[-1]['hx_tok_s']:.1f}",
                      f"{rows[-1]['llama_cpp_tok_s']:.1f}", f"{ratio:.2f}x")
    print_table(table)
    for row in rows:
        if "transformers_tok_s" in row:
            print(f"{row['test']} {row['tokens']}: transformers float32 decode "
                  f"{row['transformers_tok_s']:.1f} tokens/s; hx / transformers "
                  f"{row['ratio_transformers']:.2f}x (median of the rounds' ratios)")
    print(f"hx: host matmul {model.spec.host_matmul}, weights {model.spec.weight_format}/"
          f"{model.spec.embedding_format}, dtype {model.spec.dtype}, KV {model.spec.kv_format}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gguf": args.gguf, "threads": args.threads, "rounds": args.rounds,
                       "host_matmul": model.spec.host_matmul, "dtype": model.spec.dtype,
                       "kv": model.spec.kv_format, "depth": args.depth, "batch": args.batch,
                       "llama_bench": args.llama_bench, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
