"""Probe: torch's CPU int4 kernel called from inside jitted XLA programs through an XLA FFI
custom call (``int4mm.cc`` beside this file), for a batch-1 SmolLM2-135M step held in Q4_1.

Usage: python scripts/ffi_int4/bench.py [--rounds 15] [--json OUT.json] [--build-dir DIR]
                                        [--step-ms MS]

Builds ``int4mm.cc`` with g++ against torch's and jaxlib's headers into ``--build-dir``
(default /tmp/ffi_int4_build; about 10-15 s, only when the .so is older than the source),
registers its handlers with ``jax.ffi.register_ffi_target`` and measures, medians of
``--rounds`` interleaved rounds:

1. per-call cost inside one jitted program of a tiny (64 x 64) product: the FFI int4 call
   (through ATen's stub writing into XLA's buffer, and through the public op plus a copy), an
   FFI call that does nothing, a plain jitted float32 dot, ``jax.pure_callback`` into torch,
   and torch's op called from Python; the slope between a chain of 1 and of ``CHAIN`` calls;
2. the products of a batch-1 step (30 layers of SmolLM2-135M's shapes + the LM head) as
   one jitted program: XLA float32 dense (7 products a layer, hx's ``models.layers.product``)
   and hx's compressed path (Q4_1 layers and a Q8_0 head decompressed by XLA, to float32 and
   to bfloat16) against the FFI int4 kernel with Q,K,V and gate/up fused (4 calls a layer +
   the head, all int4), bfloat16 activations/scales on 1 and 2 torch threads, float32 activations/scales,
   float32 activations cast to bfloat16 around each call (hx's float32 path would), the LM
   head instead as per-row int8 (FFI ``_weight_int8pack_mm``), float32 or bfloat16 dense or
   Q8_0 decompressed by XLA, and torch straight from Python as the floor;
3. exactness against float64 on the exact dequantized weights of hx-quantized gaussian
   matrices (two layer matrices in Q4_1, the head in Q8_0): max |y - y64| / max |y64| and the
   relative L2 error, for the FFI kernel with bfloat16 and float32 activations, hx's XLA
   float32 and bfloat16 products, and for the head re-quantized to Q4_1 or per-row int8;
   checks that ``int4pack`` (numpy) lays codes out as torch's packer does;
4. whether XLA overlaps independent custom calls (two busy-waits of SPIN_US each) or a custom
   call and an independent XLA dot, and on which thread a custom call runs.

Then the bound: hx's dense all-host step (``hx bench``, run before and after the rest and
averaged, about 15 s each; ``--step-ms`` skips it) minus the dense products plus the fastest
FFI products (and, as hx would need it, with the Q8_0 head kept exact in float32). The whole
run takes about 1.5 minutes on the 2-core development VM (the first time 12 s more to build).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's threads otherwise spin beside XLA

from hx.devices import configure_runtime  # noqa: E402

configure_runtime()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from hx.models.formats import FORMATS, quantize, unpack  # noqa: E402
from hx.models import compressed  # noqa: E402

dequantize = compressed.dequantize_parts


def product(x, w):
    """x (N, in) @ w (out, in)^T in float32 (``models.compressed.product`` of a dense w)."""
    return compressed.product(w, x)

LAYERS, D, KV, FF, VOCAB = 30, 576, 192, 1536, 49152  # SmolLM2-135M
LAYER = {"Q": (D, D), "K": (KV, D), "V": (KV, D), "OUT": (D, D), "gate": (FF, D),
         "up": (FF, D), "down": (D, FF)}
FUSED = {"QKV": (D + 2 * KV, D), "OUT": (D, D), "gate_up": (2 * FF, D), "down": (D, FF)}
GROUP, CHAIN, TINY, SPIN_US = 32, 256, 64, 3000
SRC = Path(__file__).with_name("int4mm.cc")
TARGETS = ("hx_int4mm_stub", "hx_int4mm_op", "hx_int8mm", "hx_noop", "hx_spin")


def build(out_dir: Path) -> tuple[Path, float | None]:
    """The handlers' shared library, compiled when missing or older than the source."""
    so = out_dir / "libhx_int4mm.so"
    if so.exists() and so.stat().st_mtime >= SRC.stat().st_mtime:
        return so, None
    out_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import include_paths, library_paths
    lib = library_paths()[0]
    cmd = ["g++", "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           # torch's x86 build has these kernels; DispatchStub's call signature depends on them
           "-DHAVE_AVX512_CPU_DEFINITION", "-DHAVE_AVX2_CPU_DEFINITION",
           f"-I{jax.ffi.include_dir()}", *(f"-I{p}" for p in include_paths()), str(SRC),
           f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}", "-o", str(so)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return so, time.perf_counter() - t0


def register(so: Path) -> None:
    lib = ctypes.cdll.LoadLibrary(str(so))
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")


def to_jax(t: torch.Tensor) -> jax.Array:
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.contiguous().view(torch.int16).numpy()).view(jnp.bfloat16)
    return jnp.asarray(t.contiguous().numpy())


def to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def int4mm(x, w, sz, threads: int, target: str = "hx_int4mm_stub"):
    """x (M, K) @ W^T for W held as ``pack``'s (w, sz): (M, N) in x's dtype."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype)
    return jax.ffi.ffi_call(target, out)(x, w, sz, group=np.int64(GROUP),
                                         threads=np.int64(threads))


def int8mm(x, w, s, threads: int):
    """x (M, K) @ W^T for W = w (N, K) int8 times s (N,) per row: (M, N) in x's dtype."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype)
    return jax.ffi.ffi_call("hx_int8mm", out)(x, w, s, threads=np.int64(threads))


def int4pack(q: np.ndarray) -> np.ndarray:
    """torch's CPU int4pack layout (``_convert_weight_to_int4pack_for_cpu(q, 1)``, torch
    2.13, found by probing) in numpy: codes q (N, K) in 0..15, N a multiple of 64 -> uint8
    (N, K / 2): per block of 64 output rows, per input index k, 32 bytes whose low nibble is
    row j's code and high nibble row 32 + j's."""
    n, k = q.shape
    b = q.astype(np.uint8).reshape(n // 64, 2, 32, k)
    return np.ascontiguousarray((b[:, 0] | (b[:, 1] << 4)).transpose(0, 2, 1)).reshape(n, k // 2)


def pack_codes(q: np.ndarray, d: np.ndarray, m: np.ndarray, dtype) -> tuple:
    """torch's int4pack arrays of w = d * q + m: codes q (N, K) in 0..15, float16 d and m
    (N, K / 32). The kernel computes (q - 8) * scale + zero, so zero = m + 8 d (in float32,
    then rounded once to ``dtype``)."""
    w = torch.from_numpy(int4pack(q))
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    sz = np.stack([d32.T, (m32 + 8 * d32).T], axis=-1)  # (K / 32, N, 2)
    return w, torch.from_numpy(np.ascontiguousarray(sz)).to(dtype)


def pack_random(shape, dtype, rng) -> tuple:
    n, k = shape
    q = rng.integers(0, 16, shape)
    d = (rng.random((n, k // GROUP)) * 1e-3).astype(np.float16)
    m = (-8 * d.astype(np.float32)).astype(np.float16)
    return pack_codes(q, d, m, dtype)


def chain(y, n: int):
    """The next product's input (1, n) from the last output y: y's values tiled to n."""
    return jnp.tile(y, (1, -(-n // y.shape[1])))[:, :n]


def xla_products(layer_fmt=None, head_fmt=None, dtype=jnp.float32):
    """The step's products in XLA, 7 a layer (hx's ``models.layers.product``): dense, or with
    the layers held in ``layer_fmt`` and the head in ``head_fmt``, each matrix decompressed to
    ``dtype`` right before its product (hx's ``dequantize``, ``after`` its input)."""
    def matrix(held, shape, fmt, after):
        return held if fmt is None else dequantize(held, fmt, shape, dtype, after=after)

    def step(x, layers, head):
        y = x
        for layer in layers:
            for name, shape in LAYER.items():
                inp = chain(y, shape[1])
                y = product(inp.astype(dtype), matrix(layer[name], shape, layer_fmt, inp))
        n = chain(y, D)
        return product(n.astype(dtype), matrix(head, (VOCAB, D), head_fmt, n))
    return jax.jit(step)


def ffi_products(threads: int, target: str = "hx_int4mm_stub", cast=None, head_mode="int4"):
    """The step's products through the FFI int4 kernel (4 calls a layer); ``cast``: the
    kernel's dtype when x is float32 (cast before each call, outputs back to float32, as hx's
    float32 activations would be); ``head_mode``: the head as FFI ``int4``, FFI per-row
    ``int8``, XLA ``f32`` or ``bf16`` dense, or XLA ``q8_0`` decompressed to float32 (hx's way)."""
    def call(x, w, sz):
        if cast is None:
            return int4mm(x, w, sz, threads, target)
        return int4mm(x.astype(cast), w, sz, threads, target).astype(jnp.float32)

    def step(x, layers, head):
        y = x
        for layer in layers:
            for (w, sz), (_, n_in) in zip(layer, FUSED.values()):
                y = call(chain(y, n_in), w, sz)
        n = chain(y, D)
        if head_mode == "int4":
            return call(n, *head)
        if head_mode == "int8":
            return int8mm(n.astype(jnp.bfloat16), *head, threads)
        if head_mode in ("f32", "bf16"):
            return product(n.astype(head.dtype), head)
        return product(n.astype(jnp.float32), dequantize(head, FORMATS["q8_0"], (VOCAB, D),
                                                         jnp.float32, after=n))
    return jax.jit(step)


def torch_products(layers, head, threads: int):
    def step(x):
        torch.set_num_threads(threads)
        y = x
        for layer in layers:
            for (w, sz), (_, n_in) in zip(layer, FUSED.values()):
                inp = y.repeat(1, -(-n_in // y.shape[1]))[:, :n_in].contiguous()
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(inp, w, GROUP, sz)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(y[:, :D].contiguous(), head[0],
                                                           GROUP, head[1])
    return step


def timed(cases: dict, rounds: int, reps: dict | None = None) -> dict[str, float]:
    """Median over interleaved rounds of each case's mean seconds over ``reps[k]`` calls."""
    times = {k: [] for k in cases}
    for f, a in cases.values():
        jax.block_until_ready(f(*a))
    for _ in range(rounds):
        for k, (f, a) in cases.items():
            n = (reps or {}).get(k, 1)
            t0 = time.perf_counter()
            for _ in range(n):
                jax.block_until_ready(f(*a))
            times[k].append((time.perf_counter() - t0) / n)
    return {k: statistics.median(v) for k, v in times.items()}


def overhead(rounds: int, rng) -> dict[str, float]:
    """Seconds per call in a chain of tiny products: slope between chains of 1 and CHAIN."""
    w, sz = pack_random((TINY, TINY), torch.bfloat16, rng)
    jw, jsz = to_jax(w), to_jax(sz)
    dense = jnp.asarray(rng.standard_normal((TINY, TINY), np.float32) * 0.1)
    xb = to_jax(torch.randn(1, TINY, dtype=torch.bfloat16))
    xf = jnp.asarray(rng.standard_normal((1, TINY), np.float32))

    def host(x):  # what pure_callback runs
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(to_torch(x), w, GROUP, sz)
        return y.view(torch.int16).numpy().view(jnp.bfloat16)

    ops = {
        "ffi int4mm (stub, into XLA's buffer)": (lambda x: int4mm(x, jw, jsz, 1), xb),
        "ffi int4mm (public op + copy)": (lambda x: int4mm(x, jw, jsz, 1, "hx_int4mm_op"), xb),
        "ffi no-op": (lambda x: jax.ffi.ffi_call("hx_noop", jax.ShapeDtypeStruct(
            x.shape, x.dtype))(x), xb),
        "xla f32 dot 64x64": (lambda x: product(x, dense), xf),
        "pure_callback torch int4mm": (lambda x: jax.pure_callback(
            host, jax.ShapeDtypeStruct(x.shape, x.dtype), x), xb),
    }
    lengths = {k: (CHAIN if "pure_callback" not in k else CHAIN // 8) for k in ops}
    cases = {}
    for k, (op, x) in ops.items():
        for n in (1, lengths[k]):
            def step(x, op=op, n=n):
                for _ in range(n):
                    x = op(x)
                return x
            cases[(k, n)] = (jax.jit(step), (x,))
    tx = torch.randn(1, TINY, dtype=torch.bfloat16)

    def torch_chain(x):
        torch.set_num_threads(1)
        for _ in range(CHAIN):
            x = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, GROUP, sz)
        return x
    cases[("torch op from Python", CHAIN)] = (torch_chain, (tx,))
    t = timed(cases, rounds, reps={k: 20 if k[1] == 1 else 3 for k in cases})
    out = {}
    for k in ops:
        n = lengths[k]
        out[k] = (t[(k, n)] - t[(k, 1)]) / (n - 1)
        out[k + ", whole 1-call program"] = t[(k, 1)]
    out["torch op from Python"] = t[("torch op from Python", CHAIN)] / CHAIN
    return out


def stack(rounds: int, rng) -> dict[str, float]:
    """Seconds of the step's products per case (module docstring, 2)."""
    dense = [{k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)
              for k, s in LAYER.items()} for _ in range(LAYERS)]
    dense_head = jnp.asarray(rng.standard_normal((VOCAB, D), np.float32) * 0.02)
    packed = {}
    for dt in (torch.bfloat16, torch.float32):
        t_layers = [[pack_random(s, dt, rng) for s in FUSED.values()] for _ in range(LAYERS)]
        t_head = pack_random((VOCAB, D), dt, rng)
        packed[dt] = (t_layers, t_head, [[tuple(map(to_jax, p)) for p in layer]
                                         for layer in t_layers], tuple(map(to_jax, t_head)))
    x = jnp.asarray(rng.standard_normal((1, D), np.float32))
    xb = x.astype(jnp.bfloat16)
    bl, bh = packed[torch.bfloat16][2:]
    fl, fh = packed[torch.float32][2:]
    q41, q80 = FORMATS["q4_1"], FORMATS["q8_0"]
    q_layers = [{k: jax.tree.map(jnp.asarray, quantize(np.asarray(w), q41))
                 for k, w in layer.items()} for layer in dense]
    head_q80 = jax.tree.map(jnp.asarray, quantize(np.asarray(dense_head), q80))
    cases = {"xla f32 dense (7 products/layer)": (xla_products(), (x, dense, dense_head))}
    for dt in (jnp.float32, jnp.bfloat16):  # hx's compressed path today
        cases[f"xla q4_1 layers + q8_0 head -> {jnp.dtype(dt).name}"] = (
            xla_products(q41, q80, dt), (x, q_layers, head_q80))
    for threads in (1, 2):
        cases[f"ffi int4 bf16 {threads}T"] = (ffi_products(threads), (xb, bl, bh))
    cases["ffi int4 bf16 1T via public op+copy"] = (ffi_products(1, "hx_int4mm_op"),
                                                    (xb, bl, bh))
    cases["ffi int4 bf16 1T, f32 in/out casts"] = (ffi_products(1, cast=jnp.bfloat16),
                                                   (x, bl, bh))
    head_i8 = (jnp.asarray(rng.integers(-127, 128, (VOCAB, D), dtype=np.int8)),
               jnp.asarray(rng.random(VOCAB, np.float32) * 1e-3).astype(jnp.bfloat16))
    for mode, head in (("int8", head_i8), ("f32", dense_head),
                       ("bf16", dense_head.astype(jnp.bfloat16)), ("q8_0", head_q80)):
        cases[f"ffi int4 bf16 1T layers + {mode} head"] = (
            ffi_products(1, cast=jnp.bfloat16, head_mode=mode), (x, bl, head))
    for threads in (1, 2):
        cases[f"ffi int4 f32 {threads}T"] = (ffi_products(threads), (x, fl, fh))
    for threads in (1, 2):
        cases[f"torch from Python bf16 {threads}T"] = (
            torch_products(*packed[torch.bfloat16][:2], threads),
            (torch.randn(1, D, dtype=torch.bfloat16),))
    return timed(cases, rounds)


def exactness(rng) -> dict[str, dict[str, float]]:
    """Errors of each product route against float64 (module docstring, 3)."""
    q41, q80 = FORMATS["q4_1"], FORMATS["q8_0"]
    out = {}
    for name, shape, fmt in (("QKV q4_1", FUSED["QKV"], q41), ("down q4_1", FUSED["down"], q41),
                             ("head q8_0", (VOCAB, D), q80)):
        held = quantize(rng.standard_normal(shape, np.float32) * 0.02, fmt)
        codes = unpack(held["codes"], fmt).reshape(shape[0], -1, GROUP).astype(np.float64)
        w64 = codes - fmt.zero
        w64 = w64 * held["scale"].reshape(shape[0], -1, 1).astype(np.float64)
        if fmt.asymmetric:
            w64 = w64 + held["offset"].reshape(shape[0], -1, 1).astype(np.float64)
        w64 = w64.reshape(shape)
        if fmt is q41:
            q = codes.reshape(shape).astype(np.int32)
            d, m = held["scale"].reshape(shape[0], -1), held["offset"].reshape(shape[0], -1)
            assert np.array_equal(int4pack(q), torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(q), 1).numpy()), "int4pack's layout differs from torch's"
        else:  # the head re-quantized: Q4_1 of its decoded weights; per-row int8
            h41 = quantize(w64.astype(np.float32), q41)
            q = unpack(h41["codes"], q41).reshape(shape).astype(np.int32)
            d, m = h41["scale"].reshape(shape[0], -1), h41["offset"].reshape(shape[0], -1)
            s8 = np.abs(w64).max(axis=1) / 127
            w8 = np.rint(w64 / s8[:, None]).astype(np.int8)
        x = rng.standard_normal((1, shape[1]), np.float32)
        ref = x.astype(np.float64) @ w64.T
        wf = jnp.asarray(w64.astype(np.float32))
        ys = {}
        requant = "" if fmt is q41 else " (re-quantized Q4_1)"
        for label, dt in (("ffi int4 bf16", torch.bfloat16), ("ffi int4 f32", torch.float32)):
            w, sz = pack_codes(q, d, m, dt)
            xx = jnp.asarray(x) if dt == torch.float32 else jnp.asarray(x).astype(jnp.bfloat16)
            ys[label + requant] = jax.jit(lambda a, b, c: int4mm(a, b, c, 1))(
                xx, to_jax(w), to_jax(sz))
        if fmt is q80:
            ys["ffi int8 per-row bf16 (re-quantized)"] = jax.jit(
                lambda a, b, c: int8mm(a, b, c, 1))(jnp.asarray(x).astype(jnp.bfloat16),
                                                     jnp.asarray(w8),
                                                     jnp.asarray(s8, jnp.bfloat16))
        ys["xla f32 dense (hx float32)"] = jax.jit(product)(jnp.asarray(x), wf)
        ys["xla bf16 dense (hx bfloat16)"] = jax.jit(product)(
            jnp.asarray(x).astype(jnp.bfloat16), wf.astype(jnp.bfloat16))
        for label, y in ys.items():
            err = np.asarray(y, np.float64) - ref
            out.setdefault(label, {})[name] = {
                "max_abs_over_max": float(np.abs(err).max() / np.abs(ref).max()),
                "rel_l2": float(np.linalg.norm(err) / np.linalg.norm(ref))}
    return out


def concurrency(rounds: int, rng) -> dict:
    """Does XLA overlap independent custom calls, or a custom call and an XLA dot?"""
    def spin(a):
        return jax.ffi.ffi_call("hx_spin", jax.ShapeDtypeStruct((4,), jnp.int32))(
            a, us=np.int64(SPIN_US))
    big = jnp.asarray(rng.standard_normal((4096, 2048), np.float32))
    v = jnp.asarray(rng.standard_normal((1, 2048), np.float32))
    a = jnp.asarray(np.array([1], np.int32))
    b = jnp.asarray(np.array([2], np.int32))
    one = jax.jit(spin)
    two = jax.jit(lambda a, b: (spin(a), spin(b)))
    dot = jax.jit(lambda v, m: product(v, m))
    spin_dot = jax.jit(lambda a, v, m: (spin(a), product(v, m)))
    t = timed({"one spin": (one, (a,)), "two independent spins": (two, (a, b)),
               "xla dot 4096x2048": (dot, (v, big)),
               "spin + independent xla dot": (spin_dot, (a, v, big))}, rounds,
              reps={"xla dot 4096x2048": 5})
    r1, r2 = (np.asarray(r) for r in two(a, b))
    overlap = min(r1[1], r2[1]) - max(r1[0], r2[0])
    r = np.asarray(one(a))
    return {"seconds": t, "spin_us": SPIN_US,
            "two spins overlap_us": float(max(overlap, 0)),
            "two spins tids": [int(r1[2]), int(r2[2])],
            "one spin tid": int(r[2]), "python main tid": threading.get_native_id()}


def hx_step() -> float:
    """Median seconds of hx's all-host batch-1 float32 dense decode step (``hx bench``)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "hx", "bench", "--plans", "all-host", "--batches",
                        "1", "--dtype", "float32", "--weights", "dense", "--steps", "32",
                        "--json", out.name], check=True, capture_output=True)
        return json.load(open(out.name))["rows"][0]["executor_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--build-dir", default="/tmp/ffi_int4_build")
    parser.add_argument("--step-ms", type=float,
                        help="hx's dense all-host step in ms (skips running hx bench)")
    args = parser.parse_args()
    steps = [] if args.step_ms else [hx_step()]
    so, build_s = build(Path(args.build_dir))
    register(so)
    rng = np.random.default_rng(0)
    res = {"build_s": build_s, "rounds": args.rounds, "jax": jax.__version__,
           "torch": torch.__version__}
    res["exactness"] = exactness(rng)
    res["per_call_s"] = overhead(args.rounds, rng)
    res["concurrency"] = concurrency(args.rounds, rng)
    res["products_s"] = stack(args.rounds, rng)
    torch.set_num_threads(2)
    if not args.step_ms:
        steps.append(hx_step())
    step = args.step_ms / 1e3 if args.step_ms else statistics.mean(steps)
    res["steps_s"] = steps
    p = res["products_s"]
    dense = p["xla f32 dense (7 products/layer)"]
    ffi = {k: v for k, v in p.items() if k.startswith("ffi")}
    best = min(ffi, key=ffi.get)
    rest = step - dense
    f32_head = p["ffi int4 bf16 1T layers + f32 head"]
    res.update(step_s=step, step_measured=not args.step_ms, rest_s=rest, best=best,
               bound_s=rest + ffi[best], speedup=step / (rest + ffi[best]),
               bound_f32_head_s=rest + f32_head, speedup_f32_head=step / (rest + f32_head),
               load_average_1min=os.getloadavg()[0])

    print(f"build: {'cached' if build_s is None else f'{build_s:.1f} s'}")
    print(f"\n1. per call inside jit ({TINY}x{TINY}, slope of chains of 1 and {CHAIN}; "
          f"pure_callback {CHAIN // 8})")
    for k, v in res["per_call_s"].items():
        print(f"   {k:52s} {v * 1e6:9.1f} us")
    print("\n2. products of a batch-1 step (30 layers + head), one jitted program")
    for k, v in p.items():
        print(f"   {k:52s} {v * 1e3:9.2f} ms")
    print("\n3. exactness vs float64 on the exact dequantized Q4_1 weights "
          "(max|err|/max|y|, rel L2)")
    for k, v in res["exactness"].items():
        cells = "  ".join(f"{n} {e['max_abs_over_max']:.1e}/{e['rel_l2']:.1e}"
                          for n, e in v.items())
        print(f"   {k:40s} {cells}")
    c = res["concurrency"]
    print("\n4. concurrency")
    for k, v in c["seconds"].items():
        print(f"   {k:52s} {v * 1e3:9.2f} ms")
    print(f"   two spins overlap {c['two spins overlap_us']:.0f} us of {SPIN_US}; tids "
          f"{c['two spins tids']}, one spin tid {c['one spin tid']}, python main tid "
          f"{c['python main tid']}")
    print(f"\nhx dense step {step * 1e3:.2f} ms "
          f"({'measured ' + ', '.join(f'{t * 1e3:.2f}' for t in steps) if steps else 'given'})"
          f" - dense products {dense * 1e3:.2f} = rest {rest * 1e3:.2f} ms; + {best} "
          f"{ffi[best] * 1e3:.2f} = {res['bound_s'] * 1e3:.2f} ms: {res['speedup']:.2f}x the "
          f"dense step (target 1.5x: {step / 1.5 * 1e3:.2f} ms); with the Q8_0 head exact "
          f"in float32: {res['bound_f32_head_s'] * 1e3:.2f} ms = {res['speedup_f32_head']:.2f}x;"
          f" load avg {res['load_average_1min']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
