"""The two devices hx places work on: the accelerator and the host (docs/architecture.md, "Devices
and memory").

``Accelerator`` is the first non-CPU JAX device when one exists. On a machine without one, hx
emulates it: the process is given two XLA CPU devices and device 1 plays the accelerator, with
the memory capacity the user gives (``--accelerator-memory``). Only reports look at
``Accelerator.emulated``; no execution path branches on it.

On a GPU, XLA's allocator is told not to preallocate (``configure_runtime``) and, when the first
``discover`` call that starts JAX's backends is given a budget, its pool is capped at that budget
plus ``pool_headroom`` (see ``discover`` for exactly what is and is not guaranteed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hx.errors import HxError

if TYPE_CHECKING:  # JAX is imported where a device is first needed (``configure_runtime``)
    import jax

ACCELERATOR, HOST = "accelerator", "host"
DEVICE_NAMES = (ACCELERATOR, HOST)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"48MiB"``, ``"1.5GB"``, ``"135000000"`` -> bytes (binary units KiB/MiB/GiB, decimal
    KB/MB/GB).

    Raises:
      HxError: not a number with a known unit.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise HxError(f"cannot read {text!r} as a size; write e.g. 48MiB, 1.5GB or 135000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Bytes as MiB with two decimals, for messages (exact byte counts are given alongside)."""
    return f"{n / 2**20:.2f} MiB"


# Environment variables XLA's GPU client reads once, when JAX's backends start
# (jaxlib.xla_client.generate_pjrt_gpu_plugin_options). XLA_CLIENT_MEM_FRACTION is the current
# name of the fraction; jax refuses to start when both it and the deprecated name are set.
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION_ENV = "XLA_CLIENT_MEM_FRACTION"
MEM_FRACTION_ENVS = (MEM_FRACTION_ENV, "XLA_PYTHON_CLIENT_MEM_FRACTION")

POOL_HEADROOM_MIN = 2**30  # bytes
POOL_HEADROOM_FRACTION = 0.10


HOST_HEADROOM_MIN = 2**30  # bytes
HOST_HEADROOM_FRACTION = 0.10


def available_host_memory() -> int | None:
    """Bytes of memory the host can give now without swapping (``MemAvailable`` of
    /proc/meminfo: free memory plus the page cache and slabs the kernel can reclaim), or None
    where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_host_memory() -> int | None:
    """The host budget when none is given: the memory available now (``available_host_memory``)
    minus a headroom of max(1 GiB, 10 %) for what hx does not count (the Python process, JAX's
    runtime, compiled programs, the page cache of mapped files); None where the available memory
    is unknown."""
    available = available_host_memory()
    if available is None:
        return None
    return max(0, available - max(HOST_HEADROOM_MIN, int(HOST_HEADROOM_FRACTION * available)))


def pool_headroom(budget: int) -> int:
    """Bytes XLA's GPU pool may hold beyond an accelerator budget of ``budget`` bytes:
    max(1 GiB, 10 % of the budget).

    It is for what XLA allocates from its pool that hx does not account (XLA's temporaries of a
    running program are in the budget: the accountant books ``Compiled.memory_analysis()``):

    * compile-time autotuning, which allocates its own copy of every operand and output of the
      fusion it tunes plus redzones — for SmolLM2's float32 LM head, 124 MiB;
    * cuBLAS/cuDNN workspaces XLA takes from its allocator, and arrays on their way to a
      device (~50 MiB);
    * the BFC allocator's fragmentation: without preallocation its pool grows in regions of
      doubling size.

    Measured on an H100 (jax 0.11.2), SmolLM2-135M float32: XLA's peak bytes in use exceeded
    the accountant's peak by ~175 MiB (stream-all at a 128 MiB budget: 300 of 123 MiB;
    all-accelerator: 694 of 520 MiB), and a pool of budget + 256 MiB ran out while autotuning
    the head. A model whose largest weight matrix is near the headroom or larger (Llama-3-70B's
    bf16 head is 2.1 GB) can exceed it at small budgets: set ``XLA_CLIENT_MEM_FRACTION`` then.
    """
    return max(POOL_HEADROOM_MIN, int(budget * POOL_HEADROOM_FRACTION))


_CONFIGURED = False
XLA_CACHE_ENV = "HX_XLA_CACHE"  # the persistent compilation cache's folder, or "off"


def configure_runtime(cpu_devices: int = 2) -> None:
    """Process set-up hx needs before any JAX computation; ``discover`` and the CLI call it
    (``import hx`` does not: importing has no side effects), and later calls do nothing.

    * Ask XLA for ``cpu_devices`` CPU devices (the host, then emulated accelerators: two for
      one accelerator, ``discover(accelerators=k)`` asks 1 + k); a no-op once JAX's backends
      are initialised.
    * ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the environment already sets it (a user's
      value wins): XLA's GPU allocator then grows its pool on demand instead of taking 75 % of
      the GPU's memory when the backend starts, so two hx processes (a CLI test's subprocess
      beside pytest, say) can share one GPU, and the pool holds what hx's buffers and XLA's
      own needs use rather than a fixed share. Child processes inherit the setting. Without
      effect when JAX's backends were started before ``import hx``.
    * ``jax_default_matmul_precision = "highest"``: float32 dots and convolutions compute in
      full float32 on every backend. XLA would otherwise run them at TF32 on NVIDIA GPUs
      (Ampere and later; logits then differ from a float32 reference by ~1e-3). Operands of
      16-bit types are unaffected (bf16 computes as bf16 with float32 accumulation).
    * Keep freed heap memory for reuse (glibc ``mallopt``): XLA:CPU allocates every buffer with
      malloc, and glibc would otherwise map and unmap each large one, page-faulting it in again
      on every weight copy (measured: a 113 MB host-to-device copy at 1.8 GiB/s instead of
      10 GiB/s). A GPU's allocator pools its memory the same way.
    * ``OMP_WAIT_POLICY=PASSIVE`` unless set: torch's OpenMP threads (the host int4 kernel,
      ``host_compute.int4_kernel``) then sleep at barriers instead of spinning beside XLA's
      pool (measured on 2 cores: a 0.5 ms linear took 32 ms with spinning threads). Read when
      torch starts its threads.
    * A persistent compilation cache (``jax_compilation_cache_dir``): ``HX_XLA_CACHE``, default
      ``~/.cache/hx/xla``; ``off`` disables it. Unbounded: JAX's size bound
      (``jax_compilation_cache_max_size``) rescans every entry under a file lock at each write,
      which made the test suite's 2,100 programs quadratic (delete the folder to reclaim it; the
      whole suite's programs take 56 MB). Every program hx compiles is kept there, so a
      later run (or another process: a batch job's workers, the test suite's) loads it instead
      of compiling it again: XLA compilation, not decode, dominated a first run on the H200
      (docs/measurements/h200-2026-11-27), and a program of 60 matmuls compiled in 2.1 s on the
      2-core VM loads in 0.23 s.
    """
    global _CONFIGURED
    if _CONFIGURED:
        return
    _CONFIGURED = True
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:
        pass  # backends already up; ``discover`` reports if that leaves too few devices
    os.environ.setdefault(PREALLOCATE_ENV, "false")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    jax.config.update("jax_default_matmul_precision", "highest")
    cache = os.environ.get(XLA_CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "hx",
                                                       "xla"))
    if cache != "off":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 2**31 - 1)


def _libc():
    """The C library, or None where ctypes cannot find one."""
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_free_heap() -> None:
    """Return the heap memory malloc holds free to the operating system (glibc
    ``malloc_trim(0)``; nothing elsewhere). ``configure_runtime`` keeps freed memory for reuse,
    so the resident set would otherwise stay at its high-water mark: call it once the
    compilations of a run are done, whose temporaries (XLA's and LLVM's) are garbage from then
    on -- before the run allocates its KV caches and activations on top of them."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@dataclass(frozen=True)
class Accelerator:
    """The device ops are offloaded to.

    Attributes:
      device: the JAX device.
      capacity: bytes hx may allocate on it (None = no limit given); on each of ``group``.
      emulated: True when ``device`` is an XLA CPU device standing in for a GPU.
      pool_limit: bytes XLA's allocator for the device may hold at most (its ``bytes_limit``),
        fixed when JAX's backends started; None when the device reports none (XLA:CPU).
      group: every accelerator of a ``discover(accelerators=k)`` (``device`` first), one
        budget each; ``mesh`` lays them out for tensor parallelism.
    """

    device: jax.Device
    capacity: int | None
    emulated: bool
    pool_limit: int | None = None
    group: tuple[jax.Device, ...] = ()

    def mesh(self, axis: str = "tp") -> "jax.sharding.Mesh":
        """A one-axis ``jax.sharding.Mesh`` named ``axis`` over the group (``device`` alone
        when there is none)."""
        import numpy as np
        from jax.sharding import Mesh

        return Mesh(np.array(self.group or (self.device,)), (axis,))


@dataclass(frozen=True)
class Host:
    """The host CPU: the device host-placed ops run on, and its memory capacity (None = no
    limit given)."""

    device: jax.Device
    capacity: int | None = None


@dataclass(frozen=True)
class Devices:
    """The accelerator and the host, addressed by name (``"accelerator"`` / ``"host"``)."""

    accelerator: Accelerator
    host: Host

    @property
    def emulated(self) -> bool:
        return self.accelerator.emulated

    def __getitem__(self, name: str) -> jax.Device:
        """The ``jax.Device`` called ``name``."""
        if name not in DEVICE_NAMES:
            raise KeyError(f"unknown device {name!r}; expected one of {DEVICE_NAMES}")
        return self.accelerator.device if name == ACCELERATOR else self.host.device

    def describe(self) -> str:
        """One line for reports, saying whether the accelerator is emulated, its budget and the
        cap of XLA's memory pool on it (when the device has one)."""
        d, group = self.accelerator.device, self.accelerator.group
        acc = (f"{len(group)} x {d.platform} ({', '.join(str(g.id) for g in group)}), tensor "
               "parallel" if group else f"{d.platform}:{d.id}")
        if self.accelerator.capacity is not None:
            acc += f" budget {format_bytes(self.accelerator.capacity)}"
        if self.accelerator.pool_limit is not None:
            acc += f" (XLA pool <= {format_bytes(self.accelerator.pool_limit)})"
        if self.emulated:
            acc += " (EMULATED accelerator: a second XLA CPU device, not a GPU)"
        host = f"{self.host.device.platform}:{self.host.device.id}"
        if self.host.capacity is not None:
            host += f" budget {format_bytes(self.host.capacity)}"
        return f"accelerator={acc} host={host}"


def _cuda_total_memory() -> int | None:
    """Bytes of memory of the CUDA device JAX will number 0, read through the CUDA driver
    (``cuDeviceTotalMem``: no CUDA context is created, so nothing is allocated on the GPU), or
    None when there is no CUDA driver or device, or JAX is restricted to other platforms.

    Device 0 is the first device the driver lists (``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER`` apply, as they do to XLA), or the lowest of
    ``jax_cuda_visible_devices`` when that is set.
    """
    import jax

    platforms = jax.config.jax_platforms
    if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, device, total = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or not count.value:
        return None
    ordinal = 0
    try:
        from jax._src import xla_bridge

        visible = xla_bridge.CUDA_VISIBLE_DEVICES.value
        if visible != "all":
            ordinal = min(int(x) for x in visible.split(","))
    except (ImportError, AttributeError, ValueError):
        pass
    if (cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0
            or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0):
        return None
    return total.value


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return True  # cannot tell: act as if too late to configure the pool


def _cap_pool(limit: int) -> bool:
    """Set XLA's GPU memory fraction so that its pool on the device holds at most ``limit``
    bytes, when a CUDA device is present and the user set no fraction. Returns whether the
    variable was set (the caller removes it once the backends have started)."""
    if any(os.environ.get(name) for name in MEM_FRACTION_ENVS):
        return False  # the user's setting wins
    total = _cuda_total_memory()
    if total is None:
        return False
    os.environ[MEM_FRACTION_ENV] = repr(min(1.0, limit / total))
    return True


def discover(accelerator_memory: int | str | None = None,
             host_memory: int | str | None = None, accelerators: int = 1) -> Devices:
    """Find the accelerator (or ``accelerators`` of them: ``Accelerator.group``) and the host
    and set their memory budgets.

    XLA's memory pool on a GPU: XLA reads its allocator settings once, when JAX's backends
    start (the first JAX computation or device query of the process). If this call starts them,
    is given ``accelerator_memory``, a CUDA device is present and neither
    ``XLA_CLIENT_MEM_FRACTION`` nor ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is set, the pool is
    capped at ``accelerator_memory + pool_headroom(accelerator_memory)`` bytes (at most the
    GPU's memory) by setting ``XLA_CLIENT_MEM_FRACTION`` for the start and removing it after, so
    child processes do not inherit it. Otherwise the pool keeps the limit it started with:
    XLA's default of 75 % of the GPU's memory, or the user's fraction. With preallocation off
    (``configure_runtime``) the pool grows on demand up to that limit.

    Guaranteed: XLA's allocator (the BFC pool behind every buffer and temporary of JAX arrays
    and compiled programs on the device, compile-time autotuning included) never holds more
    than ``Accelerator.pool_limit`` bytes; past it an allocation fails with XLA's
    RESOURCE_EXHAUSTED. Not covered by the cap: the CUDA context, loaded kernels and the handles
    cuBLAS/cuDNN create outside XLA's allocator (~560 MiB per process, measured on an H100), and
    pinned host memory. A budget larger than ``pool_limit`` is returned as given (plans may
    be made for other hardware, e.g. ``hx plan -m llama2-70b``), but a plan needing more than
    ``pool_limit`` cannot run in this process. A process that calls ``discover`` with several
    budgets (``hx ablate``) gets the pool of the call that started the backends: make that the
    largest budget.

    Args:
      accelerator_memory: bytes (or a size string) hx may use on the accelerator. Default: the
        device's own limit when it reports one (a real GPU: XLA's pool limit), else no limit.
      host_memory: bytes hx may use on the host: its weights (a float16 model's float32 copies for host
        compute included), host KV caches and disk read buffers. Default: ``default_host_memory()``,
        the memory available now minus max(1 GiB, 10 %).
      accelerators: how many accelerators to take (the first ones JAX lists; emulated: CPU
        devices 1 .. k, the process asking XLA for 1 + k), each with ``accelerator_memory``.
    Raises:
      HxError: fewer accelerators than asked, or none and JAX initialised with too few CPU
        devices to emulate them (call ``discover`` or ``configure_runtime`` before running
        any JAX computation); or a size cannot be read.
    """
    import jax

    if accelerators < 1:
        raise HxError(f"accelerators={accelerators}: take 1 or more")
    configure_runtime(1 + accelerators)
    budget = None if accelerator_memory is None else parse_bytes(accelerator_memory)
    host = default_host_memory() if host_memory is None else parse_bytes(host_memory)
    capped = budget is not None and not _backends_started() and _cap_pool(
        budget + pool_headroom(budget))
    try:
        cpus = jax.local_devices(backend="cpu")  # starts every backend; this process's own
    finally:
        if capped:
            os.environ.pop(MEM_FRACTION_ENV, None)
    found = [d for d in jax.local_devices() if d.platform != "cpu"]
    emulated = not found
    group = found[:accelerators] if found else cpus[1:1 + accelerators]
    if len(group) < accelerators:
        kind = "accelerators" if found else "XLA CPU devices besides the host's"
        raise HxError(f"{accelerators} accelerators asked, {len(group)} {kind} found"
                      + ("" if found else ": call hx.discover() (or hx.devices."
                         "configure_runtime()) before running any JAX computation, so that hx "
                         "can create CPU devices to emulate them"))
    device = group[0]
    pool_limit = (device.memory_stats() or {}).get("bytes_limit")
    capacity = pool_limit if budget is None else budget
    return Devices(Accelerator(device, capacity, emulated, pool_limit,
                               tuple(group) if accelerators > 1 else ()),
                   Host(cpus[0], host))
