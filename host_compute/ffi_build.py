"""Building XLA FFI handlers: C++ sources compiled with g++ into one shared library, cached.

``kernel_dir`` names the cache folder of one build (``HX_KERNEL_DIR`` or ``~/.cache/hx/kernels``,
then a digest of what the library depends on); ``compile_handler`` compiles into it once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import jax


def kernel_dir(*depends: bytes) -> Path:
    """Where a handler is built: ``HX_KERNEL_DIR`` or ``~/.cache/hx/kernels``, then a digest of
    ``depends`` (its source, the versions and builds it links) and of jaxlib's version."""
    root = Path(os.environ.get("HX_KERNEL_DIR", Path.home() / ".cache" / "hx" / "kernels"))
    return root / hashlib.sha256(b"".join(depends) + jax.__version__.encode()).hexdigest()[:16]


def compile_handler(sources: list[Path], so: Path, flags: list[str]) -> Path:
    """``so``, compiled from ``sources`` with g++ (``-O2 -shared -fPIC``, jaxlib's FFI headers,
    then ``flags``) when missing; written under a temporary name and renamed once whole, so a
    process never loads half a library another is writing.

    Raises:
      OSError, subprocess.CalledProcessError: no compiler, or the build failed.
    """
    if so.exists():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    partial = so.with_name(f"{so.name}.{os.getpid()}")
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
                    *map(str, sources), *flags, "-o", str(partial)], check=True, capture_output=True)
    partial.rename(so)
    return so
