"""Several processes on one plan: ``jax.distributed`` joins them (one per host, or per device
group), and each runs the pipeline stages whose accelerators are its own (``hx.pipeline``).

Every process runs the same program on the same inputs: the same plan, the same prompts and
sampling, the stages it owns, and, at each boundary between stages of different processes, one
collective in which all take part (``Broadcast``: an all-reduce over one device per process
where only the stage that made the array gives it, the others zeros -- for two processes a
send; XLA carries it: NCCL between GPUs, gloo between CPU processes). The last stage's logits
reach every process the same way, so each samples the same tokens and feeds the first stage.

One command per process, e.g. two on this machine (one stage each)::

  hx generate -p "The capital of France is" --mesh pp=2 \\
      --coordinator localhost:12355 --processes 2 --process-id 0 &
  hx generate -p "The capital of France is" --mesh pp=2 \\
      --coordinator localhost:12355 --processes 2 --process-id 1

Python: ``hx.distributed.initialize(...)`` before ``hx.discover()``, then
``Engine(model, plan, process_devices(discover(...)))``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from hx.devices import Devices, configure_runtime
from hx.errors import HxError

AXIS = "processes"


def initialize(coordinator: str, processes: int, process_id: int,
               accelerators: int = 1) -> None:
    """Join this process to the others (``jax.distributed.initialize`` with ``coordinator``
    ``host:port``, the address of process 0), before any JAX computation: the runtime set up
    as ``hx.devices.configure_runtime`` does for ``accelerators`` local accelerators, and CPU
    collectives through gloo (emulated accelerators are CPU devices).

    Raises:
      HxError: a process id outside 0 .. processes - 1, or JAX's backends already started.
    """
    if not 0 <= process_id < processes:
        raise HxError(f"process id {process_id} of {processes} processes: 0 to {processes - 1}")
    from hx.devices import _backends_started

    if _backends_started():
        raise HxError("hx.distributed.initialize must come before any JAX computation "
                      "(and before hx.discover())")
    configure_runtime(1 + accelerators)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)


def process_devices(local: Devices) -> list[Devices]:
    """One ``Devices`` per process, in process order: this process's ``local``, and for each
    other its first accelerator (emulated: its second CPU device) and its host CPU device, with
    ``local``'s budgets (every host is taken to be alike). A pipeline of as many stages runs
    stage p in process p."""
    import jax

    out = []
    for p in range(jax.process_count()):
        if p == jax.process_index():
            out.append(local)
            continue
        cpus = [d for d in jax.devices("cpu") if d.process_index == p]
        accs = [d for d in jax.devices() if d.platform != "cpu" and d.process_index == p]
        out.append(dataclasses.replace(
            local, accelerator=dataclasses.replace(local.accelerator,
                                                   device=(accs or cpus[1:])[0], group=()),
            host=dataclasses.replace(local.host, device=cpus[0])))
    return out


def is_local(device: Any) -> bool:
    """Whether ``device`` belongs to this process."""
    import jax

    return device.process_index == jax.process_index()


class Broadcast:
    """An array made in one process, given to every process: an all-reduce (sum) over a mesh
    of one device per process, where the source gives the array and the others zeros (exact:
    x + 0 = x in every dtype).

    Args:
      devices: one device per process (any order; the mesh's axis is ``AXIS``).
    """

    def __init__(self, devices: Sequence[Any]):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.mesh = Mesh(np.array(list(devices)), (AXIS,))
        self.local = next(d for d in devices if is_local(d))
        self.sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
        self._sum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, AXIS), mesh=self.mesh,
                                          in_specs=PartitionSpec(AXIS),
                                          out_specs=PartitionSpec(AXIS)))

    def __call__(self, x: Any | None, shape: tuple[int, ...], dtype: str) -> Any:
        """Every process's copy, on its device of the mesh, of the (``shape``, ``dtype``)
        array ``x`` the source process gives (None in the others)."""
        import jax
        import jax.numpy as jnp

        piece = (jnp.zeros((1,) + tuple(shape), dtype, device=self.local) if x is None
                 else jax.device_put(jnp.asarray(x)[None], self.local))
        whole = jax.make_array_from_single_device_arrays(
            (len(self.mesh.devices),) + tuple(shape), self.sharding, [piece])
        return self._sum(whole).addressable_shards[0].data[0]
