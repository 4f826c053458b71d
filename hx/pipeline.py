"""Pipeline parallelism in the executor: the model's layers cut into consecutive stages, each
run by its own ``Executor`` on its own accelerator (or tensor-parallel group of them), with its
own budget and accountant, all beside the one host.

A stage is a model of its own (``ModelSpec.pipeline_stage``): its layers, EMBED's table only in
the first stage and HEAD's only in the last; between stages the residual stream x (B, T, D)
crosses from one accelerator to the next where token ids or logits would go (JAX moves it:
``jax.device_put`` onto the next stage's sharding; on GPUs a peer-to-peer or staged copy, on
one host's emulated devices a memory copy). Each stage's plan is the model's plan cut at its
layers (``ExecutionPlan.stage``), so a plan that streams weights or keeps KV caches on the
host does so in every stage that holds such layers. The host's memory is shared: each stage
is checked against its share (``stage_devices``).

GPipe (Huang et al. 2019) runs micro-batches through the stages so that each stage works on
one while the next works on the one before; here ``run_block`` hands each stage the whole
block in turn, and JAX's asynchronous dispatch lets stage s + 1 start on micro-batch 0 while
stage s still computes later ones, wherever nothing on the host waits in between (a stage's
host attention in numpy does wait).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from hx.devices import Devices
from hx.errors import HxError
from hx.distributed import Broadcast, is_local
from hx.executor import Executor, per_accelerator
from hx.memory import Accountant, MemoryEstimate, check_fits
from hx.models.layers import Cache, Step
from hx.models.spec import EMBED, HEAD, ModelSpec
from hx.models.tensors import activation_shape, layer_key
from hx.plan import ExecutionPlan, stage_cuts
from hx.timeline import Timeline
from hx.workload import Workload


def stage_params(params: dict[str, Any], layers: range, first: bool, last: bool
                 ) -> dict[str, Any]:
    """The loader's parameter tree of one stage: its layers renumbered from 0, EMBED's tree
    in the first stage and HEAD's in the last (empty elsewhere: the pass-through ops)."""
    tree = {layer_key(i): params[layer_key(layer)] for i, layer in enumerate(layers)}
    return {EMBED: params[EMBED] if first else {}, **tree, HEAD: params[HEAD] if last else {}}


def stage_devices(devices: Devices, pp: int) -> list[Devices]:
    """``devices``' accelerators cut into ``pp`` stages of equal tensor-parallel groups (in
    order; one accelerator each where there are ``pp``), each keeping the accelerator budget
    and taking a ``pp``-th of the host's.

    Raises:
      HxError: ``pp`` does not divide the accelerators.
    """
    acc = devices.accelerator
    group = acc.group or (acc.device,)
    if pp < 1 or len(group) % pp:
        raise HxError(f"{pp} pipeline stages over {len(group)} accelerators: the stages need "
                      "equal groups; ask for a multiple of the stage count")
    tp = len(group) // pp
    host = devices.host
    if host.capacity is not None:
        host = dataclasses.replace(host, capacity=host.capacity // pp)
    return [dataclasses.replace(devices, host=host, accelerator=dataclasses.replace(
        acc, device=group[s * tp], group=tuple(group[s * tp:(s + 1) * tp]) if tp > 1 else ()))
        for s in range(pp)]


def plan_targets(spec: ModelSpec, devices: Devices | Sequence[Devices]
                 ) -> list[tuple[ModelSpec, Devices]]:
    """(spec, devices) of each part of a run's plan: on one ``Devices``, the one its
    accelerators each hold (``executor.per_accelerator``); on a list of them, one per
    pipeline stage (``stage_devices``), each stage's (its layers: ``ModelSpec.pipeline_stage``,
    on its devices, per accelerator)."""
    if isinstance(devices, Devices):
        return [per_accelerator(spec, devices)]
    return [per_accelerator(spec.pipeline_stage(layers, first, last), d)
            for (layers, first, last), d in zip(stage_cuts(spec.n_layers, len(devices)),
                                                devices)]


def place(spec: ModelSpec, devices: Devices | Sequence[Devices],
          choose: Callable[[ModelSpec, Devices], ExecutionPlan]) -> ExecutionPlan:
    """The plan of a run of ``spec`` on ``devices``: ``choose(spec, devices)`` of each part
    (``plan_targets``); over pipeline stages, the stages' plans joined
    (``ExecutionPlan.joined``, named "NAME in N stages").

    Raises:
      HxError: ``choose``'s.
    """
    plans = [choose(s, d) for s, d in plan_targets(spec, devices)]
    if isinstance(devices, Devices):
        return plans[0]
    return ExecutionPlan.joined(plans, f"{plans[0].name} in {len(plans)} stages")


def check_stages(spec: ModelSpec, plan: ExecutionPlan, devices: Sequence[Devices],
                 workload: Workload) -> list[MemoryEstimate]:
    """``hx.memory.check_fits`` of each stage's part of ``plan`` on its devices (the shard
    each of its accelerators holds, ``executor.per_accelerator``), before anything is placed.

    Raises:
      HxError: a stage's part does not fit (naming the stage's plan and the bytes over).
    """
    return [check_fits(plan.stage(layers, first, last), *per_accelerator(
        spec.pipeline_stage(layers, first, last), d), workload)
        for (layers, first, last), d in zip(stage_cuts(spec.n_layers, len(devices)), devices)]


def with_budgets(devices: Sequence[Devices], budgets: Sequence[int | None]) -> list[Devices]:
    """Each stage's devices with its own accelerator budget (bytes on each accelerator)."""
    return [dataclasses.replace(d, accelerator=dataclasses.replace(d.accelerator, capacity=b))
            for d, b in zip(devices, budgets)]


class Accountants:
    """The stages' accountants seen as one (``Engine.accountant``): an allocation made
    through it (a cache rewrite's temporary, ``hx.continuous``) is made on every stage, as
    each stage's layers are rewritten in turn; ``peak`` is the highest stage's, the most
    bytes any one accelerator held."""

    def __init__(self, accountants: Sequence[Accountant]):
        self.accountants = list(accountants)

    def allocate(self, owner: str, key: Hashable, nbytes: int) -> None:
        """``Accountant.allocate`` on every stage."""
        for a in self.accountants:
            a.allocate(owner, key, nbytes)

    def free(self, key: Hashable) -> None:
        """``Accountant.free`` on every stage."""
        for a in self.accountants:
            a.free(key)

    @property
    def peak(self) -> int:
        """The highest stage's peak (bytes on one accelerator)."""
        return max(a.peak for a in self.accountants)

    @property
    def highest(self) -> Accountant:
        """The stage's accountant with the highest peak."""
        return max(self.accountants, key=lambda a: a.peak)

    @property
    def capacity(self) -> int | None:
        """The budget of the stage with the highest peak."""
        return self.highest.capacity

    @property
    def peak_by_owner(self) -> dict[str, int]:
        """Bytes by owner at the highest stage's peak."""
        return self.highest.peak_by_owner


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its layers (of the model), spec, plan and devices, and its executor
    (None when another process runs it: ``hx.distributed``)."""

    layers: range
    spec: ModelSpec
    plan: ExecutionPlan
    devices: Devices
    executor: Executor | None


class Pipeline:
    """A model run as pipeline stages, each an ``Executor`` (module docstring), behind the
    executor's own surface (``run``, ``run_block``, ``new_cache``, ``compile``, ``check``...):
    KV caches are one list over the model's layers, as one executor's, each layer's on its
    stage's devices; ``hx.Engine`` runs it when given a device list per stage.

    Stages whose accelerator belongs to another process (``hx.distributed``) are run there: this
    process holds no weights or caches of theirs (empty cache dicts in their layers' places)
    and, where consecutive stages are in different processes, takes part in the collective
    that carries the residual stream across (``distributed.Broadcast``), and in the one that
    brings the last stage's logits to every process.

    Args:
      spec: model shapes; params: the loader's (host) parameter tree; plan: the model's plan.
      devices: one ``Devices`` per stage (``stage_devices``; several processes:
        ``distributed.process_devices``), with their budgets.
      timeline, spill_dir: as ``Executor`` takes them (shared by the stages).
    Attributes:
      stages: the ``Stage``s, first to last.
      accountant: this process's stages' accountants (``Accountants``).
      devices: the devices of this process's last stage (where its logits are sampled).
    Raises:
      HxError: as ``Executor`` raises for a stage's plan; more stages than layers; a process
        that runs none of the stages.
    """

    def __init__(self, spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan,
                 devices: Sequence[Devices], timeline: Timeline | None = None,
                 spill_dir: str | None = None):
        plan.validate(spec)
        self.spec, self.plan, self.timeline = spec, plan, timeline
        self.stages: list[Stage] = []
        for (layers, first, last), stage_devs in zip(stage_cuts(spec.n_layers, len(devices)),
                                                     devices):
            part = spec.pipeline_stage(layers, first, last)
            part_plan = plan.stage(layers, first, last)
            local = is_local(stage_devs.accelerator.device)
            self.stages.append(Stage(layers, part, part_plan, stage_devs, Executor(
                part, stage_params(params, layers, first, last), part_plan, stage_devs,
                timeline, spill_dir) if local else None))
        mine = [stage for stage in self.stages if stage.executor is not None]
        if not mine:
            raise HxError("this process runs none of the pipeline's stages: give it the "
                          "devices of one (hx.distributed.process_devices)")
        owners = {stage.devices.accelerator.device.process_index: stage.devices.accelerator.device
                  for stage in self.stages}
        self._broadcast = Broadcast(list(owners.values())) if len(owners) > 1 else None
        self.accountant = Accountants([stage.executor.accountant for stage in mine])
        self.devices = mine[-1].devices

    @property
    def executors(self) -> list[Executor]:
        """This process's stages' executors, first to last."""
        return [stage.executor for stage in self.stages if stage.executor is not None]

    def check(self, plan: ExecutionPlan, workload: Workload) -> list[MemoryEstimate]:
        """Each stage's check of its part of ``plan`` (``Executor.check``; a stage of
        another process: ``check_fits`` on its devices).

        Raises:
          HxError: a stage's part does not fit its budgets (naming the stage's plan).
        """
        out = []
        for stage, (layers, first, last) in zip(self.stages, stage_cuts(self.spec.n_layers,
                                                                         len(self.stages))):
            part = plan.stage(layers, first, last)
            out.append(stage.executor.check(part, workload) if stage.executor else check_fits(
                part, *per_accelerator(stage.spec, stage.devices), workload))
        return out

    def compile(self, phase: str, batch: int, tokens: int, slots: int) -> None:
        """This process's stages' segments of ``phase`` at (B, T, S), ahead of time."""
        for ex in self.executors:
            ex.compile(phase, batch, tokens, slots)

    def loops(self, batch: int, slots: int) -> bool:
        """False: stages hand each step's activations on, so decode steps one by one
        (``Executor.loops``)."""
        return False

    def new_cache(self, batch: int, length: int, dtype=None, micro: Hashable = 0
                  ) -> list[Cache]:
        """Zeroed KV caches of every layer (``Executor.new_cache`` of each stage), in order;
        empty dicts for the layers of other processes' stages."""
        return [c for stage in self.stages for c in (
            stage.executor.new_cache(batch, length, dtype, micro) if stage.executor
            else [{} for _ in stage.layers])]

    def account_cache(self, caches: list[Cache], micro: Hashable = 0) -> None:
        """``Executor.account_cache`` of each of this process's stages' layers."""
        for stage in self.stages:
            if stage.executor is not None:
                stage.executor.account_cache(caches[stage.layers.start:stage.layers.stop], micro)

    def release_cache(self, micro: Hashable | None = None) -> None:
        """Forget this process's stages' KV caches of ``micro`` (None: all)."""
        for ex in self.executors:
            ex.release_cache(micro)

    def run(self, phase: str, tokens: np.ndarray | Any, step: Step, caches: list[Cache]
            ) -> tuple[Any, list[Cache]]:
        """One forward step of ``phase`` through every stage, as ``Executor.run``: (logits
        (B, V) float32 of the last position, the updated caches of every layer)."""
        logits, out = self.run_block(phase, [tokens], [step], [caches])
        return logits[0], out[0]

    def run_block(self, phase: str, tokens: Sequence[Any], steps: Sequence[Step],
                  caches: Sequence[list[Cache]]) -> tuple[list[Any], list[list[Cache]]]:
        """One step of a block of N micro-batches, as ``Executor.run_block``: each stage runs
        the block on what the stage before it gave (the residual stream x of each
        micro-batch), over its layers' caches (consumed); between processes, ``Broadcast``.
        Returns every process the logits."""
        B, T = np.shape(tokens[0])[:2]
        carried: list[Any] = list(tokens)
        updated = [list(c) for c in caches]
        previous: Stage | None = None
        for stage in self.stages:
            if previous is not None:
                carried = self._cross(previous, stage, carried, B, T)
            if stage.executor is not None:
                carried, out = stage.executor.run_block(
                    phase, carried, steps, [c[stage.layers.start:stage.layers.stop]
                                            for c in caches])
                for m, part in enumerate(out):
                    updated[m][stage.layers.start:stage.layers.stop] = part
            previous = stage
        if self._broadcast is not None:  # the logits, to every process
            carried = self._cross(previous, None, carried, B, T)
        return carried, updated

    def _cross(self, source: Stage, target: Stage | None, arrays: list[Any], B: int, T: int
               ) -> list[Any]:
        """``arrays`` (``source``'s outputs) where ``target`` (None: every process) takes
        them: as they are within a process, through ``Broadcast`` between processes."""
        here = source.devices.accelerator.device.process_index
        if target is not None and target.devices.accelerator.device.process_index == here:
            return arrays
        shape, dtype = activation_shape(source.spec, "logits", B, T)
        mine = source.executor is not None
        return [self._broadcast(a if mine else None, shape, dtype) for a in arrays]
