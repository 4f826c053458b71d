"""ggml's CPU library, built for this machine: the host kernels llama.cpp runs, for hx's host ops.

ggml ships on PyPI only as source (inside ``llama-cpp-python``'s sdist, which vendors
llama.cpp), and a generic build runs llama.cpp about 3x slower than one built with the
machine's own instructions (SmolLM2 Q4_1 decode on the 2-core VM: 40.8 against 128 tokens/s),
so hx builds it once, at install (``make install`` runs ``python -m hx.host_compute.ggml_build``):
the pinned sdist is downloaded with pip, and only ``ggml-base`` and ``ggml-cpu`` are compiled
with CMake (``GGML_NATIVE=ON``; ``GGML_OPENMP=OFF``, so ggml's own thread pool runs beside XLA's,
polling only briefly after a product, ``ggml_mm.cc``: no OpenMP team spinning between calls).
40-60 s on the 2-core VM. The libraries and headers go to ``ggml_dir()``: ``HX_GGML_DIR`` or ``<venv>/hx-ggml``.
A native build runs only on CPUs with this one's instructions: a venv copied to another machine
rebuilds (``python -m hx.host_compute.ggml_build --force``). ``--tools`` also builds llama.cpp's
``llama-bench`` and ``llama-batched-bench`` from the same source, statically linked, into
``bin/`` (8-10 minutes here): what ``scripts/bench_llama_cpp.py`` compares hx with.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp 0c1e570 (ggml 0.25.3)
LIBRARIES = ("libggml-base.so", "libggml-cpu.so")


def ggml_dir() -> Path:
    """Where ggml's libraries (``lib/``) and headers (``include/``) are: ``HX_GGML_DIR``, else
    ``hx-ggml`` in the running interpreter's prefix (the venv)."""
    return Path(os.environ.get("HX_GGML_DIR", Path(sys.prefix) / "hx-ggml"))


def built(root: Path | None = None) -> bool:
    """Whether ``root`` (default ``ggml_dir()``) holds a finished build."""
    root = root or ggml_dir()
    return (root / "BUILT").exists() and all((root / "lib" / n).exists() for n in LIBRARIES)


TOOLS = ("llama-bench", "llama-batched-bench")


def build(root: Path | None = None, force: bool = False, tools: bool = False) -> Path:
    """Download ``SDIST`` and build ggml's CPU library for this machine into ``root`` (default
    ``ggml_dir()``); nothing to do when built (unless ``force``). ``tools``: llama.cpp's
    ``TOOLS`` too, into ``root / "bin"`` (statically linked, native).

    Raises:
      subprocess.CalledProcessError: pip, CMake or the compiler failed (their output attached).
      FileNotFoundError: cmake or a C++ compiler is not installed.
    """
    root = root or ggml_dir()
    have_tools = all((root / "bin" / t).exists() for t in TOOLS)
    if built(root) and not force and (have_tools or not tools):
        return root
    with tempfile.TemporaryDirectory(prefix="hx-ggml-") as tmp:
        work = Path(tmp)
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", str(work), SDIST])
        sdist = next(work.glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("*/vendor/llama.cpp"))
        out = work / "build"
        run(["cmake", "-S", str(source), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DGGML_OPENMP=OFF", "-DGGML_CCACHE=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"])
        run(["cmake", "--build", str(out), "-j", str(os.cpu_count() or 1), "--target",
             "ggml-cpu"])
        if tools:
            static = work / "static"
            run(["cmake", "-S", str(source), "-B", str(static), "-DCMAKE_BUILD_TYPE=Release",
                 "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CCACHE=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
            run(["cmake", "--build", str(static), "-j", str(os.cpu_count() or 1), "--target",
                 *TOOLS])
        if root.exists():
            shutil.rmtree(root)
        (root / "lib").mkdir(parents=True)
        for so in (out / "bin").glob("libggml*.so*"):
            shutil.copy2(so, root / "lib", follow_symlinks=False)
        shutil.copytree(source / "ggml" / "include", root / "include")
        if tools:
            (root / "bin").mkdir()
            for tool in TOOLS:
                shutil.copy2(static / "bin" / tool, root / "bin")
        (root / "BUILT").write_text(f"{SDIST}\n")
    return root


def run(command: list[str]) -> None:
    """Run ``command``, raising with its output attached when it fails."""
    subprocess.run(command, check=True, capture_output=True, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when built")
    parser.add_argument("--tools", action="store_true",
                        help=f"also build {' and '.join(TOOLS)} (minutes)")
    args = parser.parse_args()
    try:
        print(f"ggml for this CPU in {build(force=args.force, tools=args.tools)}")
    except subprocess.CalledProcessError as e:
        sys.exit(f"building ggml failed: {' '.join(e.cmd[:4])}...: {(e.stderr or '')[-2000:]}")


if __name__ == "__main__":
    main()
