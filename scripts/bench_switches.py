"""Device switches: JAX's floor, the executor's cost, and host compute inside one program.

Usage: python scripts/bench_switches.py [-m smollm2-135m] [--batches 1,16] [--context 512]
                                        [--json out/switches.json]

Takes about 15 s on the 2-core development VM (13 s measured, defaults).

Three measurements on the devices ``hx.discover`` finds (say which; an emulated accelerator is
a second XLA CPU device, and its figures are not GPU figures):

1. **Floor**: JAX's bare round trip of a (B, d_model) float32 activation, accelerator op ->
   ``device_put`` to the host CPU device -> host op -> ``device_put`` back -> accelerator op.
2. **Executor**: its decode steps of a tiny model under plans of 1 to 121 segments
   (``calibrate.dispatch_plans``); the least-squares slope of step time over device switches
   is its cost per switch, two switches make an excursion, compared with the floor at batch 1.
3. **Paths for host ops** at the model's shapes (float32), each timed as a whole step
   (accelerator op before and after, waited for), interleaved, medians:

   * ``accelerator``: one accelerator program, weights resident (no switch: the baseline);
   * ``host segment``: as the executor runs a host op today -- ``device_put`` to the host CPU
     device, a jitted host program with its weights there, ``device_put`` back;
   * ``host region``: one accelerator program with the op as a
     ``jax.experimental.compute_on`` ``device_host`` region reading weights (MLP1) or the KV
     cache (SCORE) from the accelerator's ``pinned_host`` memory;
   * MLP1 also ``streamed``: weights copied from ``pinned_host`` by a separate ``device_put``
     before the program (the executor's staging) vs ``in-program``: one program whose
     ``device_put`` to device memory streams them (as MaxText offloads parameters).

   SCORE attends one new token over ``context`` cached positions (GQA, softmax in float32);
   MLP1 is RMS norm, gate and up projections and SiLU. The work is the same on every path, so
   path - accelerator is what the switch costs there.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import SingleDeviceSharding
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hx.devices import configure_runtime

configure_runtime()  # before JAX starts: two CPU devices where there is no GPU

import hx  # noqa: E402
from hx.cli.console import print_table
from hx.devices import ACCELERATOR, HOST
from hx.measure import profiler
from hx.measure.calibrate import dispatch_plans, observe_interleaved
from hx.measure.timing import stable_seconds
from hx.models.spec import PRESETS, ModelSpec
from hx.segments import split_segments


def host_region(f):
    """``f`` as a ``device_host`` compute region of the enclosing accelerator program, its
    outputs in host memory (jax >= 0.11 takes the function and requires
    ``out_memory_spaces``; jax 0.10 takes the compute type and decorates a jitted ``f``)."""
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(f, compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")(jax.jit(f))


def to_device(x):
    """Inside a program: ``x`` into the accelerator's device memory."""
    return jax.device_put(x, jax.memory.Space.Device)


def to_host(x):
    """Inside a program: ``x`` into the accelerator's host (pinned) memory."""
    return jax.device_put(x, jax.memory.Space.Host)


def mlp1(x, w):
    """RMS norm, gate and up projections, SiLU: (B, D) -> (B, F)."""
    scale, gate, up = w
    xn = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale
    return jax.nn.silu(xn @ gate) * (xn @ up)


def score(q, cache):
    """One new token's GQA attention over the cache: q (B, H, E), k/v (B, S, K, E) -> (B, H*E)."""
    k, v = cache
    B, H, E = q.shape
    K = k.shape[2]
    qg = q.reshape(B, K, H // K, E)
    logits = jnp.einsum("bkge,bske->bkgs", qg, k) / math.sqrt(E)
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.einsum("bkgs,bske->bkge", p, v).reshape(B, H * E)


@jax.jit
def touch(x):
    """The tiny accelerator op before and after every path."""
    return x + 1.0


def paths(spec: ModelSpec, devices, batch: int, context: int) -> dict[str, callable]:
    """Callables, each one whole step of one path (see the module doc)."""
    acc, host = devices[ACCELERATOR], devices[HOST]
    pinned = SingleDeviceSharding(acc, memory_kind="pinned_host")
    device_memory = SingleDeviceSharding(acc, memory_kind="device")
    rng = np.random.default_rng(0)
    D, F, H, K, E = spec.d_model, spec.d_ff, spec.n_heads, spec.n_kv_heads, spec.head_dim

    def arrays(*shapes):
        return tuple((rng.random(s, np.float32) - 0.5) * np.float32(0.1) for s in shapes)

    weights = arrays((D,), (D, F), (D, F))
    cache = arrays((batch, context, K, E), (batch, context, K, E))
    x = jax.device_put(arrays((batch, D))[0], acc)
    q = jax.device_put(arrays((batch, H, E))[0], acc)
    on = {"acc": lambda t: jax.device_put(t, device_memory), "host": lambda t: jax.device_put(t, host),
          "pinned": lambda t: jax.device_put(t, pinned)}
    w_acc, w_host, w_pinned = on["acc"](weights), on["host"](weights), on["pinned"](weights)
    c_acc, c_host, c_pinned = on["acc"](cache), on["host"](cache), on["pinned"](cache)
    mlp1_jit, score_jit = jax.jit(mlp1), jax.jit(score)

    @jax.jit
    def mlp1_accelerator(x, w):
        return touch(mlp1(touch(x), w))

    @jax.jit
    def score_accelerator(q, c):
        return touch(score(touch(q), c))

    @jax.jit
    def mlp1_region(x, w):
        return touch(to_device(host_region(mlp1)(to_host(touch(x)), w)))

    @jax.jit
    def score_region(q, c):
        return touch(to_device(host_region(score)(to_host(touch(q)), c)))

    @jax.jit
    def mlp1_in_program(x, w):
        return touch(mlp1(touch(x), to_device(w)))

    def segment(kernel, a, held):  # the executor's host segment: out, compute, back
        return touch(jax.device_put(kernel(jax.device_put(touch(a), host), held), acc))

    return {
        "MLP1 accelerator": lambda: mlp1_accelerator(x, w_acc),
        "MLP1 host segment": lambda: segment(mlp1_jit, x, w_host),
        "MLP1 host region": lambda: mlp1_region(x, w_pinned),
        "MLP1 streamed": lambda: mlp1_accelerator(x, on["acc"](w_pinned)),
        "MLP1 in-program": lambda: mlp1_in_program(x, w_pinned),
        "SCORE accelerator": lambda: score_accelerator(q, c_acc),
        "SCORE host segment": lambda: segment(score_jit, q, c_host),
        "SCORE host region": lambda: score_region(q, c_pinned),
        "round trip (tiny op)": lambda: touch(
            jax.device_put(touch(jax.device_put(touch(x), host)), acc)),
    }


def executor_switch_cost(devices) -> tuple[float, float]:
    """(seconds per device switch of the executor, R^2): least-squares slope of the tiny
    model's decode step over its switches per step, batch 1."""
    spec = profiler.TINY
    plans = dispatch_plans(spec.n_layers)
    seen = observe_interleaved(spec, profiler._random_params(spec), plans, (1,), devices)
    xs = [len(split_segments(p, "decode")) - 1 for p in plans]
    ys = [seen[(p, 1)] for p in plans]
    slope, intercept = np.polyfit(xs, ys, 1)
    fitted = np.polyval([slope, intercept], xs)
    r2 = 1 - float(np.sum((np.array(ys) - fitted) ** 2) / np.sum((ys - np.mean(ys)) ** 2))
    return float(slope), r2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m", help="preset whose shapes "
                        "the paths use (a :NL suffix is ignored)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=512, help="KV positions SCORE reads")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    spec = PRESETS[args.model.split(":")[0]]
    devices = hx.discover()
    console = Console()
    where = devices.describe()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        cases = paths(spec, devices, batch, args.context)
        timings = stable_seconds(*cases.values(), window=7, max_rounds=60, max_seconds=10.0)
        for name, t in zip(cases, timings):
            rows.append({"case": name, "batch": batch, "seconds": t.seconds,
                         "spread": t.spread})
    per_switch, r2 = executor_switch_cost(devices)
    floor = next(r["seconds"] for r in rows if r["batch"] == min(r["batch"] for r in rows)
                 and r["case"].startswith("round trip"))

    table = Table(title=f"device switches, {spec.name} shapes, float32, context "
                        f"{args.context}; median us of a whole step " + escape(f"[{where}]"))
    for col in ("case", "batch", "us", "vs accelerator us", "spread"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        base = next((b["seconds"] for b in rows if b["batch"] == r["batch"]
                     and b["case"] == r["case"].split()[0] + " accelerator"), None)
        extra = "-" if base is None or r["case"].endswith("accelerator") else \
            f"{(r['seconds'] - base) * 1e6:+.0f}"
        r["minus_accelerator_s"] = None if extra == "-" else r["seconds"] - base
        table.add_row(r["case"], str(r["batch"]), f"{r['seconds'] * 1e6:.0f}", extra,
                      f"{r['spread']:.0%}")
    print_table(table)
    console.print(f"executor: {per_switch * 1e6:.0f} us per device switch (tiny model, R^2 "
                  f"{r2:.2f}), {2 * per_switch * 1e6:.0f} us per excursion = "
                  f"{2 * per_switch / floor:.2f}x the bare round trip ({floor * 1e6:.0f} us)",
                  soft_wrap=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "devices": where, "jax": jax.__version__, "model": spec.name,
            "context": args.context, "rows": rows,
            "executor_seconds_per_switch": per_switch, "executor_fit_r2": r2,
            "bare_round_trip_s": floor,
            "executor_excursion_over_floor": 2 * per_switch / floor}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
