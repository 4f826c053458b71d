"""hx's AVX-512 Q4_0 kernels against ggml's repacked ones, on the same blocks (issue 39; the
table in docs/measurements/log.md, "hx's own Q4_0 and Q8_0 kernels").

Usage: python scripts/avx512_kernels/run.py [--reps 300] [--json OUT.json] [--shape K,N,M ...]

Compiles ``bench.cc`` with g++ (``-O3 -march=native -fopenmp``) against hx's ggml build
(``python -m hx.host_compute.ggml_build``) and ``host_compute/avx512_products.h``, then runs it
at Qwen3-30B-A3B's expert shapes, Llama-2-7B's MLP and SmolLM2's, at one row (the GEMVs: GB/s of
the matrix read) and at 32-512 rows (the GEMMs: GMAC/s), on one thread and two. Needs a CPU with
AVX-512 VNNI (the header's kernels); about a minute on the 2-core development VM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from rich.table import Table

from hx.cli.console import print_table
from hx.host_compute.ggml_build import built, ggml_dir

HERE = Path(__file__).resolve().parent
SHAPES = ((2048, 768, 1), (768, 2048, 1), (4096, 11008, 1), (576, 1536, 1),
          (2048, 768, 32), (768, 2048, 32), (4096, 11008, 64), (2048, 2048, 512))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--shape", action="append", metavar="K,N,M",
                        help="a product of M rows over a K x N matrix (repeatable; default: "
                             "the shapes above)")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shape] if args.shape else SHAPES
    if not built():
        raise SystemExit("ggml is not built: python -m hx.host_compute.ggml_build")
    lib = (ggml_dir() / "lib").resolve()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "bench"
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-std=c++17",
                        str(HERE / "bench.cc"), f"-I{HERE.parents[1] / 'host_compute'}",
                        f"-I{ggml_dir() / 'include'}", f"-L{lib}", "-lggml-cpu", "-lggml-base",
                        f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
        env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "OMP_WAIT_POLICY": "active"}
        rows = []
        for K, N, M in shapes:
            for threads in (1, 2):
                out = subprocess.run([str(exe), str(K), str(N), str(M), str(threads),
                                      str(args.reps if M == 1 else max(10, args.reps // 15))],
                                     env=env, check=True, capture_output=True, text=True)
                _, _, _, _, ggml_us, hx_us, diff = out.stdout.split()
                rows.append({"K": K, "N": N, "rows": M, "threads": threads,
                             "ggml_us": float(ggml_us), "hx_us": float(hx_us),
                             "max_diff_relative": float(diff)})
    table = Table(title="Q4_0 (ggml's repacked layout): ggml's kernels against hx's, median "
                        "of cold calls")
    for col in ("K x N", "rows", "threads", "ggml", "hx", "hx / ggml", "max diff"):
        table.add_column(col, justify="right")
    for r in rows:
        matrix = r["N"] * r["K"] * 18 / 32  # bytes of the blocks
        unit, scale = ("GB/s", matrix / 1e3) if r["rows"] == 1 else (
            "GMAC/s", r["rows"] * r["N"] * r["K"] / 1e3)
        table.add_row(f"{r['K']} x {r['N']}", str(r["rows"]), str(r["threads"]),
                      f"{scale / r['ggml_us']:.1f} {unit}", f"{scale / r['hx_us']:.1f} {unit}",
                      f"{r['ggml_us'] / r['hx_us']:.2f}x", f"{r['max_diff_relative']:.1e}")
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
