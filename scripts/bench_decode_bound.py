"""How fast can a batch-1 SmolLM2 decode step on this host be with its GGUF's blocks kept
compressed? The step's products alone, per kernel, against hx's whole step.

Usage: python scripts/bench_decode_bound.py [--rounds 5] [--json OUT.json]

Takes about 3 minutes on the 2-core development VM (two ``hx bench`` runs of about a minute
each, then the product stacks).

Issue 26 asks a batch-1 decode with the weights kept compressed to run at >= 1.5x hx's float32
path. A step is its products (the matrices of 30 layers and the LM head, 134.5 M weights:
540 MB in float32, 85 MB in Q4_1/Q8_0) plus everything else (norms, RoPE, attention, residuals,
the executor). This script times, one row of float32 activations:

* ``step``: hx's own decode step, all ops on the host (``hx bench --plans all-host --batches 1
  --weights dense|auto --dtype float32``; the GGUF's blocks are ``auto``);
* ``products``: one jitted program holding only the step's products, layer after layer, each
  taking the previous one's output (so none is skipped and no weight stays in cache between
  steps), with hx's own ``models.llama.product`` and ``dequantize`` (each matrix decompressed
  right before its product): float32 dense, and the Q4_1 layers + Q8_0 head decompressed to
  float32 and to bfloat16;
* the same products with torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, bfloat16
  activations and scales: approximate, ~3e-3 relative error) called straight from Python with
  no JAX around it -- a lower bound for any way hx could call it -- per matrix and with Q, K, V
  and MLP1's two matrices fused (4 calls a layer), on 1 and 2 threads; its LM head is the same
  int4 kernel (torch has no group-wise int8 kernel, so this undercounts a Q8_0 head).

The bound: best step = dense step - dense products + fastest products; the target is dense step
/ 1.5. Medians of ``--rounds`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's threads otherwise spin beside XLA

from hx.devices import configure_runtime  # noqa: E402

configure_runtime()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from hx.models.formats import FORMATS, quantize  # noqa: E402
from hx.models.llama import dequantize, product  # noqa: E402

LAYERS, D, KV, FF, VOCAB = 30, 576, 192, 1536, 49152  # SmolLM2-135M
LAYER = {"Q": (D, D), "K": (KV, D), "V": (KV, D), "OUT": (D, D), "gate": (FF, D),
         "up": (FF, D), "down": (D, FF)}
FUSED = {"QKV": (D + 2 * KV, D), "OUT": (D, D), "gate_up": (2 * FF, D), "down": (D, FF)}


def chain(y, n: int):
    """The next product's input (1, n) from the last output y: y's values tiled to n."""
    return jnp.tile(y, (1, -(-n // y.shape[1])))[:, :n]


def xla_products(layers, head, fmt_layer, fmt_head, dtype):
    """A jitted step of products: ``layers`` [{name: matrix or held arrays}], ``head``."""
    def matrix(held, shape, fmt, after):
        return held if fmt is None else dequantize(held, fmt, shape, dtype, after=after)

    def step(x, layers, head):
        y = x
        for layer in layers:
            for name, shape in LAYER.items():
                inp = chain(y, shape[1])
                y = product(inp.astype(dtype), matrix(layer[name], shape, fmt_layer, inp))
        n = chain(y, D)
        return product(n.astype(dtype), matrix(head, (VOCAB, D), fmt_head, n))
    return jax.jit(step)


def torch_products(shapes, threads: int):
    """Products of int4pack weights of ``shapes`` per layer + the head, called from Python."""
    def pack(shape):
        q = torch.randint(0, 16, shape, dtype=torch.int32)
        return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                torch.randn(shape[1] // 32, shape[0], 2, dtype=torch.bfloat16) * 0.01)
    layers = [[pack(s) for s in shapes.values()] for _ in range(LAYERS)]
    head = pack((VOCAB, D))

    def step(x):
        torch.set_num_threads(threads)
        y = x
        for layer in layers:
            for (w, sz), (_, n_in) in zip(layer, shapes.values()):
                inp = y.repeat(1, -(-n_in // y.shape[1]))[:, :n_in].contiguous()
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(inp, w, 32, sz)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(y[:, :D].contiguous(), head[0], 32,
                                                           head[1])
    return step


def hx_step(weights: str) -> float:
    """Median seconds of hx's all-host batch-1 decode step (``hx bench``) with ``weights``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "hx", "bench", "--plans", "all-host", "--batches",
                        "1", "--dtype", "float32", "--weights", weights, "--steps", "32",
                        "--json", out.name], check=True, capture_output=True)
        rows = json.load(open(out.name))["rows"]
    return rows[0]["executor_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    dense = [{k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)
              for k, s in LAYER.items()} for _ in range(LAYERS)]
    dense_head = jnp.asarray(rng.standard_normal((VOCAB, D), np.float32) * 0.02)
    q41, q80 = FORMATS["q4_1"], FORMATS["q8_0"]
    comp = [{k: jax.tree.map(jnp.asarray, quantize(np.asarray(w), q41)) for k, w in l.items()}
            for l in dense]
    comp_head = jax.tree.map(jnp.asarray, quantize(np.asarray(dense_head), q80))
    x = jnp.asarray(rng.standard_normal((1, D), np.float32))
    xt = torch.randn(1, D, dtype=torch.bfloat16)
    cases = {
        "xla f32 dense": (xla_products(dense, dense_head, None, None, jnp.float32), (x, dense,
                                                                                   dense_head)),
        "xla q4_1/q8_0 -> f32": (xla_products(comp, comp_head, q41, q80, jnp.float32),
                                 (x, comp, comp_head)),
        "xla q4_1/q8_0 -> bf16": (xla_products(comp, comp_head, q41, q80, jnp.bfloat16),
                                  (x, comp, comp_head)),
    }
    for threads in (1, 2):
        for label, shapes in (("7 calls/layer", LAYER), ("4 calls/layer", FUSED)):
            cases[f"torch int4pack {threads}T {label}"] = (torch_products(shapes, threads), (xt,))
    times = {k: [] for k in cases}
    for f, a in cases.values():
        jax.block_until_ready(f(*a))
    for _ in range(args.rounds):
        for k, (f, a) in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[k].append(time.perf_counter() - t0)
    torch.set_num_threads(2)
    steps = {w: hx_step(w) for w in ("dense", "auto")}
    products = {k: statistics.median(v) for k, v in times.items()}
    rest = steps["dense"] - products["xla f32 dense"]
    best = min(products, key=products.get)
    bound = rest + products[best]
    print(f"{'what':40s} {'ms':>8s}")
    for k, v in products.items():
        print(f"products, {k:30s} {v * 1e3:8.2f}")
    for w, s in steps.items():
        print(f"hx step all-host, weights {w:14s} {s * 1e3:8.2f}")
    print(f"step minus its products (dense)          {rest * 1e3:8.2f}")
    print(f"best step ({best}): {bound * 1e3:.2f} ms = {steps['dense'] / bound:.2f}x the dense "
          f"step; the target 1.5x needs {steps['dense'] / 1.5 * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"products_s": products, "steps_s": steps, "rest_s": rest,
                       "best": best, "bound_s": bound, "rounds": args.rounds,
                       "load_average_1min": os.getloadavg()[0], "jax": jax.__version__,
                       "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
