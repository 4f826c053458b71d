"""Host products over a GGUF's own blocks with ggml's CPU kernels, inside XLA programs (FFI).

The product llama.cpp runs: x (M, K) float32 is quantized to the weights' dot type (Q8_0 for
Q4_0 and Q8_0) and multiplied block by block with AVX-512/VNNI integer dots against W (N, K)
held in the file's blocks (``ggml_row_size(type, K)`` bytes a row), never decompressed; so its
results are llama.cpp's, not float32's (SmolLM2's Q4_1 ``ffn_up`` at 4 rows: 4.8e-3 relative to
float64 over the decoded weights, the activations' 8-bit rounding). Q4_1 is held centred
(``models.formats.CENTRED_BLOCKS``): its Q4_0 part by Q4_0's kernels, plus each block's centre
times x's block sum (``ggml_pool.h``'s ``Product``), where llama.cpp runs its Q4_1 x Q8_1 dot.

``ggml_mm.cc`` (this handler) and ``ggml_layer.cc`` (a whole decoder layer as one ggml graph,
``host_compute.ggml_layer``) share one thread pool (``ggml_pool.h``), so they are one library:
compiled once per (sources, jaxlib, ggml build) with g++ against the ggml that
``hx.host_compute.ggml_build`` built for this CPU, into ``~/.cache/hx/kernels/<digest>/``
(``HX_KERNEL_DIR`` overrides the root), and both registered with ``jax.ffi``; without that
build or a compiler ``unavailable()`` says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hx.errors import HxError
from hx.host_compute import ffi_build
from hx.host_compute.ggml_build import built, ggml_dir
from hx.models.compressed import GGUFBlocks, unrepack_rows
from hx.models.formats import GGUF_BLOCKS, REPACK_ROWS, blocks_format, get_format
from hx.models.spec import ClampedSwiGLU, SwiGLU

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("ggml_mm.cc", "ggml_layer.cc", "ggml_moe.cc", "ggml_pool.h",
                             "avx512_products.h"))
TARGET, LAYER_TARGET, MOE_TARGET = "hx_ggml_mm", "hx_ggml_layers", "hx_ggml_moe"
# ggml's product against XLA's of the decompressed matrix, float32 x, Llama-2-7B's 11008 x 4096,
# 2 threads, median ms of 5 interleaved rounds on the 2-core VM (scripts/bench_host_matmul.py;
# docs/measurements/log.md, "ggml's products"):
#
#   rows               1      16     64     512
#   q4_0  ggml       2.44   25.8   71.9   475
#         xla       88.9   109    138    372
#   q4_1  ggml       3.47   29.7   107    711
#         xla       99.6   108    129    373
#   q8_0  ggml       4.14   16.1   59.7   404
#         xla       78.0   87.6   118    370
#
# (torch's int4 kernel, bfloat16 x: 4.37-6.38 ms at 1 row, 28-30 at 16, 107-115 at 64.) ggml
# takes up to 64 rows; past them (a prefill chunk) the matrix is decompressed for XLA -- except
# q4_0 in ggml's repacked layout (``repack``), whose kernels beat XLA's at every prefill chunk
# (one run, median of 3, ms: 64 rows 36.2 against 135; 128 74.4 / 158; 256 155 / 236; 512 291
# / 342; the file's layout 51.6, 106, 224, 428): to the step limit, 512.
# q4_1 is held centred (``models.formats.CENTRED_BLOCKS``): q4_0's kernels, so q4_0's rows.
# On a CPU with AVX-512 VNNI the repacked q4_0 products, and q8_0's at one row, are hx's own
# (``avx512_products.h``): 1.1-1.45x ggml's GEMV and 1.4-2.1x its GEMM (docs/measurements/log.md,
# "hx's own Q4_0 and Q8_0 kernels").
KERNEL_ROWS = (("q4_0", 64), ("q4_1", 64), ("q8_0", 64), ("q4_0 repacked", 512),
               ("q4_1 repacked", 512))
REPACKED = 1 << 16  # a type's flag: the matrix is in ggml's repacked layout (ggml_pool.h)
CENTRED = 1 << 17  # a type's flag: Q4_1 rows as Q4_0 blocks and their centres (ggml_pool.h)


def kernel_dir() -> Path:
    """Where the handlers are built (``ffi_build.kernel_dir``: a digest of the sources,
    jaxlib's version and the ggml build they link)."""
    return ffi_build.kernel_dir(*(p.read_bytes() for p in SOURCES),
                                str(ggml_dir().resolve()).encode(),
                                (ggml_dir() / "BUILT").read_bytes())


def build(out_dir: Path) -> Path:
    """The handlers' shared library in ``out_dir``, compiled with g++ when missing
    (``ffi_build.compile_handler``).

    Raises:
      OSError, subprocess.CalledProcessError: no compiler, or the build failed.
    """
    lib = (ggml_dir() / "lib").resolve()
    return ffi_build.compile_handler(list(SOURCES[:3]), out_dir / "libhx_ggml.so", [
        "-std=c++17", "-O3", "-march=native", f"-I{ggml_dir() / 'include'}",
        f"-I{SOURCES[0].parent}", f"-L{lib}", "-lggml-cpu", "-lggml-base",
        f"-Wl,-rpath,{lib}"])


_LIBRARY: list = []  # the loaded handlers' library, once ``unavailable`` has loaded it


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None once the handlers are built and registered with JAX; else why they cannot be
    (ggml not built for this machine, no compiler, a failed build)."""
    if not built():
        return (f"ggml is not built in {ggml_dir()} (python -m hx.host_compute.ggml_build; "
                "`make install` runs it)")
    try:
        so = build(kernel_dir())
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        return (f"building {', '.join(p.name for p in SOURCES[:3])} failed: {e} "
                f"{err.decode(errors='replace')[-300:]}")
    lib = ctypes.cdll.LoadLibrary(str(so))
    _LIBRARY.append(lib)
    for target in (TARGET, LAYER_TARGET, MOE_TARGET):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                    platform="cpu")
    return None


def repack(blocks: np.ndarray, fmt_name: str) -> np.ndarray | None:
    """``blocks`` (N, row bytes) uint8 of GGUF block format ``fmt_name`` in ggml's repacked CPU
    layout (the same bytes, interleaved for its kernels: llama.cpp's default where the CPU has
    one), or None where ggml has none for this format and N on this CPU (or is unavailable)."""
    if unavailable() is not None:
        return None
    blocks = np.ascontiguousarray(blocks, np.uint8)
    (n, row), fmt = blocks.shape, get_format(fmt_name)
    out = np.empty_like(blocks)
    done = _LIBRARY[0].hx_ggml_repack(
        ctypes.c_int64(GGUF_BLOCKS[fmt_name]), ctypes.c_int64(n),
        ctypes.c_int64(row // fmt.block_bytes * fmt.group),
        ctypes.c_void_p(blocks.ctypes.data), ctypes.c_void_p(out.ctypes.data))
    return out if done else None


def repacked(held: GGUFBlocks) -> GGUFBlocks:
    """``held`` with its blocks in ggml's repacked CPU layout (``repack`` in its blocks'
    format: a centred q4_1's are q4_0's), its centres as they were; only where ``repacks``
    says ggml has the layout."""
    return GGUFBlocks(repack(np.asarray(held.blocks), held.blocks_format.name), held.fmt, True,
                      held.centres)


@functools.lru_cache(maxsize=1)
def repacked_formats() -> frozenset[str]:
    """The formats whose projection matrices hx holds in ggml's repacked CPU layout: q4_0
    where ggml interleaves it by 8 rows on this CPU (x86 with AVX2: llama.cpp's default, its
    own kernels 1.3x faster at batch-1 decode and 1.5x at a 128-token prefill of Llama-2-7B's
    shapes), which ``models.compressed.unrepack_rows`` reads back: checked once on a sample."""
    sample = np.random.default_rng(0).integers(0, 256, (16, 4 * 18), dtype=np.uint8)
    got = repack(sample, "q4_0")
    if got is None or not np.array_equal(np.asarray(unrepack_rows(got, get_format("q4_0"))),
                                         sample):
        return frozenset()
    return frozenset({"q4_0"})


def repacks(fmt_name: str, rows: int) -> bool:
    """Whether a projection matrix of ``rows`` rows in ``fmt_name`` is held repacked: its
    blocks' format (``models.formats.blocks_format``: q4_1's are q4_0's) is among
    ``repacked_formats`` and ggml's layout interleaves 8 rows."""
    return rows % REPACK_ROWS == 0 and blocks_format(fmt_name) in repacked_formats()


def matmul(x: jax.Array, w: jax.Array, ggml_type: int, threads: int | None = None,
           repacked: bool = False, centres: jax.Array | None = None) -> jax.Array:
    """x (M, K) @ W^T -> (M, N) float32, W (N, K) held as ``w`` (N, row bytes) uint8 in ggml
    type ``ggml_type`` (``gguf.GGMLQuantizationType``: Q4_0 2, Q4_1 3, Q8_0 8, ...), in
    ggml's repacked CPU layout where ``repacked`` (``repack``): ggml's
    product through the FFI target, ``x`` first cast to float32, on every core this process
    may use (``threads`` overrides; ``ggml_mm.cc`` says why even small products take them
    all). Usable inside ``jax.jit`` on a CPU device only.

    With ``centres`` (K / 32, N) float32, ``w`` is a centred q4_1 matrix's q4_0 blocks
    (``models.compressed.GGUFBlocks``) and the centres' part is added (``ggml_pool.h``).

    Raises:
      HxError: the handler cannot be built or loaded (``unavailable`` says why).
    """
    reason = unavailable()
    if reason is not None:
        raise HxError(f"ggml's products are unavailable: {reason}")
    threads = threads or len(os.sched_getaffinity(0))
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    flags = (REPACKED if repacked else 0) | (CENTRED if centres is not None else 0)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), w,
                                         *(() if centres is None else (centres,)),
                                         type=np.int64(ggml_type | flags),
                                         threads=np.int64(threads))


def product(x: jax.Array, held: GGUFBlocks) -> jax.Array:
    """x (M, K) @ W^T -> (M, N) float32 for W held as ``held`` (its blocks' format, layout and
    centres: ``matmul``); ``models.compressed.Products.blocks`` on the host."""
    return matmul(x, held.blocks, GGUF_BLOCKS[held.blocks_format.name], repacked=held.repacked,
                  centres=held.centres)


# the experts' layouts ``experts`` multiplies (``Products.experts_layouts``): GGUF blocks
# ggml's ``mul_mat_id`` takes as they are (a centred q4_1's centres' part is per expert)
EXPERT_LAYOUTS = ("q4_0", "q8_0", "q4_0 repacked")


def experts(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: GGUFBlocks,
            up: GGUFBlocks, down: GGUFBlocks, biases: tuple = (),
            activation: SwiGLU | ClampedSwiGLU = SwiGLU()) -> jax.Array:
    """An MoE layer's routed experts (``models.moe``) on the host in one ggml graph
    (``ggml_moe.cc``: llama.cpp's ``build_moe_ffn``): y (M, D) float32 = sum_j weights[m, j]
    down_e(SiLU(gate_e x_m) * up_e x_m), e = ids[m, j], each row multiplied by its k experts'
    matrices only, and a slot weighted 0 by none (it adds nothing; a part of a layer's experts
    gets such slots): the step reads only the experts some row is routed to. With ``biases``
    each product adds its expert's (ggml's ``add_id``), and a ``ClampedSwiGLU`` runs as
    ggml's ``swiglu_oai`` (llama.cpp's gpt-oss graph).

    Args:
      x: (M, D) the rows' normed input (cast to float32).
      ids: (M, k) int32, each row's experts.
      weights: (M, k) their routing weights (cast to float32).
      gate, up: (X, F, D) stacked, down (X, D, F), each ``GGUFBlocks`` of ``EXPERT_LAYOUTS``
        (``models.compressed.Products.takes_experts``).
      biases: () or the experts' gate, up and down biases (X, F), (X, F), (X, D) (cast to
        float32).
      activation: ``SwiGLU`` or ``ClampedSwiGLU`` (``models.spec``).
    Raises:
      HxError: the handler cannot be built or loaded (``unavailable`` says why).
    """
    reason = unavailable()
    if reason is not None:
        raise HxError(f"ggml's products are unavailable: {reason}")
    types = [GGUF_BLOCKS[m.blocks_format.name] | (REPACKED if m.repacked else 0)
             for m in (gate, up, down)]
    X = down.blocks.shape[0] // x.shape[-1]
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    biases = [b.astype(jnp.float32) for b in biases] or [jnp.zeros((0,), jnp.float32)] * 3
    clamped = isinstance(activation, ClampedSwiGLU)
    return jax.ffi.ffi_call(MOE_TARGET, out)(
        x.astype(jnp.float32), ids.astype(jnp.int32), weights.astype(jnp.float32), gate.blocks,
        up.blocks, down.blocks, *biases, types=np.array(types, np.int64), experts=np.int64(X),
        threads=np.int64(len(os.sched_getaffinity(0))),
        alpha=np.float32(activation.alpha if clamped else 0.0),
        limit=np.float32(activation.limit if clamped else 0.0))
