"""Executor: runs a model segment by segment where an ``ExecutionPlan`` says (docs/architecture.md,
"The executor").

At construction every op's weights go to their home: ``resident`` into accelerator memory,
``streamed`` into the accelerator's ``pinned_host`` memory kind, ``host`` onto the host CPU
device, ``disk`` as read-only views of a mapped file (``hx.disk``: the checkpoint's, or a spill
file written once) -- in the model's dtype, except that a float16 model's host segments hold
float32 copies made once, here (``models.spec.host_dtype``: XLA:CPU has no fast float16
product).
Compressed matrices (``models.formats``) are placed as they are held -- codes, scales and
offsets -- and decompressed inside each program right before use, so streaming moves their
compressed bytes. Each
step (``run``) interprets the instructions of the step's ``hx.schedule.Schedule`` -- the same
list, with the same dependency edges, the simulator prices and the memory estimate sizes -- one
handler per instruction kind (``_BlockStep``):

* ``read``: read a segment's disk-homed weights into host memory (``hx.disk``), just before
  its stage, on the disk thread, and release their mapped pages;
* ``stage``: ``device_put`` a streaming segment's weights into accelerator memory, issued before
  the segment ahead of it is launched (prefetch depth 1, double buffer); after a read, on the
  disk thread too;
* ``wait``: block until a streaming segment has finished, then drop its staged weights (and
  its read buffers, releasing the disk-homed weights' pages);
* ``step``/``move``: put the step inputs and the activations a segment reads on its device;
* ``launch``: run the segment's executable (compiled ahead of time from shapes by
  ``hx.programs``; KV caches are donated, so appends are in place). In a block of several
  micro-batches a host segment that attends in numpy (``hx.programs.SplitHostProgram``), or
  reads what one produces, goes to the host stream (``hx.host_compute.stream``, one worker
  thread) so the numpy attention does not hold up the next micro-batch's accelerator work;
  its results are waited for where they are copied to the accelerator, and at the step's end
  (other host segments are dispatched in place: a thread hop each cost this 2-core VM's
  2 x 8 and 4 x 4 SmolLM2 blocks 17 % and 8 %);
* ``act load``, ``kv load``, ``recompute``, ``kv store``: a ``streamed`` KV cache's copies in
  and out and its KV recompute (``hx.streamed_kv``);
* ``free``: end of step.

``run_block`` runs a block of micro-batches through one such schedule (the zig-zag block
schedule: a staged layer serves every micro-batch before it is dropped); ``run`` is a block of
one.

The accountant applies every instruction's allocations with the real sizes of the arrays (and
XLA's temporary bytes of the real executable); the timeline, when given, records every copy and
launch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hx import disk, routed_experts, streamed_kv
from hx.devices import ACCELERATOR, HOST, Devices, discover
from hx.errors import HxError
from hx.host_compute import stream
from hx.memory import UNSIZED, Accountant, MemoryEstimate, check_fits
from hx.models.formats import DENSE
from hx.models.layers import Cache, Step
from hx.models.mapped import is_mapped, release
from hx.models.moe import part_params
from hx.models.ops import EXPERTS_STREAMED
from hx.models import sharding
from hx.models.tensors import (held_weights, kv_arrays, layer_key, layer_slots, step_limit,
                               weight_dtype, widest_slots)
from hx.models.spec import EMBED, HEAD, ModelSpec, numpy_dtype
from hx.plan import DISK, PHASES, RESIDENT, STREAMED, ExecutionPlan, weight_owners
from hx.programs import SplitHostProgram, programs_for
from hx.routed_pairs import RoutedPairs
from hx.sampling import Sampler
from hx.schedule import (ACT_LOAD, EXPERTS_IN, FREE, INPUT_KEY, KV_LOAD, KV_STORE, LAUNCH, MOVE,
                         READ, RECOMPUTE, ROUTE, STAGE, STEP, TEMP_KEY, WAIT, Instruction,
                         Schedule, act_copy_key, act_key, cache_key, compile_schedule, copy_end,
                         copy_key, experts_key, head_key, staging_key, step_key,
                         streamed_layers)
from hx.segments import routed_slots, split_segments
from hx.timeline import ACC_COMPUTE, D2H, H2D, HOST_COMPUTE, Timeline
from hx.workload import Workload


def op_params(params: dict[str, Any], layer: int | None, op: str) -> Any:
    """The parameter subtree owned by ``op`` of ``layer`` (None for EMBED/HEAD)."""
    return params[op] if op in (EMBED, HEAD) else params[layer_key(layer)][op]


def leaf_path(path: tuple) -> str:
    """A ``jax.tree_util`` key path of a parameter tree as the ``wq/kernel`` names that
    ``models.tensors.held_weights`` and ``models.sharding.partition`` take."""
    return "/".join(str(k.key) for k in path)


def held_dtype(held: dict[str, tuple], path: tuple) -> np.dtype:
    """The numpy dtype ``held`` (``models.tensors.held_weights`` of an op) gives the leaf at
    ``path`` (a ``jax.tree_util`` key path) of that op's tree."""
    return numpy_dtype(held[leaf_path(path)][1])


def held_params(spec: ModelSpec, params: dict[str, Any], device: str) -> dict[str, Any]:
    """The whole parameter tree as ``device`` holds it (``models.tensors.held_weights``: dense
    tensors converted to its dtype, compressed arrays as they are); a tied embedding stays one
    array."""
    converted: dict[tuple[int, str], Any] = {}

    def op_tree(op: str, tree: Any) -> Any:
        held = held_weights(spec, op, device)

        def cast(path, leaf):
            want = held_dtype(held, path)
            key = (id(leaf), want.name)
            if key not in converted:
                converted[key] = leaf if leaf.dtype == want else leaf.astype(want)
            return converted[key]

        return jax.tree_util.tree_map_with_path(cast, tree)

    return {key: (op_tree(key, tree) if key in (EMBED, HEAD)
                  else {op: op_tree(op, t) for op, t in tree.items()})
            for key, tree in params.items()}


def per_accelerator(spec: ModelSpec, devices: Devices) -> tuple[ModelSpec, Devices]:
    """(spec, devices) that plans and memory checks take for a model on ``devices``: on a
    group of k accelerators, the shard each holds (``ModelSpec.shard`` of the padded model)
    beside a k-th of the host's budget, as the planner prices them (``planner.mesh``); on one
    accelerator, ``spec`` and ``devices`` themselves."""
    tp = len(devices.accelerator.group) or 1
    if tp == 1:
        return spec, devices
    host = devices.host
    return sharding.padded_spec(spec, tp).shard(tp), dataclasses.replace(
        devices, host=dataclasses.replace(
            host, capacity=None if host.capacity is None else host.capacity // tp))


def _refuse_on_a_mesh(plan: ExecutionPlan, tp: int) -> None:
    """What the executor does not run over several accelerators yet (issue 28): disk-homed
    weights and streamed KV caches.

    Raises:
      HxError: the plan has either.
    """
    if any(home == DISK for _, _, home in plan.held_ops()) or STREAMED in plan.kv:
        raise HxError(f"plan {plan.name!r} keeps weights on disk or KV caches streamed: over "
                      f"{tp} accelerators hx runs weights resident, streamed or on the host, and "
                      "KV caches on either side, not yet these")


def device_bytes(x: Any) -> int:
    """Bytes of array ``x`` on each device that holds it: its shard where a mesh splits it
    (``jax.sharding.Sharding.shard_shape``), else all of it."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return x.nbytes
    return math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays in ``tree`` on each device that holds them (``device_bytes``)."""
    return sum(device_bytes(x) for x in jax.tree.leaves(tree))


class Executor:
    """Runs prefill and decode steps of a model under an ``ExecutionPlan``.

    Args:
      spec: model shapes.
      params: host (numpy) parameter tree from a loader.
      plan: op placement, weight and KV homes; its structure is validated against ``spec``.
      devices: accelerator (with its budget) and host; discovered when omitted.
      timeline: records segments and transfers when given.
      spill_dir: where disk-homed weights that are not views of a file in the held dtype are
        written once, to an unnamed spill file (``hx.disk``); None refuses such plans.

    On a group of accelerators (``discover(accelerators=k)``) the model runs tensor parallel
    over their mesh: heads and feed-forward rows padded to split evenly and every weight and
    KV cache on the accelerators split as ``models.sharding`` says, activations whole on each;
    XLA partitions the segments and adds the all-reduces. Budgets are per accelerator.
    Attributes:
      accountant: every accelerator allocation, with the peak (bytes on each accelerator).
      sizing: (spec, devices) that memory checks of its plans take: the shard each accelerator
        holds (``ModelSpec.shard``) beside its share of the host.
      programs: the shared ``hx.programs.Programs`` its segments are compiled by.
      compilations: distinct segment executables (signature and shapes) it has used.
      spilled_bytes: bytes of disk-homed weights written to the spill file.
    Raises:
      HxError: the plan does not match the model, or its weights and one row's KV cache do not
        fit the budgets (each run's shapes, XLA temporaries included, are checked by
        ``Engine.check``); it keeps KV caches on disk (``plan.refusal``); it keeps weights on
        disk that need a spill file and ``spill_dir`` is None.
      BudgetExceeded: an allocation passes the accelerator budget (check plans with
        ``hx.memory.check_fits`` first).
    """

    def __init__(self, spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan,
                 devices: Devices | None = None, timeline: Timeline | None = None,
                 spill_dir: str | None = None):
        plan.validate(spec)  # refuses what the executor does not run (``plan.refusal``)
        self.devices = devices or discover()
        tp = len(self.devices.accelerator.group) or 1
        if tp > 1:  # tensor parallel over the accelerators' mesh: heads padded to split evenly
            _refuse_on_a_mesh(plan, tp)
            spec, params = sharding.pad(spec, params, tp)
        self.spec, self.plan = spec, plan
        self.programs = programs_for(spec, self.devices)
        self.sizing = per_accelerator(spec, self.devices)
        # before placing any weight: do its weights and one row's KV cache fit at all? (each
        # workload's exact check is ``Engine.check``'s; temporaries are not sized here)
        check_fits(plan, *self.sizing, Workload(1, 1, 1), self.programs, UNSIZED)
        self.timeline = timeline
        # a Mixture of Experts' routed (token, expert) pairs by where they ran
        self.routed = RoutedPairs(spec, plan) if spec.moe else None
        self.accountant = Accountant(self.devices.accelerator.capacity)
        self.compilations = 0
        acc = self.devices.accelerator.device
        self._acc_memory = self.programs.shardings[ACCELERATOR]
        self._pinned = SingleDeviceSharding(acc, memory_kind="pinned_host")  # disk reads
        self.segments = {phase: split_segments(plan, phase) for phase in PHASES}
        self._params = self._place_weights(params, spill_dir)
        self._on_disk = {phase: [tuple(plan.weight_home(layer, op) == DISK
                                       for layer, op in seg.ops) for seg in segs]
                         for phase, segs in self.segments.items()}
        self._schedules: dict[tuple, Schedule] = {}
        self._executables: dict[tuple, tuple[Any, int]] = {}
        self._shapes: set[tuple] = set()  # (signature, B, T, S) this executor has used
        self._kv_keys: set[tuple] = set()  # accountant keys of live KV caches

    def _place_weights(self, params: dict[str, Any], spill_dir: str | None
                       ) -> dict[str, list[tuple]]:
        """Every segment's weight trees, by phase, placed at their homes (``_place``; a part
        of an MoE layer's experts cut from its stacks once, a streamed part one tree an
        expert); sets ``spilled_bytes`` (the disk tier's)."""
        spec, plan = self.spec, self.plan
        placed: dict[tuple[int, str, str], Any] = {}  # (id(array), home, dtype) -> placed
        tier = disk.DiskTier(spill_dir, plan.name)
        parts: dict[tuple[int, str], Any] = {}  # (layer, op) -> a part of an MoE layer's
        cut: list[Any] = []  # the parts' host trees, alive while placing: ``placed`` keys ids

        def part(layer: int, op: str, ids: tuple[int, ...]) -> Any:
            cut.append(part_params(op_params(params, layer, "MLP2"), op, ids,
                                   spec.moe.routed))
            return cut[-1]

        def held(layer: int | None, op: str, device: str) -> Any:
            home = plan.weight_home(layer, op) or HOST
            if plan.experts.part(layer, op) < 0:  # the op whole, not a part
                return self._place(op_params(params, layer, op), layer, op, home, device,
                                   placed, tier)
            if (layer, op) not in parts:  # made once: both phases' segments hold the one
                ids = dict(plan.experts.groups(layer)).get(op, ())
                if op == EXPERTS_STREAMED:  # one tree an expert, in memory or on disk
                    parts[(layer, op)] = tuple(
                        self._place(part(layer, op, (e,)), layer, op, DISK if on_disk else home,
                                    device, placed, tier)
                        for e, on_disk in zip(ids, plan.experts.on_disk(layer)))
                else:
                    parts[(layer, op)] = self._place(part(layer, op, ids), layer, op, home,
                                                     device, placed, tier)
            return parts[(layer, op)]

        placed_params = tier.finish({
            phase: [tuple(held(layer, op, seg.device) for layer, op in seg.ops) for seg in segs]
            for phase, segs in self.segments.items()})
        self.spilled_bytes = tier.spilled_bytes
        return placed_params

    def _place(self, tree, layer: int | None, op: str, home: str, device: str,
               placed: dict[tuple[int, str, str], Any], tier: disk.DiskTier) -> Any:
        """``op``'s weight ``tree`` held at ``home`` for a segment on ``device``, in the dtypes
        ``held_weights`` gives: on disk through ``tier``, else placed (a mapped leaf's pages
        released once placed, accelerator-resident bytes allocated to the accountant).
        ``placed`` ((id(array), home, dtype) -> placed) makes a tied embedding one buffer per
        home and dtype."""
        held = held_weights(self.plan.op_spec(self.spec, layer, op), op, device)

        def put(path, leaf):
            want = held_dtype(held, path)
            key = (id(leaf), home, want.name)
            if key in placed:  # a tied embedding is one buffer per home and dtype
                return placed[key]
            if home == DISK:
                placed[key] = tier.hold(leaf, want, op if layer is None
                                        else f"layer {layer} {op}")
            else:
                where = (self.programs.shardings[HOST] if home == HOST else
                         self.programs.weight_sharding(
                             ACCELERATOR, leaf_path(path), leaf.shape,
                             "pinned_host" if home == STREAMED else "device"))
                placed[key] = jax.device_put(
                    leaf if leaf.dtype == want else leaf.astype(want), where)
                if is_mapped(leaf):  # once the placed buffer holds it, drop the file's pages
                    placed[key].block_until_ready()
                    release(leaf)
                if home == RESIDENT:
                    self.accountant.allocate("weights", ("weights", key),
                                             device_bytes(placed[key]))
            return placed[key]

        return jax.tree_util.tree_map_with_path(put, tree)

    # -- another plan ------------------------------------------------------------------------

    def params_tree(self) -> dict[str, Any]:
        """The weights as placed, in the loader's tree (``{"EMBED", "layer_i": {op}, "HEAD"}``):
        each op's trees as its decode segment holds them (a tied embedding: EMBED's)."""
        tree: dict[str, Any] = {}
        for seg, params in zip(self.segments["decode"], self._params["decode"]):
            for (layer, op), p in zip(seg.ops, params):
                if layer is None:
                    tree[op] = p
                else:
                    tree.setdefault(layer_key(layer), {})[op] = p
        if self.spec.tie_embeddings:
            tree[HEAD] = {**tree[HEAD], "embedding": tree[EMBED]["embedding"]}
        return tree

    def switched(self, plan: ExecutionPlan, spill_dir: str | None = None) -> "Executor":
        """An executor of ``plan`` on the same devices, made from this one's placed weights
        (those whose home and dtype stay are not copied; this executor is not usable after).
        Weights that leave accelerator memory go first, before any weight arrives, so the
        switch holds at most what either plan holds, not both. Its accountant carries this
        one's peak. Raises as ``Executor``, and ``HxError`` where either plan places routed
        experts one by one (``ExpertHomes``: a switch between such plans is not built)."""
        if self.plan.experts.layers or plan.experts.layers:
            raise HxError(f"switching from plan {self.plan.name!r} to {plan.name!r}: hx does "
                          "not switch plans that place routed experts one by one yet; run "
                          "one plan for the whole run")
        params, self._params = self.params_tree(), {}
        moved: dict[int, Any] = {}  # id(old leaf) -> its new copy: a tied embedding stays one
        host = self.programs.shardings[HOST]

        def leave(tree):
            return jax.tree.map(lambda a: moved.setdefault(id(a), jax.device_put(a, host)),
                                tree)

        for layer, op in weight_owners(self.spec):
            key, old = (op, None) if layer is None else (layer_key(layer), op)
            home = plan.weights.get(layer, op) or HOST
            if self.plan.weights.get(layer, op) == RESIDENT and home != RESIDENT:
                node = params[key] if old is None else params[key][old]
                node = leave(node)
                if old is None:
                    params[key] = node
                else:
                    params[key][old] = node
        new = Executor(self.spec, params, plan, self.devices, self.timeline, spill_dir)
        if self.routed is not None:  # the run's pairs so far, under the old plan
            new.routed.counts.update(self.routed.counts)
        if self.accountant.peak > new.accountant.peak:
            new.accountant.peak = self.accountant.peak
            new.accountant.peak_by_owner = dict(self.accountant.peak_by_owner)
        return new

    def adopt_cache(self, caches: list[Cache], micro: Hashable = 0) -> list[Cache]:
        """``caches`` (another plan's, e.g. the executor this one was ``switched`` from) moved
        to this plan's KV homes and accounted for ``micro``: a layer that recomputes keeps its
        ``h``, the others drop it.

        Raises:
          HxError: a layer recomputes here but its cache kept no ``h``.
        """
        out = []
        for layer, cache in enumerate(caches):
            home = self.plan.kv[layer]
            device = HOST if home == STREAMED else home
            if self.plan.recompute(layer) and streamed_kv.H not in cache:
                raise HxError(f"plan {self.plan.name!r} recomputes layer {layer}'s K, V but "
                              "its cache kept no activations h: a plan recomputes only where "
                              "every plan before it in the run did (hx.planner.replan)")
            kept = {name: a for name, a in cache.items()
                    if name != streamed_kv.H or self.plan.recompute(layer)}
            out.append({name: jax.device_put(a, self.programs.cache_sharding(device, a.shape))
                        for name, a in kept.items()})
        self.account_cache(out, micro)
        return out

    # -- KV caches ---------------------------------------------------------------------------

    def new_cache(self, batch: int, length: int, dtype=None, micro: Hashable = 0
                  ) -> list[Cache]:
        """Zeroed KV caches on every layer's plan home: K and V of (batch, length, K, E) --
        a sliding-window layer's a ring of fewer slots (``models.tensors.held_slots``) -- in
        ``dtype`` (default: the model's), or, with a compressed ``spec.kv_format``, their
        codes, scales and offsets (``models.tensors.kv_arrays``; ``dtype`` is not used: zero
        codes, scales and offsets decode to 0). A ``streamed`` cache lives on the host, with
        the kept activations ``h`` (batch, length, D) where its layer recomputes
        (``hx.streamed_kv``). ``micro`` names the micro-batch (or other user) they belong to
        in the accountant, so a block's caches are counted side by side."""
        s = self.spec
        own = dtype is not None and s.kv_format == DENSE

        def arrays(layer: int) -> dict:
            slots = layer_slots(s, layer, length)
            kv = {name: (shape, jnp.dtype(dtype if own else held))
                  for name, (shape, held) in kv_arrays(s, batch, slots).items()}
            kept = {streamed_kv.H: ((batch, slots, s.d_model), jnp.dtype(s.dtype))}
            return kv | (kept if self.plan.recompute(layer) else {})

        caches = [{name: jnp.zeros(shape, dt, device=self.programs.cache_sharding(
                       HOST if self.plan.kv[layer] == STREAMED else self.plan.kv[layer], shape))
                   for name, (shape, dt) in arrays(layer).items()}
                  for layer in range(s.n_layers)]
        self.account_cache(caches, micro)
        return caches

    def account_cache(self, caches: list[Cache], micro: Hashable = 0) -> None:
        """Record (or, for caches that changed size, re-record) the accelerator bytes of
        ``micro``'s KV caches with the accountant.

        Raises:
          BudgetExceeded: they pass the accelerator budget (a bug: plans are checked first).
        """
        for layer, cache in enumerate(caches):
            if self.plan.kv[layer] == ACCELERATOR:
                self.accountant.allocate("kv", ("kv", micro, layer), tree_bytes(cache))
                self._kv_keys.add(("kv", micro, layer))

    def release_cache(self, micro: Hashable | None = None) -> None:
        """Forget the KV caches ``new_cache`` made for ``micro`` (None: all of them); call
        when their generation is over."""
        for key in [k for k in self._kv_keys if micro is None or k[1] == micro]:
            self.accountant.free(key)
            self._kv_keys.discard(key)

    # -- one step ----------------------------------------------------------------------------

    def check(self, plan: ExecutionPlan, workload: Workload) -> MemoryEstimate:
        """``hx.memory.check_fits`` of ``plan`` on this executor's devices (``sizing``) at
        ``workload``'s shapes, XLA temporaries included.

        Raises:
          HxError: it does not fit (naming the plan, the limit and the bytes over).
        """
        return check_fits(plan, *self.sizing, workload, self.programs)

    def schedule(self, phase: str, batch: int, tokens: int, slots: int,
                 micro_batches: int = 1) -> Schedule:
        """The instructions of one step of ``phase`` at (B, T, S) for a block of
        ``micro_batches`` (built once per shape; S as ``models.tensors.widest_slots``)."""
        slots = widest_slots(self.spec, slots)
        limit = step_limit(self.spec)
        if limit is not None and tokens > limit:
            raise ValueError(f"a step of {tokens} tokens passes the {limit} a sliding-window "
                             f"layer's ring holds room for (models.tensors.step_limit)")
        key = (phase, batch, tokens, slots, micro_batches)
        if key not in self._schedules:
            self._schedules[key] = compile_schedule(self.plan, self.spec, phase, batch, tokens,
                                                    slots, micro_batches=micro_batches)
        return self._schedules[key]

    def _executable(self, phase: str, index: int, batch: int, tokens: int, slots: int
                    ) -> tuple[Any, int]:
        """Segment ``index``'s executable at these shapes and its XLA temporary bytes."""
        key = (phase, index, batch, tokens, slots)
        if key not in self._executables:
            segment = self.segments[phase][index]
            compiled = self.programs.compiled(segment, batch, tokens, slots,
                                              streamed_kv.keep_h(self.plan, segment))
            shapes = (self.programs.signature(segment), batch, tokens, slots)
            if shapes not in self._shapes:
                self._shapes.add(shapes)
                self.compilations += 1
            self._executables[key] = (compiled,
                                      int(compiled.memory_analysis().temp_size_in_bytes))
        return self._executables[key]

    def compile(self, phase: str, batch: int, tokens: int, slots: int) -> None:
        """Compile every segment of ``phase`` at (B, T, S) ahead of time (no step runs)."""
        slots = self.schedule(phase, batch, tokens, slots).slots
        for index in range(len(self.segments[phase])):
            self._executable(phase, index, batch, tokens, slots)

    def run(self, phase: str, tokens: np.ndarray | jax.Array, step: Step,
            caches: list[Cache]) -> tuple[jax.Array, list[Cache]]:
        """One forward step of ``phase`` over new tokens.

        Args:
          tokens: (B, T) int32 new tokens (a prompt chunk for prefill, T = 1 for decode).
          step: positions (B,T), write_index (), kv_start (B,) as numpy or JAX arrays.
          caches: per-layer KV caches from ``new_cache``; consumed (donated), returned updated.
        Returns:
          (logits (B, V) float32 of the last position, on HEAD's device; updated caches).
        Raises:
          BudgetExceeded: an allocation passes the accelerator budget (a bug).
        """
        logits, caches_out = self.run_block(phase, [tokens], [step], [caches])
        return logits[0], caches_out[0]

    def run_block(self, phase: str, tokens: Sequence[np.ndarray | jax.Array],
                  steps: Sequence[Step], caches: Sequence[list[Cache]]
                  ) -> tuple[list[jax.Array], list[list[Cache]]]:
        """One forward step of ``phase`` for a block of N micro-batches, in the zig-zag block
        schedule: each segment (a streamed layer's weights staged once) runs for every
        micro-batch before the next segment.

        Args:
          tokens: N arrays (B, T) int32, one per micro-batch (equal shapes); in a pipeline
            stage after the first, the residual stream x (B, T, D) (``ModelSpec.embeds``).
          steps: N ``Step``s, one per micro-batch (each its own write index and row starts).
          caches: N lists of per-layer KV caches of equal shape (B, S, K, E) (or their
            compressed arrays, B and S first); consumed.
        Returns:
          (N logits (B, V) float32, N updated cache lists).
        Raises:
          ValueError: micro-batches of different shapes.
          BudgetExceeded: an allocation passes the accelerator budget (a bug).
        """
        N = len(tokens)
        B, T = np.shape(tokens[0])[:2]  # a pipeline stage's input: x (B, T, D)
        S = run_slots(caches[0])
        if any(np.shape(t)[:2] != (B, T) for t in tokens) or any(
                c[0]["k"].shape[0] != B or run_slots(c) != S for c in caches) or len(
                steps) != N or len(caches) != N:
            raise ValueError("a block's micro-batches need one step and one cache list each, "
                             "all of the same (B, T) and (B, S)")
        if self.timeline is not None:
            self.timeline.begin_step(phase)
        return _BlockStep(self, phase, self.schedule(phase, B, T, S, N), tokens, steps,
                          caches).run()

    def loops(self, batch: int, slots: int) -> bool:
        """Whether decode of B=``batch`` rows over S=``slots`` cache slots can run several
        steps a launch (``decode_steps``): the plan's decode is one segment on the host whose
        weights and KV caches are all held there (no copy to schedule, nothing on the
        accelerator to account), it attends in XLA (not ``SplitHostProgram``'s numpy), and no
        timeline records its steps one by one."""
        segments = self.segments["decode"]
        if len(segments) != 1 or self.timeline is not None:
            return False
        seg = segments[0]
        if seg.device != HOST or seg.reads != ("tokens",) or any(
                (self.plan.weight_home(layer, op) or HOST) != HOST for layer, op in seg.ops
        ) or any(home != HOST for home in self.plan.kv):
            return False
        slots = self.schedule("decode", batch, 1, slots).slots
        return not isinstance(self._executable("decode", 0, batch, 1, slots)[0],
                              SplitHostProgram)

    def loop_executable(self, batch: int, slots: int, steps: int, sampler: Sampler):
        """``decode_steps``'s executable at (B, S), compiled on first use (where ``loops``)."""
        slots = self.schedule("decode", batch, 1, slots).slots
        return self.programs.decode_loop(self.segments["decode"][0], batch, slots, steps,
                                         sampler)

    def decode_steps(self, tokens: np.ndarray, step: Step, caches: list[Cache], steps: int,
                     sampler: Sampler, rows: dict[str, np.ndarray], stop: np.ndarray
                     ) -> tuple[np.ndarray, list[Cache]]:
        """Up to ``steps`` decode steps in one launch (``hx.decode_loop``), where ``loops``.

        Args:
          tokens: (B, 1) int32, each row's last token.
          step: the first step's ``Step``.
          caches: per-layer KV caches; consumed (donated), returned updated.
          steps: the most steps a launch of this shape runs (one executable per value).
          sampler: the sampling's static part (``hx.sampling.Sampler.of``).
          rows: ``loop_function``'s per-step values: ``n`` () steps to run (<= ``steps``),
            ``drawn``, ``seeds``, ``remaining`` (B,), ``temperature``, ``top_p`` ().
          stop: (V,) bool, the stop tokens.
        Returns:
          (tokens (B, k) int32 numpy of the k steps run, updated caches).
        """
        seg = self.segments["decode"][0]
        loop = self.loop_executable(tokens.shape[0], run_slots(caches), steps, sampler)
        names = ("n", "drawn", "seeds", "remaining", "temperature", "top_p")
        host = self.programs.shardings[HOST]
        placed = jax.device_put((tokens, step, stop, *(rows[n] for n in names)), host)
        tokens, step, stop, n, drawn, seeds, remaining, temperature, top_p = placed
        out, ran, updated = loop(self._params["decode"][0], tokens,
                                 tuple(caches[layer] for layer in seg.cache_layers), step, n,
                                 drawn, seeds, remaining, stop, temperature, top_p)
        caches = list(caches)
        for layer, cache in zip(seg.cache_layers, updated):
            caches[layer] = cache
        if self.routed is not None:
            self.routed.add_loop("decode", tokens.shape[0], int(ran))
        return np.asarray(out)[:, :int(ran)], caches


def run_slots(caches: Sequence[Cache]) -> int:
    """The cache slots S a run's per-layer ``caches`` were made for (``Executor.new_cache``):
    the largest any layer holds. A sliding-window layer holds a ring of min(S, R) slots
    (``models.tensors.held_slots``), a layer without a window S, so where every layer has a
    window this is the largest ring, from which each layer's ring follows alike."""
    return max(c["k"].shape[1] for c in caches)


class _BlockStep:
    """One step of a block being carried out: one handler per instruction kind, sharing the
    step's state; the accountant applies every instruction's allocations (with the real
    sizes), the timeline records copies and launches with the Schedule's edges."""

    def __init__(self, executor: Executor, phase: str, schedule: Schedule,
                 tokens: Sequence[np.ndarray | jax.Array], steps: Sequence[Step],
                 caches: Sequence[list[Cache]]):
        self.ex, self.phase, self.schedule, self.steps = executor, phase, schedule, steps
        self.acct, self.tl = executor.accountant, executor.timeline
        self.segments, self.params = executor.segments[phase], executor._params[phase]
        self.envs: list[dict[str, Any]] = [{"tokens": t} for t in tokens]
        self.caches = [list(c) for c in caches]
        self.events: dict[int, int | None] = {}  # instruction index -> its timeline event
        self.placed_steps: dict[tuple[str, int], Step] = {}
        self.inputs: dict[tuple[int, int], dict[str, Any]] = {}  # (segment, micro) -> moved
        self.staged: dict[int, tuple] = {}  # segment -> staged weight trees (None: not staged)
        self.read_in: dict[int, tuple] = {}  # segment -> its read disk-homed weight trees
        self.outputs: dict[int, list] = {}  # segment -> outputs of its launches so far
        # (segment, micro) -> a layer's streamed experts: the part's routed ones (indices
        # into its experts) after ``route``, the buffer the launch runs after ``experts in``
        self.routes: dict[tuple[int, int], list[int]] = {}
        self.routed_in: dict[tuple[int, int], Any] = {}
        self.disk_read: list[np.ndarray] = []  # disk-homed experts' leaves copied this step
        # (layer, micro) -> the routing weights of a layer whose experts are split, as they
        # crossed the devices (counted once the step is done: ``hx.routed_pairs``)
        self.routing: dict[tuple[int, int], Any] = {}
        # (segment, micro) -> {what: {layer: arrays}}: a streamed cache's copies on the
        # accelerator ("h", "tail", "cache": before the launch; "out": after it)
        self.copies: dict[tuple[int, int], dict[str, dict[int, Any]]] = {}

    def run(self) -> tuple[list[jax.Array], list[list[Cache]]]:
        """Carry out every instruction in order; (N logits, N cache lists)."""
        handlers = {READ: self.read, STAGE: self.stage, WAIT: self.wait, STEP: self.step,
                    MOVE: self.move, LAUNCH: self.launch, FREE: self.free,
                    ACT_LOAD: self.act_load, KV_LOAD: self.kv_load,
                    RECOMPUTE: self.recompute, KV_STORE: self.kv_store,
                    ROUTE: self.route, EXPERTS_IN: self.experts_in}
        for index, ins in enumerate(self.schedule.instructions):
            handlers[ins.kind](index, ins)
        out = stream.resolve(([env["logits"] for env in self.envs], self.caches))
        for leaf in self.disk_read:  # the copies are done: drop the file's pages
            release(leaf)
        if self.ex.routed is not None:
            rows = self.schedule.batch * self.schedule.tokens
            for m in range(len(self.envs)):
                self.ex.routed.add_step(self.phase, rows, stream.resolve(
                    {layer: a for (layer, micro), a in self.routing.items() if micro == m}))
        return out

    def record(self, index: int, ins: Instruction, track: str, name: str, arrays: Any,
               dispatch: float, **meta) -> None:
        """Put instruction ``index`` on the timeline (when there is one), after the events of
        the instructions it depends on."""
        if self.tl is not None:
            self.events[index] = self.tl.record(
                track, name, arrays, [self.events.get(d) for d in ins.deps],
                dispatch=dispatch, **meta)

    def read(self, index: int, ins: Instruction) -> None:
        """Read a segment's disk-homed weights into host memory (the accelerator's
        ``pinned_host`` kind), on the disk thread (``hx.disk``)."""
        self.read_in[ins.segment] = disk.read(
            tuple(p if on_disk else None for p, on_disk in zip(
                self.params[ins.segment], self.ex._on_disk[self.phase][ins.segment])),
            self.ex._pinned)

    def stage(self, index: int, ins: Instruction) -> None:
        """Copy a streaming segment's weights into accelerator memory (H2D); those read from
        disk on the disk thread, after their read. A layer's streamed experts staged whole
        (``schedule.whole_part``): every expert of the part, one copy each, into one buffer
        (``routed_experts.assemble``)."""
        seg = self.segments[ins.segment]
        dispatch = time.perf_counter()
        if seg.routes:
            experts = self.params[ins.segment][0]
            copied, read = self.copy_experts(ins.segment, range(len(experts)))
            buffer = routed_experts.assemble(copied, experts[0], len(experts),
                                             self.ex._acc_memory)
            self.staged[ins.segment] = (buffer,)
            self.acct.apply(ins, {staging_key(ins.segment): tree_bytes(buffer)})
            layer = seg.ops[0][0]
            self.record(index, ins, H2D, f"experts {layer} (whole)", copied, dispatch,
                        bytes=sum(tree_bytes(t) for t in copied), disk_bytes=read,
                        layers=[layer], experts=[int(e) for e in dict(
                            self.ex.plan.experts.groups(layer))[EXPERTS_STREAMED]])
            return
        params, acc = self.params[ins.segment], self.ex._acc_memory
        read_in = self.read_in.get(ins.segment, (None,) * len(params))
        sources = tuple((r if r is not None else p) if staged else None
                        for p, r, staged in zip(params, read_in, seg.staged))
        where = self.ex.programs.weight_sharding

        def target(path, x):  # device memory, split as the mesh holds it
            return where(ACCELERATOR, leaf_path(path), x.shape)

        trees = disk.put(sources, acc) if ins.segment in self.read_in else tuple(
            None if p is None else jax.device_put(p, jax.tree_util.tree_map_with_path(target, p))
            for p in sources)
        self.staged[ins.segment] = trees
        nbytes = sum(tree_bytes(p) for p, staged in zip(params, seg.staged) if staged)
        self.acct.apply(ins, {staging_key(ins.segment): nbytes})  # a copy's bytes: its source's
        ops = " ".join(f"{op}{layer if layer is not None else ''}"
                       for (layer, op), st in zip(seg.ops, seg.staged) if st)
        layers = sorted({layer for (layer, _), st in zip(seg.ops, seg.staged)
                         if st and layer is not None})
        self.record(index, ins, H2D, f"weights {ops}", trees, dispatch, bytes=nbytes,
                    layers=layers)

    def wait(self, index: int, ins: Instruction) -> None:
        """The staged buffer is reused: the segment must be done with it (and so with its
        read buffers: the pages of its disk-homed weights are released)."""
        jax.block_until_ready(self.outputs[ins.segment])
        self.staged.pop(ins.segment)
        if self.read_in.pop(ins.segment, None) is not None:
            for tree, on_disk in zip(self.params[ins.segment],
                                     self.ex._on_disk[self.phase][ins.segment]):
                for leaf in jax.tree.leaves(tree) if on_disk else ():
                    release(leaf)
        self.acct.apply(ins)

    def step(self, index: int, ins: Instruction) -> None:
        """Put micro-batch ``ins.micro``'s step inputs on the segment's device."""
        device = self.segments[ins.segment].device
        placed = jax.device_put(self.steps[ins.micro], self.ex.programs.shardings[device])
        self.placed_steps[(device, ins.micro)] = placed
        self.acct.apply(ins, {step_key(ins.micro): tree_bytes(placed)})

    def move(self, index: int, ins: Instruction) -> None:
        """Everything a segment reads from elsewhere, in one call."""
        i, m = ins.segment, ins.micro
        dispatch = time.perf_counter()
        device, values = self.segments[i].device, stream.resolve(
            [self.envs[m][n] for n in ins.names])
        moved = jax.device_put(values, [self.ex.programs.activation_sharding(device, n, x.shape)
                                        for n, x in zip(ins.names, values)])
        nbytes = tree_bytes(moved)
        self.acct.apply(ins, {INPUT_KEY: nbytes})
        if ins.resource is not None:
            self.record(index, ins, H2D if ins.resource == "H2D" else D2H,
                        " ".join(ins.names), moved, dispatch, bytes=nbytes)
        self.inputs[(i, m)] = dict(zip(ins.names, moved))

    def launch(self, index: int, ins: Instruction) -> None:
        """Run a segment for one micro-batch; its outputs join the micro-batch's activations
        and its caches replace the layers' (donated)."""
        i, m = ins.segment, ins.micro
        seg, env = self.segments[i], self.envs[m]
        moved = self.inputs.pop((i, m), {})
        if seg.routes:  # copied as routed, or staged whole
            params = ((self.routed_in.pop((i, m)),) if (i, m) in self.routed_in
                      else self.staged[i])
        else:
            params = self.segment_params(i)
        acts = {n: moved[n] if n in moved else env[n] for n in seg.reads}
        first = seg.ops[0][0]
        if "a" in acts and self.ex.routed is not None and first in self.ex.routed.split:
            self.routing.setdefault((first, m), acts["a"])
        copied = self.copies.get((i, m), {}).pop("cache", {})
        caches = tuple(copied.pop(layer) if layer in copied else self.caches[m][layer]
                       for layer in seg.cache_layers)
        B, T = self.schedule.batch, self.schedule.tokens
        compiled, temp = self.ex._executable(self.phase, i, B, T, self.schedule.slots)
        dispatch = time.perf_counter()
        args = (params, acts, caches, self.placed_steps[(seg.device, m)])
        if seg.device == HOST and self.schedule.micro_batches > 1 and (
                isinstance(compiled, SplitHostProgram) or stream.pending((acts, caches))):
            # numpy attention waits in the calling thread: let the next micro-batch's work go
            # out meanwhile (and keep what reads its results behind it); an XLA host program
            # is dispatched asynchronously anyway
            done = stream.submit(compiled, *args)
            out = {n: stream.Deferred(done, 0, n) for n in seg.writes}
            caches = tuple(stream.Deferred(done, 1, j) for j in range(len(seg.cache_layers)))
            self.acct.apply(ins)  # host launches allocate nothing on the accelerator
        else:
            out, caches = compiled(*args)
            self.acct.apply(ins, {TEMP_KEY: temp} | {act_key(n, m): device_bytes(v)
                                                     for n, v in out.items()})
        self.outputs.setdefault(i, []).append(out)
        streamed = dict(streamed_layers(self.ex.plan, seg))
        for layer, cache in zip(seg.cache_layers, caches):
            if layer in streamed:  # back to the host cache at the store
                self.copies[(i, m)].setdefault("out", {})[layer] = cache
            else:
                self.caches[m][layer] = cache
        env.update(out)
        ops = " ".join(op if layer is None else f"{op}{layer}" for layer, op in seg.ops)
        self.record(index, ins, ACC_COMPUTE if seg.device == ACCELERATOR else HOST_COMPUTE,
                    ops if self.schedule.micro_batches == 1 else f"{ops} [mb {m}]",
                    (out, caches), dispatch, segment=i,
                    layers=sorted({layer for layer, _ in seg.ops if layer is not None}))

    def free(self, index: int, ins: Instruction) -> None:
        """End of step: release temporaries, inputs and held activations."""
        self.acct.apply(ins)

    def route(self, index: int, ins: Instruction) -> None:
        """Read a layer's routing weights back once its router has run (blocks on it) and
        keep which of its streamed experts some row routes to (``routed_experts.routed``)."""
        i, m = ins.segment, ins.micro
        dispatch = time.perf_counter()
        layer = self.segments[i].ops[0][0]
        ids = dict(self.ex.plan.experts.groups(layer))[EXPERTS_STREAMED]
        weights = np.asarray(stream.resolve(self.envs[m]["a"])[..., self.ex.spec.d_model:])
        self.routes[(i, m)] = routed_experts.routed(weights, ids)
        self.routing.setdefault((layer, m), weights)
        self.acct.apply(ins)
        self.record(index, ins, D2H, f"route {layer}", (), dispatch, bytes=weights.nbytes,
                    layers=[layer])

    def experts_in(self, index: int, ins: Instruction) -> None:
        """Copy the routed streamed experts into accelerator memory (H2D), one expert a
        copy, into the buffer of the step's slots (``routed_experts.assemble``)."""
        i, m = ins.segment, ins.micro
        dispatch = time.perf_counter()
        seg, experts = self.segments[i], self.params[i][0]
        chosen = self.routes.pop((i, m))
        slots = routed_slots(seg.parts[0], self.schedule.batch * self.schedule.tokens,
                             self.ex.spec.moe.top_k)
        copied, read = self.copy_experts(i, chosen)
        buffer = routed_experts.assemble(copied, experts[0], slots, self.ex._acc_memory)
        self.routed_in[(i, m)] = buffer
        self.acct.apply(ins, {experts_key(i, m): tree_bytes(buffer)})
        layer = seg.ops[0][0]
        self.record(index, ins, H2D, f"experts {layer}", copied, dispatch,
                    bytes=sum(tree_bytes(t) for t in copied), disk_bytes=read, layers=[layer],
                    experts=[int(dict(self.ex.plan.experts.groups(layer))[EXPERTS_STREAMED][j])
                             for j in chosen])

    def copy_experts(self, i: int, chosen: Iterable[int]) -> tuple[list[Any], int]:
        """Copy experts ``chosen`` (indices into the experts of segment ``i``, a streamed
        part) to the accelerator, one copy each; (the copies, bytes read from disk). A
        disk-homed expert's copy reads its mapped file; its pages are released once the step
        is done (``run``)."""
        experts = self.params[i][0]
        on_disk = self.ex.plan.experts.on_disk(self.segments[i].ops[0][0])
        copied, read = [], 0
        for j in chosen:
            copied.append(jax.device_put(experts[j], self.ex._acc_memory))
            if on_disk[j]:
                self.disk_read.extend(jax.tree.leaves(experts[j]))
                read += tree_bytes(experts[j])
        return copied, read

    def segment_params(self, i: int) -> tuple:
        """Segment ``i``'s weight trees as its launch takes them: staged where staged."""
        if not self.segments[i].streams:
            return self.params[i]
        return stream.resolve(tuple(t if t is not None else p
                                    for p, t in zip(self.params[i], self.staged[i])))

    # -- a streamed KV cache (hx.streamed_kv) ------------------------------------------------

    def written(self, m: int) -> int:
        """Cache slots micro-batch ``m`` had written before this step (its write index)."""
        return int(np.asarray(self.steps[m].write_index))

    def act_load(self, index: int, ins: Instruction) -> None:
        """Copy the kept activations ``h`` of slots [0, r) of the segment's recomputing
        layers into accelerator memory (H2D)."""
        i, m = ins.segment, ins.micro
        dispatch = time.perf_counter()
        r_of = {layer: min(r, layer_slots(self.ex.spec, layer, self.schedule.slots))
                for layer, r in streamed_layers(self.ex.plan, self.segments[i]) if r}
        moved = {layer: jax.device_put(streamed_kv.host_slice(
            {streamed_kv.H: self.caches[m][layer][streamed_kv.H]}, 0, r)[streamed_kv.H],
            self.ex._acc_memory) for layer, r in r_of.items()}
        self.copies.setdefault((i, m), {})["h"] = moved
        nbytes = tree_bytes(moved)
        self.acct.apply(ins, {act_copy_key(i, m): nbytes})
        self.record(index, ins, H2D, f"h {r_of}", moved, dispatch, bytes=nbytes)

    def kv_load(self, index: int, ins: Instruction) -> None:
        """Copy K, V of the written slots from r on (``schedule.copy_end``) into
        accelerator memory (H2D); at r = 0 the copy, padded to S slots, is the cache."""
        i, m = ins.segment, ins.micro
        dispatch = time.perf_counter()
        copies = self.copies.setdefault((i, m), {})
        tails, caches = copies.setdefault("tail", {}), copies.setdefault("cache", {})
        nbytes = padded = 0  # bytes copied; of copies padded into a cache at once
        for layer, r in streamed_layers(self.ex.plan, self.segments[i]):
            S = layer_slots(self.ex.spec, layer, self.schedule.slots)
            parts = streamed_kv.kv_only(self.caches[m][layer])
            end = copy_end(S, r, self.written(m))
            if (r, end) != (0, S):
                parts = streamed_kv.host_slice(parts, min(r, S), end)
            tail = jax.device_put(parts, self.ex._acc_memory)
            nbytes += tree_bytes(tail)
            if r:
                tails[layer] = tail
            else:  # the copy is the cache, or lives until its padding has run
                caches[layer] = tail if end == S else streamed_kv.assemble({}, tail, S)
                padded += tree_bytes(tail) if end < S else 0
        self.acct.apply(ins, {copy_key(i, m): tree_bytes(tails) + padded,
                              cache_key(i, m): tree_bytes(caches)})
        self.record(index, ins, H2D, "KV", (tails, caches), dispatch, bytes=nbytes)

    def recompute(self, index: int, ins: Instruction) -> None:
        """Recompute K, V of slots [0, r) from the copied ``h`` on the accelerator (the
        layer's K and V ops, dispatched at once: on a GPU they run while the tail crosses),
        then assemble the cache: head, copied tail, zeros up to S."""
        i, m = ins.segment, ins.micro
        seg, copies = self.segments[i], self.copies[(i, m)]
        dispatch = time.perf_counter()
        params = dict(zip(seg.ops, self.segment_params(i)))
        spec, held = self.ex.spec, weight_dtype(self.ex.spec, ACCELERATOR)
        kv_start = self.placed_steps[(ACCELERATOR, m)].kv_start
        written = self.steps[m].write_index
        slots = {layer: layer_slots(spec, layer, self.schedule.slots) for layer in copies["h"]}
        heads = {layer: streamed_kv.recompute_function(spec.layer_spec(layer), held)(
                     params[(layer, "K")], params[(layer, "V")], h, kv_start, written,
                     slots[layer])
                 for layer, h in copies.pop("h").items()}
        for layer, head in heads.items():
            copies["cache"][layer] = streamed_kv.assemble(head, copies["tail"].pop(layer),
                                                          slots[layer])
        self.acct.apply(ins, {head_key(i, m): tree_bytes(heads),
                              cache_key(i, m): tree_bytes(copies["cache"])})
        self.record(index, ins, ACC_COMPUTE, "recompute K V", (heads, copies["cache"]),
                    dispatch, segment=i, layers=sorted(heads))

    def kv_store(self, index: int, ins: Instruction) -> None:
        """Copy the new positions' K, V (and ``h`` where kept) of the launch's caches to the
        host (D2H) and write them into the host caches; the accelerator's copies go."""
        i, m = ins.segment, ins.micro
        dispatch = time.perf_counter()
        w = self.steps[m].write_index
        new = {layer: jax.device_put(streamed_kv.new_positions(cache, w, self.schedule.tokens),
                                     self.ex.devices[HOST])
               for layer, cache in self.copies.pop((i, m))["out"].items()}
        for layer, part in new.items():
            self.caches[m][layer] = streamed_kv.write_back(self.caches[m][layer], part,
                                                           np.int32(self.written(m)))
        self.acct.apply(ins)
        self.record(index, ins, D2H, "KV", new, dispatch, bytes=tree_bytes(new))
