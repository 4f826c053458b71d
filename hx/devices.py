"""The two devices hx places work on: the accelerator and the host (DESIGN §3).

``Accelerator`` is the first non-CPU JAX device when one exists. On a machine without one, hx
emulates it: the process is given two XLA CPU devices and device 1 plays the accelerator. Only
reports look at ``Devices.emulated``; no execution path branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from hx.errors import HxError

ACCELERATOR, HOST = "accelerator", "host"
DEVICE_NAMES = (ACCELERATOR, HOST)


def request_two_cpu_devices() -> None:
    """Ask XLA for two CPU devices; a no-op once JAX's backends are initialised."""
    try:
        jax.config.update("jax_num_cpu_devices", 2)
    except RuntimeError:
        pass  # backends already up; ``discover`` reports if that leaves too few devices


@dataclass(frozen=True)
class Devices:
    """The accelerator and host ``jax.Device`` objects, addressed by name."""

    accelerator: jax.Device
    host: jax.Device
    emulated: bool

    def __getitem__(self, name: str) -> jax.Device:
        if name not in DEVICE_NAMES:
            raise KeyError(f"unknown device {name!r}; expected one of {DEVICE_NAMES}")
        return self.accelerator if name == ACCELERATOR else self.host

    def describe(self) -> str:
        """One line for reports, saying whether the accelerator is emulated."""
        acc = f"{self.accelerator.platform}:{self.accelerator.id}"
        if self.emulated:
            acc += " (EMULATED accelerator: a second XLA CPU device, not a GPU)"
        return f"accelerator={acc} host={self.host.platform}:{self.host.id}"


def discover() -> Devices:
    """Find the accelerator and the host.

    Raises:
      HxError: no accelerator exists and JAX was initialised with a single CPU device (import
        hx before running any JAX computation, or set XLA_FLAGS to provide two CPU devices).
    """
    cpus = jax.devices("cpu")
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if accelerators:
        return Devices(accelerator=accelerators[0], host=cpus[0], emulated=False)
    if len(cpus) < 2:
        raise HxError("no accelerator and only one XLA CPU device: import hx before running "
                      "any JAX computation so it can create a second CPU device to emulate one")
    return Devices(accelerator=cpus[1], host=cpus[0], emulated=True)
