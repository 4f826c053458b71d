"""Accuracy of hx's weight and KV-cache formats: perplexity and top-1 agreement with float32 on a
fixed text, beside llama.cpp's perplexity of the same weights.

Usage: python scripts/accuracy.py [--settings f32,bf16,int8,...] [--tokens N]
           [--text data/accuracy/alice-chapter1.txt] [--policy all-accelerator]
           [--accelerator-memory SIZE] [--llama-python PYTHON] [--json out/accuracy.json]

Takes one decode step per token of the text (2,978 tokens) per hx setting: about 1.5 minutes a
setting on the idle 2-core development VM (about 30 ms a step), but measured 20 to 23 minutes a
setting beside other work (load 6 to 8, 2026-11-24: f32 1,193 s, bf16 1,396 s); each llama.cpp
row takes about a minute (writing its GGUF, one batched evaluation). ``--tokens 300`` gives a
quick check.

What it measures. The text (``data/accuracy/alice-chapter1.txt``: Chapter I of *Alice's
Adventures in Wonderland*, public domain; ``data/accuracy/README.md``) is tokenized once with
SmolLM2-135M-Instruct's tokenizer (no BOS: the tokenizer adds none), giving ids t_0 .. t_{N-1}.
Each setting is one row of ``SETTINGS``: hx's default model loaded with
``hx.load(None, dtype=D, weights=W, kv=K)``. Weights W: ``dense`` (the GGUF dequantized to
dtype D), ``int8`` (group 32, least-squared-error fit), ``int4`` (FlexGen's min/max, group 64:
``models/formats.py``), ``auto`` (hx's default: the GGUF's own blocks, Q4_1 with a Q8_0 token
embedding for SmolLM2), ``q8_0``, ``q4_0`` (hx's requantizations into those blocks: of the
dequantized values, so neither is the original model quantized).
KV cache K: ``dense`` (dtype D), ``int8``, ``int4``; ``weights`` is always passed, ``kv`` only
when not ``dense`` (so dense-KV rows run on an hx without that keyword). A setting the installed
hx refuses (``TypeError`` or ``HxError`` from ``load`` or ``Engine``) is reported "not available"
rather than stopping the run. Each runs through hx's real executor under a plan
(``--policy``, default all-accelerator; ``hx.policies.build`` for another) and teacher-forced:
HEAD gives the logits of a step's last position only, so t_0 is a 1-token prefill step and
every t_i (i = 1 .. N-2) a decode step at position i, each step's logits scoring the true next
token t_{i+1}: N-1 positions, every next token of the text.

- perplexity = exp(mean over i = 0 .. N-2 of -log softmax(logits_i)[t_{i+1}]), natural log;
- top-1 agreement = the fraction of those N-1 positions whose argmax equals the float32 dense
  row's argmax (the reference, always run first);
- top-1 accuracy = the fraction whose argmax is the true next token;
- tok/s: hx, teacher-forced decode steps per second (the N-2 after the first, one row); llama.cpp,
  tokens per second of its one batched evaluation (a prefill): not comparable.

hx's NLLs are computed on HEAD's device (float32 log-sum-exp, one small jitted function per step,
read back after the last step), llama.cpp's in float64 from its float32 logits.

llama.cpp rows (``--llama-python``: an interpreter with ``llama-cpp-python``, as
``scripts/bench_peers.py`` takes it; a benchmark-only dependency, not hx's: e.g.
``python3 -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python numpy``, a build
from source of about 15 minutes on the 2-core VM; 0.3.36 was measured): the same token ids
evaluated in one ``Llama.eval`` with ``logits_all=True`` (every position's logits), scored with
the same formula (in float64) -- not llama.cpp's ``llama-perplexity`` tool, which scores only the
second half of each context window. The GGUFs: the shipped one (Q4_1 with a Q8_0 token
embedding), an F32 copy (``scripts/f32_gguf.py``: the very weights hx's ``dense`` rows compute
with), and Q8_0 and Q4_0 files that REQUANTIZE the shipped Q4_1 weights (dequantized to float32,
then quantized with ``gguf.quants.quantize``; the Q8_0 token embedding and the float32 norms are
copied as they are), so Q8_0 is within rounding of Q4_1's values, and Q4_0 loses on top of
Q4_1: neither is the original model quantized. This script runs itself as the llama.cpp worker
(``--llama-cpp-worker``), which imports only numpy and llama_cpp.

Output: a table on stdout; ``--json PATH`` writes the rows and the run's settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT / "data" / "accuracy" / "alice-chapter1.txt"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One hx row: ``hx.load(None, dtype=dtype, weights=weights, kv=kv)``."""

    name: str
    dtype: str
    weights: str = "dense"
    kv: str = "dense"

    def load_kwargs(self) -> dict:
        """Keywords of ``hx.load``: ``weights`` always (hx's default, ``auto``, keeps a GGUF's
        blocks), ``kv`` only where not dense (so dense-KV rows run on an hx without it; hx's
        default, ``auto``, then holds a GGUF's ggml path in float16, the row's KV says)."""
        kwargs: dict = {"dtype": self.dtype, "weights": self.weights}
        if self.kv != "dense":
            kwargs["kv"] = self.kv
        return kwargs


REFERENCE = Setting("f32", "float32")
SETTINGS = [
    REFERENCE,
    Setting("bf16", "bfloat16"),
    Setting("int8", "float32", weights="int8"),
    Setting("int4", "float32", weights="int4"),
    Setting("gguf", "float32", weights="auto"),  # the shipped GGUF's Q4_1 (and Q8_0) blocks
    Setting("q8_0", "float32", weights="q8_0"),
    Setting("q4_0", "float32", weights="q4_0"),
    Setting("kv-int8", "float32", kv="int8"),
    Setting("kv-int4", "float32", kv="int4"),
    Setting("gguf+kv-int8", "float32", weights="auto", kv="int8"),
]
# (name, how the file is made) of the llama.cpp rows
LLAMA_FILES = [("F32", "f32"), ("Q8_0", "Q8_0"), ("Q4_1", "shipped"), ("Q4_0", "Q4_0")]


# -- scoring (numpy only: shared with the llama.cpp worker) -----------------------------------

def score_logits(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: negative log-likelihood of ``targets`` (float64) and the argmax.

    Args:
      logits: (P, V) logits of P positions; targets: (P,) the true next tokens.
    """
    x = logits.astype(np.float64)
    top = x.max(axis=1)
    log_z = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return log_z - x[np.arange(len(targets)), targets], logits.argmax(axis=1)


def summary(nll: np.ndarray, argmax: np.ndarray, ids: np.ndarray,
            reference: np.ndarray | None) -> dict:
    """Perplexity, mean NLL, top-1 accuracy and top-1 agreement with ``reference``'s argmax."""
    return {"perplexity": float(math.exp(nll.mean())), "mean_nll": float(nll.mean()),
            "top1_accuracy": float((argmax == ids[1:]).mean()),
            "top1_agreement": None if reference is None else float((argmax == reference).mean())}


# -- llama.cpp worker (runs under --llama-python; imports neither hx nor JAX) -----------------

def llama_cpp_worker(model: str, ids_file: str, threads: int) -> None:
    """Evaluate the ids of ``ids_file`` (JSON list) with llama.cpp, every position's logits;
    print one JSON line: per-position NLL and argmax, seconds, the library's version."""
    import llama_cpp
    from llama_cpp import Llama

    ids = json.loads(Path(ids_file).read_text())
    n = len(ids)
    llm = Llama(model_path=model, n_ctx=n + 64, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    start = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - start
    logits = np.asarray(llm.scores[:n - 1], dtype=np.float32)
    nll, argmax = score_logits(logits, np.asarray(ids[1:]))
    print(json.dumps({"nll": nll.tolist(), "argmax": argmax.tolist(), "seconds": seconds,
                      "llama_cpp_version": getattr(llama_cpp, "__version__", "?")}))


# -- GGUF files for llama.cpp ------------------------------------------------------------------

def write_requantized(source: str, target: str, qtype_name: str) -> None:
    """Copy ``source`` (the shipped Q4_1 GGUF) to ``target`` with its Q4_1 tensors dequantized
    to float32 and quantized to ``qtype_name`` (Q8_0 or Q4_0) by ``gguf.quants.quantize``; every
    other tensor (the Q8_0 token embedding, the float32 norms) copied as it is; the file type
    set to match; all other metadata unchanged."""
    import gguf
    from f32_gguf import rewrite_gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]

    def convert(tensor):
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            return tensor.data, tensor.tensor_type
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        return gguf.quants.quantize(values, qtype), qtype

    rewrite_gguf(source, target, gguf.LlamaFileType[f"MOSTLY_{qtype_name}"], convert)


def llama_cpp_rows(python: str, ids: list[int], reference: np.ndarray, threads: int) -> list:
    """One row per ``LLAMA_FILES`` entry, each file written to a temporary folder, evaluated
    by this script's worker under ``python`` and deleted."""
    from f32_gguf import write_f32

    from hx.models.loader import default_model_path

    source, rows = default_model_path(), []
    with tempfile.TemporaryDirectory(prefix="hx-accuracy-") as folder:
        ids_file = os.path.join(folder, "ids.json")
        Path(ids_file).write_text(json.dumps(ids))
        for name, how in LLAMA_FILES:
            path = source if how == "shipped" else os.path.join(folder, f"smollm2-{name}.gguf")
            row = {"setting": f"llama.cpp {name}", "engine": "llama.cpp", "weights": name,
                   "kv": "F16", "dtype": "-",
                   "file": "shipped" if how == "shipped" else f"{how} of the shipped Q4_1"}
            try:
                if how == "f32":
                    write_f32(source, path)
                elif how != "shipped":
                    write_requantized(source, path, how)
                done = subprocess.run([python, os.path.abspath(__file__), "--llama-cpp-worker",
                                       path, ids_file, str(threads)],
                                      capture_output=True, text=True, check=True)
            except subprocess.CalledProcessError as e:
                row.update(status=f"failed: {e.stderr.strip().splitlines()[-1:]}")
                rows.append(row)
                continue
            finally:
                if how != "shipped" and os.path.exists(path):
                    written = os.path.getsize(path)
                    os.remove(path)
                    row["file_bytes"] = written
            out = json.loads(done.stdout)
            nll, argmax = np.asarray(out["nll"]), np.asarray(out["argmax"])
            row.update(summary(nll, argmax, np.asarray(ids), reference),
                       status="ok", seconds=out["seconds"],
                       tok_s=len(ids) / out["seconds"],
                       llama_cpp_version=out["llama_cpp_version"])
            rows.append(row)
            print(f"{row['setting']}: perplexity {row['perplexity']:.4f}", file=sys.stderr)
    return rows


# -- hx ---------------------------------------------------------------------------------------

def teacher_forced(engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
    """Run ``ids`` through ``engine``'s executor one token per step (a 1-token prefill, then
    decode steps) and score each step's logits against the next id.

    Returns:
      (NLL (N-1,) float64, argmax (N-1,), seconds of the N-2 decode steps).
    """
    import jax
    import jax.numpy as jnp

    from hx.models.layers import Step
    from hx.workload import CACHE_BUCKET, Workload, round_up

    ex = engine.executor
    n = len(ids)
    slots = round_up(n, CACHE_BUCKET)
    engine.check(Workload(1, 1, slots))
    ex.compile("prefill", 1, 1, slots)
    ex.compile("decode", 1, 1, slots)

    @jax.jit
    def score(logits, target):
        """NLL of ``target`` under (1, V) logits (float32 log-sum-exp) and the argmax."""
        row = logits[0].astype(jnp.float32)
        return jax.nn.logsumexp(row) - row[target], jnp.argmax(row)

    def step(i: int) -> Step:
        return Step(np.array([[i]], np.int32), np.int32(i), np.zeros(1, np.int32))

    caches = ex.new_cache(1, slots)
    scores = []
    try:
        start = 0.0
        for i in range(n - 1):
            phase = "prefill" if i == 0 else "decode"
            logits, caches = ex.run(phase, np.array([[ids[i]]], np.int32), step(i), caches)
            scores.append(score(logits, np.int32(ids[i + 1])))
            if i == 0:  # the scorer compiles here: time the N-2 steps after
                jax.block_until_ready(scores[0])
                start = time.perf_counter()
        nll = np.array([float(s[0]) for s in scores], np.float64)
        argmax = np.array([int(s[1]) for s in scores], np.int64)
        return nll, argmax, time.perf_counter() - start
    finally:
        ex.release_cache()


def run_setting(setting: Setting, ids: list[int], reference: np.ndarray | None, args,
                devices) -> tuple[dict, np.ndarray | None]:
    """One hx row (``status`` "not available: ..." where the installed hx refuses it) and its
    argmax (None when it did not run)."""
    import hx
    from hx.workload import CACHE_BUCKET, Workload, round_up

    row = {"setting": setting.name, "engine": "hx", "dtype": setting.dtype,
           "weights": setting.weights, "kv": setting.kv}
    start = time.perf_counter()
    try:
        model = hx.load(None, **setting.load_kwargs())
        row["kv"] = model.spec.kv_format  # as held: ``auto`` gives float16 under ggml
        plan = None
        if args.policy != "all-accelerator":
            plan = hx.policies.build(args.policy, model.spec, devices,
                                     Workload(1, 1, round_up(len(ids), CACHE_BUCKET)))
        engine = hx.Engine(model, plan, devices)
        del model  # the engine holds the weights where the plan put them
    except (TypeError, hx.HxError) as e:
        row["status"] = f"not available: {type(e).__name__}: {e}"
        print(f"{setting.name}: {row['status']}", file=sys.stderr)
        return row, None
    row["plan"] = engine.plan.name
    nll, argmax, seconds = teacher_forced(engine, ids)
    row.update(summary(nll, argmax, np.asarray(ids), reference), status="ok",
               seconds=seconds, tok_s=(len(ids) - 2) / seconds,
               total_seconds=time.perf_counter() - start)
    print(f"{setting.name}: perplexity {row['perplexity']:.4f} ({seconds:.0f} s)",
          file=sys.stderr)
    return row, argmax


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--tokens", type=int, help="score only the first N tokens")
    parser.add_argument("--settings", default=",".join(s.name for s in SETTINGS),
                        help="hx rows to run (f32, the reference, always runs)")
    parser.add_argument("--policy", default="all-accelerator",
                        help="the plan: a policy of hx.policies.build")
    parser.add_argument("--accelerator-memory", help="the accelerator budget (e.g. 128MiB)")
    parser.add_argument("--llama-python", help="python with llama_cpp, for the llama.cpp rows")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    by_name = {s.name: s for s in SETTINGS}
    chosen = [REFERENCE] + [by_name[n] for n in args.settings.split(",")
                            if n and n != REFERENCE.name]

    from hx.devices import configure_runtime

    configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

    from rich.markup import escape
    from rich.table import Table

    import hx
    from hx.cli.console import print_table
    from hx.models.gguf_loader import open_gguf, read_metadata
    from hx.models.loader import default_model_path
    from hx.models.tokenizer import Tokenizer

    text = Path(args.text).read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(default_model_path())),
                                             default_model_path())
    ids = tokenizer.encode(text)[:args.tokens]
    devices = hx.discover(accelerator_memory=args.accelerator_memory)
    threads = os.cpu_count() or 1

    rows, reference = [], None
    for setting in chosen:
        row, argmax = run_setting(setting, ids, reference, args, devices)
        if setting is REFERENCE:
            reference = argmax
            row["top1_agreement"] = 1.0
        rows.append(row)
    if args.llama_python:
        rows += llama_cpp_rows(args.llama_python, ids, reference, threads)

    ref_ppl = rows[0]["perplexity"]
    table = Table(title=f"SmolLM2-135M-Instruct, teacher-forced perplexity over {len(ids) - 1} "
                        f"next tokens of {Path(args.text).name}, plan {escape(args.policy)} "
                        f"{escape('[' + devices.describe() + ']')}")
    for col in ("setting", "engine", "dtype", "weights", "KV", "perplexity", "vs f32",
                "top-1 agree", "top-1 acc", "tok/s", "status"):
        table.add_column(col, justify="right" if col not in ("setting", "status") else "left")
    for r in rows:
        ok = r.get("status") == "ok"
        agree = r.get("top1_agreement")
        table.add_row(r["setting"], r["engine"], r["dtype"], r["weights"], r["kv"],
                      f"{r['perplexity']:.4f}" if ok else "-",
                      f"{100 * (r['perplexity'] / ref_ppl - 1):+.2f} %" if ok else "-",
                      f"{100 * agree:.2f} %" if ok and agree is not None else "-",
                      f"{100 * r['top1_accuracy']:.2f} %" if ok else "-",
                      f"{r['tok_s']:.1f}" if ok else "-", escape(r["status"]))
    print_table(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "text": os.path.relpath(args.text, ROOT),
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": len(ids), "positions_scored": len(ids) - 1, "policy": args.policy,
            "devices": devices.describe(), "threads": threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--llama-cpp-worker"]:
        if len(sys.argv) != 5:
            sys.exit("usage: accuracy.py --llama-cpp-worker MODEL.gguf IDS.json THREADS")
        llama_cpp_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
