"""Host linear layers y = x W^T: XLA vs torch kernels over dense and group-wise weights.

Usage: python scripts/bench_host_matmul.py [--runs 7] [--rows 1,16,32,64] [--json OUT.json] [--slow]

Takes 2-4 minutes on the 2-core development VM (128 s and 235 s measured under other load;
--slow adds minutes).

For W (out, in) in the checkpoint's layout, at SmolLM2's (1536, 576) and Llama-2-7B's
(11008, 4096) MLP1 shapes and 1, 16, 32, 64 rows of float32 x, on 2 threads (torch's
``set_num_threads``; XLA:CPU uses every core, 2 here): the median ms of one call of each kernel
over each weight format, kernels interleaved in rounds (one call each per round) so that their
ratios come from the same moments of a shared machine. Formats: dense float32 and bfloat16, and
hx's group-wise ones (``models/formats.py``): codes uint8, float16 scale and offset per group of
g along ``in``; 4-bit codes hold element j of a group in the low nibble of byte j, j + g/2 in the
high one. Each kernel's error is max |y - ref| / max |ref| against float64 over the exact
dequantized weights; "exact" means within float32 rounding (< 1e-5). Also the per-call cost of
running torch from JAX: ``jax.pure_callback`` inside jit, and DLPack hand-offs outside it.
The GGUF block formats (q4_0, q4_1, q8_0) also through ggml's product inside jit
(``hx.host_compute.ggml_kernel``: the file's own blocks, as llama.cpp multiplies them; its
reference is the blocks ``gguf.quants`` writes, decoded), where ggml is built; q4_1 also as hx
holds it (``ggml.centred``: q4_0's blocks and kernels plus each block's centre,
``models.formats.CENTRED_BLOCKS``; repacked where ggml repacks q4_0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

from hx.devices import configure_runtime

# torch's OpenMP threads otherwise spin at barriers: beside XLA's pool and other processes on 2
# cores, a 0.5 ms linear then took 32 ms (measured). Read when torch starts its threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

configure_runtime()  # before JAX starts: two CPU devices, as hx runs

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from rich.table import Table

from hx.cli.console import print_table
from hx.devices import discover
from hx.host_compute import ggml_kernel
from hx.models.compressed import GGUFBlocks
from hx.models.formats import CENTRED_BLOCKS
from hx.models.gguf_loader import group_of_blocks

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # callbacks

THREADS = 2
SHAPES = {"SmolLM2 1536x576": (1536, 576), "Llama-2-7B 11008x4096": (11008, 4096)}
ROWS = (1, 16, 32, 64)
FORMATS = {"int8": (8, 64, True), "q8_0": (8, 32, False), "int4": (4, 64, True),
           "q4_0": (4, 32, False), "q4_1": (4, 32, True)}  # (bits, group, asymmetric)
GGUF_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q8_0": GGMLQuantizationType.Q8_0}
EXACT = 1e-5
DOT_T = (((1,), (1,)), ((), ()))  # contract x's last axis with W's last axis
F32, BF16 = jnp.float32, jnp.bfloat16


def quantize(w: np.ndarray, bits: int, g: int, asym: bool) -> dict[str, np.ndarray]:
    """hx's min/max (asymmetric) or absmax (symmetric) group-wise quantization of w (O, I)."""
    O, I = w.shape
    wg, top, zero = w.reshape(O, I // g, g), (1 << bits) - 1, 0 if asym else 1 << (bits - 1)
    if asym:
        off = wg.min(-1).astype(np.float16)
        scale = ((wg.max(-1) - off.astype(np.float32)) / top).astype(np.float16)
        base = off.astype(np.float32)[..., None]
    else:
        scale, base = (np.abs(wg).max(-1) / (zero - 1)).astype(np.float16), 0.0
    codes = np.clip(np.rint((wg - base) / scale.astype(np.float32)[..., None]) + zero, 0, top)
    codes = codes.astype(np.uint8)
    held = {"scale": scale, "codes": codes if bits == 8 else
            codes[..., :g // 2] | (codes[..., g // 2:] << np.uint8(4))}
    if asym:
        held["offset"] = off
    return held


def codes_of(p: dict, bits: int, xp=np):
    """The codes (O, G, g) of held arrays ``p``, unpacking 4-bit nibbles (xp: numpy or jnp)."""
    c = p["codes"]
    return c if bits == 8 else xp.concatenate([c & 15, c >> 4], axis=-1)


def dequantize(p: dict, bits: int, xp=np, dtype=np.float32):
    """W (O, I) = scale * code + offset, or scale * (code - 2^(bits-1)), computed in ``dtype``."""
    cast = lambda a: a.to(dtype) if isinstance(a, torch.Tensor) else a.astype(dtype)  # noqa
    q, s = cast(codes_of(p, bits, xp)), cast(p["scale"])[..., None]
    w = s * q + cast(p["offset"])[..., None] if "offset" in p else s * (q - (1 << (bits - 1)))
    return w.reshape(q.shape[0], -1)


def xla_group_reduce(x, p: dict, bits: int):
    """y by multiply + reduce per group, never forming W (a formulation XLA may fuse)."""
    O, G = p["scale"].shape
    xg = x.reshape(x.shape[0], 1, G, -1)  # (B, 1, G, g)
    if bits == 8:
        q = p["codes"].astype(F32) - (0 if "offset" in p else 128)
        inner = (q * xg).sum(-1)
    else:
        h, c = xg.shape[-1] // 2, p["codes"]
        lo, hi = [(v.astype(F32) - (0 if "offset" in p else 8)) for v in (c & 15, c >> 4)]
        inner = (lo * xg[..., :h]).sum(-1) + (hi * xg[..., h:]).sum(-1)
    y = (inner * p["scale"].astype(F32)).sum(-1)
    return y + (p["offset"].astype(F32) * xg.sum(-1)).sum(-1) if "offset" in p else y


def xla_int8_dot(x, p: dict, bits: int):
    """8-bit only: x quantized per row to int8, int8 x int8 dots per group with int32 sums."""
    O, G = p["scale"].shape
    sx = jnp.abs(x).max(-1, keepdims=True) / 127
    xq = jnp.round(x / sx).astype(jnp.int8).reshape(x.shape[0], G, -1)
    cq = (p["codes"].astype(jnp.int16) - 128).astype(jnp.int8)  # asym: offset gets +128 * s
    acc = jax.lax.dot_general(xq, cq, (((2,), (2,)), ((1,), (1,))),
                              preferred_element_type=jnp.int32).astype(F32)  # (G, B, O)
    y = jnp.einsum("gbo,og->bo", acc, p["scale"].astype(F32)) * sx
    if "offset" in p:
        off = p["offset"].astype(F32) + 128 * p["scale"].astype(F32)
        y = y + jnp.einsum("bg,og->bo", x.reshape(x.shape[0], G, -1).sum(-1), off)
    return y


def kernels(name: str, W: np.ndarray, x: np.ndarray, host, slow: bool) -> dict:
    """{kernel: (callable returning y, float64 reference W)} for one format of W at rows x."""
    B, xj, xt = x.shape[0], jax.device_put(x, host), torch.from_numpy(x)
    if name in ("float32", "bfloat16"):
        wj = jax.device_put(W.astype(getattr(jnp, name)), host)
        wt = torch.from_numpy(W).to(getattr(torch, name))
        dot = jax.jit(lambda x, w: jax.lax.dot_general(x.astype(w.dtype), w, DOT_T,
                                                       preferred_element_type=F32))
        ref = W.astype(getattr(jnp, name)).astype(np.float64)
        return {"xla.dot": (lambda: dot(xj, wj), ref),
                "torch.linear": (lambda: F.linear(xt.to(wt.dtype), wt), ref)}
    bits, g, asym = FORMATS[name]
    p = quantize(W, bits, g, asym)
    ref, pj = dequantize(p, bits, np, np.float64), jax.device_put(p, host)
    pt = {k: torch.from_numpy(v) for k, v in p.items()}
    deq = jax.jit(lambda x, p: jax.lax.dot_general(x, dequantize(p, bits, jnp, F32), DOT_T))
    out = {"xla.dequant+dot": (lambda: deq(xj, pj), ref),
           "torch.dequant+linear": (lambda: F.linear(xt, dequantize(pt, bits, torch,
                                                                    torch.float32)), ref)}
    if name in GGUF_TYPES and ggml_kernel.unavailable() is None:
        kind = GGUF_TYPES[name]
        blocks = jax.device_put(gguf_quantize(W, kind), host)
        mm = jax.jit(ggml_kernel.matmul, static_argnums=(2,))
        file_ref = gguf_dequantize(np.asarray(blocks), kind).astype(np.float64)
        out["ggml"] = (lambda: mm(xj, blocks, int(kind)), file_ref)
        if name in CENTRED_BLOCKS:  # as hx holds it: q4_0's blocks and kernels, and centres
            held = GGUFBlocks.from_group(group_of_blocks(np.asarray(blocks), kind.name,
                                                         W.shape), W.shape)
            centred = jax.device_put(held, host)
            product = jax.jit(ggml_kernel.product)
            out["ggml.centred"] = (lambda: product(xj, centred), file_ref)
            if ggml_kernel.repacks(name, W.shape[0]):
                repacked = jax.device_put(ggml_kernel.repacked(held), host)
                out["ggml.centred.repacked"] = (lambda: product(xj, repacked), file_ref)
    if B == 1 or slow:
        red = jax.jit(lambda x, p: xla_group_reduce(x, p, bits))
        out["xla.group_reduce"] = (lambda: red(xj, pj), ref)
    if bits == 8 and (slow or W.shape[0] < 4096):
        i8 = jax.jit(lambda x, p: xla_int8_dot(x, p, bits))
        out["xla.int8_dot"] = (lambda: i8(xj, pj), ref)
    if bits == 8:  # per-output-channel int8 scales: W requantized (an approximation)
        s = np.abs(ref).max(1) / 127
        w8 = torch.from_numpy(np.rint(ref / s[:, None]).astype(np.int8))
        st = torch.from_numpy(s.astype(np.float32)).bfloat16()
        out["torch.int8pack(bf16)"] = (
            lambda: torch.ops.aten._weight_int8pack_mm(xt.bfloat16(), w8, st), ref)
    else:  # w = (q - 8) * scale + zero, zero = offset + 8 scale (exact in f32). The pack is
        # (O/N, I, N/2) uint8, byte [n, k, j] = q[nN + j, k] | q[nN + N/2 + j, k] << 4, N = 64 on
        # AVX512 (32 on AVX2): along out, unlike GGUF's nibbles along in, so a load-time repack.
        q = torch.from_numpy(codes_of(p, bits).reshape(W.shape).astype(np.int32))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sc = p["scale"].astype(np.float32)
        zero = p["offset"].astype(np.float32) + 8 * sc if asym else 0 * sc
        sz = torch.from_numpy(np.stack([sc.T, zero.T], -1).copy())  # (G, O, 2)
        szb = sz.bfloat16()
        out["torch.int4pack(bf16)"] = (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            xt.bfloat16(), packed, g, szb), ref)
        if B == 1 or slow:
            out["torch.int4pack(f32)"] = (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                xt, packed, g, sz), ref)
    return out


def run_once(f) -> float:
    """Seconds of one call of ``f``, blocking on a JAX result."""
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    return time.perf_counter() - t0


def bench(shape, B: int, runs: int, host, slow: bool) -> list[dict]:
    """Every format x kernel at one shape and row count, timed in interleaved rounds."""
    rng = np.random.default_rng(0)
    W = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
    x = rng.standard_normal((B, shape[1]), np.float32)
    cases = {(f, k): v for f in ("float32", "bfloat16", *FORMATS)
             for k, v in kernels(f, W, x, host, slow).items()}
    errors = {}
    for key, (f, ref) in cases.items():
        y_ref = x.astype(np.float64) @ ref.T
        y = f()
        y = np.asarray(y.float().numpy() if isinstance(y, torch.Tensor) else y, np.float64)
        errors[key] = float(np.abs(y - y_ref).max() / np.abs(y_ref).max())
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2:  # warm-up (a core left idle runs slow a while)
            run_once(f)
    times = {key: [] for key in cases}
    for _ in range(runs):
        for key, (f, _) in cases.items():
            times[key].append(run_once(f))
    return [{"shape": f"{shape[0]}x{shape[1]}", "rows": B, "format": fmt, "kernel": k,
             "ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3,
             "max_ms": max(ts) * 1e3, "rel_err": errors[fmt, k], "exact": errors[fmt, k] < EXACT}
            for (fmt, k), ts in times.items()]


def per_call_us(f, calls: int = 300, runs: int = 5) -> float:
    """Median over ``runs`` batches of the mean microseconds of one call of ``f``."""
    f()
    batches = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(f())
        batches.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(batches)


def overheads(host) -> dict:
    """Per-call microseconds of torch work reached from JAX at SmolLM2's shape, batch 1."""
    x, wt = jax.device_put(np.ones((1, 576), np.float32), host), torch.randn(1536, 576)
    lin = lambda a: F.linear(torch.from_numpy(np.asarray(a)), wt).numpy()  # noqa: E731
    plain = jax.jit(lambda x: x * 2)
    ident = jax.jit(lambda x: jax.pure_callback(np.asarray, jax.typeof(x), x) * 2)
    cb_lin = jax.jit(lambda x: jax.pure_callback(lin, jax.ShapeDtypeStruct((1, 1536), F32), x))
    xt = torch.from_dlpack(x)
    back = jax.dlpack.from_dlpack(xt)
    return {
        "jit_trivial_us": per_call_us(lambda: plain(x)),
        "jit_pure_callback_identity_us": per_call_us(lambda: ident(x)),
        "torch_linear_direct_us": per_call_us(lambda: F.linear(xt, wt)),
        "jit_pure_callback_torch_linear_us": per_call_us(lambda: cb_lin(x)),
        "dlpack_jax_to_torch_us": per_call_us(lambda: torch.from_dlpack(x)),
        "dlpack_torch_to_jax_us": per_call_us(lambda: jax.dlpack.from_dlpack(xt)),
        "dlpack_zero_copy": xt.data_ptr() == x.unsafe_buffer_pointer()
        and back.unsafe_buffer_pointer() == xt.data_ptr(),
    }


def main() -> None:
    """Run every shape x rows, print the tables, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="comma-separated row counts")
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--slow", action="store_true",
                        help="also kernels that take seconds (group_reduce and int4pack(f32) "
                             "at 16-64 rows, xla.int8_dot at Llama's shape)")
    args = parser.parse_args()
    row_counts = tuple(int(r) for r in args.rows.split(","))
    torch.set_num_threads(THREADS)
    host = discover().host.device
    start, rows, load = time.perf_counter(), [], [os.getloadavg()[0]]
    for shape in SHAPES.values():
        for B in row_counts:
            rows += bench(shape, B, args.runs, host, args.slow)
    over = overheads(host)
    load.append(os.getloadavg()[0])
    for name, shape in SHAPES.items():
        table = Table(title=f"host y = x W^T, W {name}: median ms per call ({THREADS} threads)")
        for col in ("format", "kernel", *(f"{b} rows" for b in row_counts), "rel err",
                    "exact"):
            table.add_column(col, justify="right")
        mine = [r for r in rows if r["shape"] == f"{shape[0]}x{shape[1]}"]
        for fmt, k in dict.fromkeys((r["format"], r["kernel"]) for r in mine):
            got = {r["rows"]: r for r in mine if (r["format"], r["kernel"]) == (fmt, k)}
            err = max(r["rel_err"] for r in got.values())
            table.add_row(fmt, k, *(f"{got[b]['ms']:.2f}" if b in got else "-"
                                    for b in row_counts),
                          f"{err:.1e}", "yes" if err < EXACT else "no")
        print_table(table)
    table = Table(title="calling torch from JAX (SmolLM2 1536x576, 1 row)")
    for col in ("what", "value"):
        table.add_column(col, justify="right")
    for k, v in over.items():
        table.add_row(k, f"{v:.1f}" if isinstance(v, float) else str(v))
    print_table(table)
    print(f"took {time.perf_counter() - start:.0f} s; 1-minute load average {load[0]:.1f} at "
          f"the start, {load[1]:.1f} at the end ({os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": THREADS, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                       "runs": args.runs, "torch": torch.__version__, "jax": jax.__version__,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "load_average_1min": load, "rows": rows, "overhead": over}, f, indent=1)


if __name__ == "__main__":
    main()
