"""Host attention kernels: XLA's blocked kernel vs hx's numpy kernel, one decode step.

Usage: python scripts/bench_host_attention.py [--runs 7] [--json OUT.json]

Takes about 20 s on the 2-core development VM (17 s measured, defaults).

On the host CPU device: one query per row over the used prefix of a (B, S, K, E) KV cache,
float32 and bfloat16, at SmolLM2-135M and Llama-2-7B decode shapes.
``host_compute.xla_attention.blocked_attention`` (jitted, the cache an XLA array) against
``host_compute.attention.cache_attention`` (numpy over views of the same XLA buffers). Prints
a table of median milliseconds and the KV bytes read per second (the used prefix, both K and
V); ``attention.NUMPY_MIN_BYTES`` is where hx switches from the first to the second.
"""

from __future__ import annotations

import argparse
import json

from hx.devices import configure_runtime

configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import jax
import numpy as np
from rich.table import Table

from hx.cli.console import print_table
from hx.devices import discover
from hx.host_compute.attention import attends_in_numpy, cache_attention, threads
from hx.host_compute.xla_attention import blocked_attention
from hx.measure.timing import median_seconds
from hx.models.layers import Step

SHAPES = {  # name: (B, S slots, used, K, H, E)
    "SmolLM2 b1": (1, 192, 132, 3, 9, 64),
    "SmolLM2 b16": (16, 192, 132, 3, 9, 64),
    "Llama-2-7B b8": (8, 576, 544, 32, 32, 128),
    "Llama-2-7B b32": (32, 576, 544, 32, 32, 128),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    host = discover().host.device
    xla = jax.jit(blocked_attention)
    rows = []
    for name, (B, S, used, K, H, E) in SHAPES.items():
        rng = np.random.default_rng(0)
        for dtype in ("float32", "bfloat16"):
            q = jax.device_put(rng.standard_normal((B, 1, H, E), np.float32).astype(dtype), host)
            cache = jax.device_put({n: rng.standard_normal((B, S, K, E), np.float32)
                                    .astype(dtype) for n in ("k", "v")}, host)
            step = jax.device_put(Step(np.zeros((B, 1), np.int32), np.int32(used - 1),
                                       np.zeros((B,), np.int32)), host)
            nbytes = 2 * B * used * K * E * np.dtype(cache["k"].dtype).itemsize
            t_xla = median_seconds(lambda: xla(q, cache, step), args.runs)
            t_np = median_seconds(lambda: cache_attention(q, cache, step), args.runs)
            rows.append({"shape": name, "dtype": dtype, "kv_bytes": nbytes,
                         "xla_s": t_xla, "numpy_s": t_np,
                         "hx_uses": "numpy" if attends_in_numpy(
                             B, S, K, E, np.dtype(cache["k"].dtype).itemsize) else "xla"})
    table = Table(title=f"host attention, one decode step ({threads()} threads)")
    for col in ("shape", "dtype", "KV MB", "XLA ms", "XLA GB/s", "numpy ms", "numpy GB/s",
                "numpy / XLA speed", "hx uses"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["shape"], r["dtype"], f"{r['kv_bytes'] / 1e6:.1f}",
                      f"{r['xla_s'] * 1e3:.2f}", f"{r['kv_bytes'] / r['xla_s'] / 1e9:.1f}",
                      f"{r['numpy_s'] * 1e3:.2f}", f"{r['kv_bytes'] / r['numpy_s'] / 1e9:.1f}",
                      f"{r['xla_s'] / r['numpy_s']:.2f}", r["hx_uses"])
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
