"""Pipeline stages in two processes joined by ``jax.distributed`` (issue 28 acceptance B):
each process runs one stage on its own (emulated) accelerator, the residual stream and the
logits crossing between them by a gloo collective, against the same plan in one process.

Usage: python scripts/pp_processes.py [--model tiny|smollm2-135m|llama2-7b:2L|PATH]
           [--plans all-accelerator,kv-host-odd,stream-all] [--decode 6] [--json OUT.json]

``--model tiny`` (the default) is a 4-layer random model; a preset name with ``:NL`` runs
random weights of its shapes; any other name is loaded with ``hx.load`` (``smollm2-135m``: the
shipped GGUF, its tokenizer and its greedy text of "The capital of France is"). For each plan
(everything on the accelerators; KV caches on the host in odd layers; stream-all: weights
streamed, attention on the host): two worker processes (``--process-id 0`` and ``1`` of this
script, a localhost coordinator on a free port) each write their prefill logits and greedy
tokens; this process runs the plan as two stages in one process (``stage_devices``) and on
one accelerator.
Printed: the largest logit difference of each process's logits from the one-process pipeline's
and from one accelerator's, relative to the largest logit, and whether greedy tokens agree.
Exit status 1 when any difference exceeds 1e-5 or any tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

TEXT = "The capital of France is"


def build(name: str, plan_name: str):
    """(model, prompts as token ids, plan) of ``name``: a random one
    (``mesh_exactness.random_model``), or ``hx.load``'s."""
    from mesh_exactness import PROMPTS, NoText, random_model, checked_plans

    from hx.models.loader import Model, load

    if name == "tiny" or ":" in name:
        spec, params = random_model(name)
        model, prompts = Model(spec, params, NoText(), spec.name), PROMPTS
    else:
        model = load(None if name == "smollm2-135m" else name, "float32")
        prompts = [model.tokenizer.encode(TEXT)]
    return model, prompts, checked_plans(model.spec.n_layers)[plan_name]


def run(engine, prompts, decode: int) -> dict:
    """Prefill logits and greedy tokens (and text) of ``engine``."""
    from hx.sampling import SamplingParams

    logits = engine.last_logits(prompts)
    done = engine.generate_ids(prompts, SamplingParams(max_new_tokens=decode))
    return {"logits": np.asarray(logits).tolist(), "tokens": [c.token_ids for c in done],
            "text": [c.text for c in done],
            "peaks": [a.peak for a in getattr(engine.accountant, "accountants",
                                              [engine.accountant])]}


def worker(args) -> int:
    """One process of two: its stage, on its own accelerator; the result as JSON in
    ``args.out``."""
    from hx.distributed import initialize, process_devices

    initialize(args.coordinator, 2, args.process_id)
    from hx.devices import discover
    from hx.generate import Engine

    model, prompts, plan = build(args.model, args.plans)
    engine = Engine(model, plan, process_devices(discover()))
    with open(args.out, "w") as f:
        json.dump({"process": args.process_id, **run(engine, prompts, args.decode)}, f)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--plans", default="all-accelerator,kv-host-odd,stream-all")
    parser.add_argument("--decode", type=int, default=6)
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--process-id", type=int, help="(a worker: which of the two)")
    parser.add_argument("--coordinator", help="(a worker: the coordinator's host:port)")
    parser.add_argument("--out", help="(a worker: where its JSON goes)")
    args = parser.parse_args()
    if args.process_id is not None:
        return worker(args)

    from hx.devices import discover
    from hx.generate import Engine
    from hx.pipeline import stage_devices

    found = discover(accelerators=2)
    rows = []
    scratch = tempfile.mkdtemp(prefix="hx-pp-")
    for plan_name in args.plans.split(","):
        coordinator = f"localhost:{free_port()}"
        outs = [os.path.join(scratch, f"{plan_name}-{p}.json") for p in (0, 1)]
        logs = [open(os.path.join(scratch, f"{plan_name}-{p}.log"), "w") for p in (0, 1)]
        workers = [subprocess.Popen(
            [sys.executable, __file__, "--model", args.model, "--plans", plan_name,
             "--decode", str(args.decode), "--process-id", str(p), "--coordinator",
             coordinator, "--out", outs[p]], stdout=logs[p], stderr=subprocess.STDOUT)
            for p in (0, 1)]
        model, prompts, plan = build(args.model, plan_name)
        together = run(Engine(model, plan, stage_devices(found, 2)), prompts, args.decode)
        one = run(Engine(model, plan, discover()), prompts, args.decode)
        results = []
        for p, proc in enumerate(workers):
            proc.wait(timeout=900)
            logs[p].close()
            if proc.returncode:
                with open(logs[p].name) as f:
                    print(f"process {p} failed:\n{f.read()[-3000:]}", file=sys.stderr)
                return 1
            with open(outs[p]) as f:
                results.append(json.load(f))
        scale = float(np.abs(np.array(one["logits"])).max())
        for r in results:
            got = np.array(r["logits"])
            row = {"plan": plan_name, "process": r["process"],
                   "vs_one_process": float(np.abs(got - np.array(together["logits"])).max())
                   / scale,
                   "vs_one_accelerator": float(np.abs(got - np.array(one["logits"])).max())
                   / scale,
                   "tokens_equal": r["tokens"] == together["tokens"] == one["tokens"],
                   "text": r["text"], "peaks": r["peaks"], "one_process_peaks":
                   together["peaks"]}
            rows.append(row)
            print(f"{plan_name} process {r['process']}: logits vs one process "
                  f"{row['vs_one_process']:.2e}, vs one accelerator "
                  f"{row['vs_one_accelerator']:.2e}, greedy "
                  f"{'equal' if row['tokens_equal'] else 'DIFFERENT'} {r['text']!r}, "
                  f"peak {r['peaks']} (one process, by stage: {together['peaks']})",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)
    return 0 if all(r["vs_one_process"] <= 1e-5 and r["vs_one_accelerator"] <= 1e-5
                    and r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
