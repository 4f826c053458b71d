"""The two devices hx places work on: the accelerator and the host (DESIGN §3).

``Accelerator`` is the first non-CPU JAX device when one exists. On a machine without one, hx
emulates it: the process is given two XLA CPU devices and device 1 plays the accelerator, with
the memory capacity the user gives (``--accelerator-memory``). Only reports look at
``Accelerator.emulated``; no execution path branches on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from dataclasses import dataclass

import jax

from hx.errors import HxError

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


def configure_runtime() -> None:
    """Process set-up hx needs before any JAX computation.

    * Ask XLA for two CPU devices (the emulated accelerator is the second); a no-op once JAX's
      backends are initialised.
    * Keep freed heap memory for reuse (glibc ``mallopt``): XLA:CPU allocates every buffer with
      malloc, and glibc would otherwise map and unmap each large one, page-faulting it in again
      on every weight copy (measured: a 113 MB host-to-device copy at 1.8 GiB/s instead of
      10 GiB/s). A GPU's allocator pools its memory the same way.
    """
    try:
        jax.config.update("jax_num_cpu_devices", 2)
    except RuntimeError:
        pass  # backends already up; ``discover`` reports if that leaves too few devices
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 2**31 - 1)


@dataclass(frozen=True)
class Accelerator:
    """The device ops are offloaded to.

    Attributes:
      device: the JAX device.
      capacity: bytes hx may allocate on it (None = no limit given).
      emulated: True when ``device`` is an XLA CPU device standing in for a GPU.
    """

    device: jax.Device
    capacity: int | None
    emulated: bool


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
        """One line for reports, saying whether the accelerator is emulated and its budget."""
        d = self.accelerator.device
        acc = f"{d.platform}:{d.id}"
        if self.accelerator.capacity is not None:
            acc += f" budget {format_bytes(self.accelerator.capacity)}"
        if self.emulated:
            acc += " (EMULATED accelerator: a second XLA CPU device, not a GPU)"
        return f"accelerator={acc} host={self.host.device.platform}:{self.host.device.id}"


def discover(accelerator_memory: int | str | None = None,
             host_memory: int | str | None = None) -> Devices:
    """Find the accelerator and the host and set their memory budgets.

    Args:
      accelerator_memory: bytes (or a size string) hx may use on the accelerator. Default: the
        device's own limit when it reports one (a real GPU), else no limit.
      host_memory: bytes hx may use on the host (default: no limit).
    Raises:
      HxError: no accelerator exists and JAX was initialised with a single CPU device (import
        hx before running any JAX computation, or set XLA_FLAGS to provide two CPU devices).
    """
    cpus = jax.devices("cpu")
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if accelerators:
        device, emulated = accelerators[0], False
    elif len(cpus) >= 2:
        device, emulated = cpus[1], True
    else:
        raise HxError("no accelerator and only one XLA CPU device: import hx before running "
                      "any JAX computation so it can create a second CPU device to emulate one")
    if accelerator_memory is None:
        stats = device.memory_stats() or {}
        capacity = stats.get("bytes_limit")
    else:
        capacity = parse_bytes(accelerator_memory)
    return Devices(Accelerator(device, capacity, emulated),
                   Host(cpus[0], None if host_memory is None else parse_bytes(host_memory)))
