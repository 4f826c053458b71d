"""Executor: runs a model segment by segment where an ``ExecutionPlan`` says (DESIGN §5).

At construction every op's weights go to their home: ``resident`` into accelerator memory,
``streamed`` into the accelerator's ``pinned_host`` memory kind, ``host`` onto the host CPU
device. Each step (``run``) walks the phase's segments:

* weight streaming: the staged weights of the next streaming segment are ``device_put`` into
  accelerator memory before the current segment is launched (prefetch depth 1); the buffer of
  the streaming segment before is freed first, after waiting for that segment to finish, so at
  most two segments' weights are staged at any time (double buffer);
* activations a segment reads are moved to its device with ``device_put``;
* the segment's compiled function runs (compiled once per signature and shapes; KV caches are
  donated, so appends are in place);
* the accountant is told of every accelerator allocation; the timeline, when given, of every
  segment and transfer.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hx.devices import ACCELERATOR, HOST, Devices, discover
from hx.host_compute.attention import prefix_attention
from hx.memory import Accountant, check_fits
from hx.models.llama import OPS, Cache, Step, apply_op, layer_key
from hx.models.spec import EMBED, HEAD, ModelSpec
from hx.plan import PHASES, RESIDENT, STREAMED, ExecutionPlan
from hx.segments import crossings, first_streaming, next_streaming, split_segments
from hx.timeline import ACC_COMPUTE, D2H, H2D, HOST_COMPUTE, Timeline
from hx.workload import Workload


def op_params(params: dict[str, Any], layer: int | None, op: str) -> Any:
    """The parameter subtree owned by ``op`` of ``layer`` (None for EMBED/HEAD)."""
    return params[op] if op in (EMBED, HEAD) else params[layer_key(layer)][op]


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in ``tree``."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _segment_function(spec: ModelSpec, device: str, ops: tuple[str, ...],
                      writes: tuple[str, ...]):
    """``(params tuple, activations, caches tuple, step) -> (activations, caches)``, jitted with
    the caches donated. SCORE on the host uses the ``host_compute`` kernel."""
    attend = prefix_attention if device == HOST else None

    def run(params, acts, caches, step):
        acts = dict(acts)
        caches = list(caches)
        slot = 0
        for op, p in zip(ops, params):
            if OPS[op].uses_cache:
                out, caches[slot] = apply_op(spec, op, p, acts, step, caches[slot], attend)
                slot += 1
            else:
                out, _ = apply_op(spec, op, p, acts, step)
            acts.update(out)
        return {name: acts[name] for name in writes}, tuple(caches)

    return jax.jit(run, donate_argnums=(2,))


class Executor:
    """Runs prefill and decode steps of a model under an ``ExecutionPlan``.

    Args:
      spec: model shapes.
      params: host (numpy) parameter tree from a loader.
      plan: op placement, weight and KV homes; its structure is validated against ``spec``.
      devices: accelerator (with its budget) and host; discovered when omitted.
      timeline: records segments and transfers when given.
    Attributes:
      accountant: every accelerator allocation, with the peak.
      compilations: number of segment compilations so far.
    Raises:
      HxError: the plan does not match the model, or does not fit the budgets even at batch 1
        with one token (each run's own shapes are checked by ``Engine``).
      BudgetExceeded: an allocation passes the accelerator budget (check plans with
        ``hx.memory.check_fits`` first).
    """

    def __init__(self, spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan,
                 devices: Devices | None = None, timeline: Timeline | None = None):
        plan.validate(spec)
        self.spec, self.plan = spec, plan
        self.devices = devices or discover()
        check_fits(plan, spec, self.devices, Workload(1, 1, 1))  # before placing any weight
        self.timeline = timeline
        self.accountant = Accountant(self.devices.accelerator.capacity)
        self.compilations = 0
        acc = self.devices.accelerator.device
        self._acc_memory = SingleDeviceSharding(acc, memory_kind="device")
        self._homes = {RESIDENT: self._acc_memory,
                       STREAMED: SingleDeviceSharding(acc, memory_kind="pinned_host"),
                       HOST: SingleDeviceSharding(self.devices.host.device)}
        self.segments = {phase: split_segments(plan, phase) for phase in PHASES}
        placed: dict[tuple[int, str], Any] = {}  # (id(array), home) -> placed array

        def place(tree, home):
            def put(leaf):
                key = (id(leaf), home)
                if key not in placed:  # a tied embedding is one buffer per home
                    placed[key] = jax.device_put(leaf, self._homes[home])
                    if home == RESIDENT:
                        self.accountant.allocate("weights", ("weights", key), leaf.nbytes)
                return placed[key]

            return jax.tree.map(put, tree)

        self._params = {
            phase: [tuple(place(op_params(params, layer, op),
                                plan.weights.get(layer, op) or HOST)
                          for layer, op in seg.ops) for seg in segs]
            for phase, segs in self.segments.items()}
        self._functions: dict[tuple, Any] = {}
        self._compiled: dict[tuple, tuple[Any, int]] = {}
        self._by_segment: dict[tuple, tuple[Any, int]] = {}
        # Static per segment: which reads cross devices, and the next streaming segment.
        self._moves = {phase: crossings(segs) for phase, segs in self.segments.items()}
        self._next_stream = {phase: next_streaming(segs)
                             for phase, segs in self.segments.items()}

    # -- KV caches ---------------------------------------------------------------------------

    def new_cache(self, batch: int, length: int, dtype=jnp.float32) -> list[Cache]:
        """Zeroed KV caches, (batch, length, K, E) each, on every layer's plan home."""
        s = self.spec
        shape = (batch, length, s.n_kv_heads, s.head_dim)
        caches = []
        for layer in range(s.n_layers):
            home = self.plan.kv[layer]
            cache = {name: jax.device_put(jnp.zeros(shape, dtype), self.devices[home])
                     for name in ("k", "v")}
            if home == ACCELERATOR:
                self.accountant.allocate("kv", ("kv", layer), tree_bytes(cache))
            caches.append(cache)
        return caches

    def release_cache(self) -> None:
        """Forget the KV caches of ``new_cache`` (call when their generation is over)."""
        for layer in range(self.spec.n_layers):
            self.accountant.free(("kv", layer))

    # -- compilation ---------------------------------------------------------------------------

    def _compiled_for(self, phase: str, index: int, shapes: tuple, args: tuple
                      ) -> tuple[Any, int]:
        """The compiled function of segment ``index`` at ``shapes`` and its XLA temporary bytes;
        segments with one signature share one compilation."""
        hit = self._by_segment.get((phase, index, shapes))
        if hit is not None:
            return hit
        segment = self.segments[phase][index]
        key = (segment.signature, shapes)
        if key not in self._compiled:
            device, ops, _, _, writes = segment.signature
            fkey = (device, ops, writes)
            if fkey not in self._functions:
                self._functions[fkey] = _segment_function(self.spec, device, ops, writes)
            compiled = self._functions[fkey].lower(*args).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            self._compiled[key] = (compiled, temp)
            self.compilations += 1
        self._by_segment[(phase, index, shapes)] = self._compiled[key]
        return self._compiled[key]

    # -- one step ----------------------------------------------------------------------------

    def run(self, phase: str, tokens: np.ndarray | jax.Array, step: Step,
            caches: list[Cache]) -> tuple[jax.Array, list[Cache]]:
        """One forward step of ``phase`` over new tokens.

        Args:
          tokens: (B, T) int32 new tokens (the prompt for prefill, T = 1 for decode).
          step: positions (B,T), write_index (), kv_start (B,) as numpy or JAX arrays.
          caches: per-layer KV caches from ``new_cache``; consumed (donated), returned updated.
        Returns:
          (logits (B, V) float32 of the last position, on HEAD's device; updated caches).
        """
        tl, acct = self.timeline, self.accountant
        if tl is not None:
            tl.begin_step(phase)
        segments, params = self.segments[phase], self._params[phase]
        moves, next_stream = self._moves[phase], self._next_stream[phase]
        shapes = (tuple(np.shape(tokens)), caches[0]["k"].shape[1])
        env: dict[str, Any] = {"tokens": tokens}
        producer: dict[Any, int | None] = {}  # env name / ("kv", layer) -> timeline event
        steps: dict[str, Step] = {}
        caches = list(caches)
        staged: dict[int, tuple[tuple, int | None]] = {}
        first = first_streaming(segments)
        if first is not None:
            staged[first] = self._stage(phase, first)
        previous_stream: tuple[int, Any] | None = None

        for i, seg in enumerate(segments):
            device = self.devices[seg.device]
            on_acc = seg.device == ACCELERATOR
            seg_params, weight_event = params[i], None
            if seg.streams:
                if previous_stream is not None:  # its buffer is reused: wait for it to finish
                    done, outputs = previous_stream
                    jax.block_until_ready(outputs)
                    staged.pop(done)
                    acct.free(("staging", done))
                if next_stream[i] is not None:
                    staged[next_stream[i]] = self._stage(phase, next_stream[i])
                trees, weight_event = staged[i]
                seg_params = tuple(s if s is not None else p for p, s in zip(params[i], trees))

            if seg.device not in steps:
                steps[seg.device] = jax.device_put(step, device)
                if on_acc:
                    acct.allocate("activations", ("step",), tree_bytes(steps[seg.device]))
            acts = {name: env[name] for name in seg.reads}
            deps = [weight_event]
            if moves[i]:  # everything a segment reads from elsewhere crosses in one call
                dispatch = time.perf_counter()
                moved = jax.device_put([env[name] for name in moves[i]], device)
                acts.update(zip(moves[i], moved))
                nbytes = sum(x.nbytes for x in moved)
                if on_acc:  # held until the next accelerator segment starts (stream order)
                    acct.allocate("activations", ("input",), nbytes)
                from_host_memory = moves[i] == ("tokens",) and not isinstance(tokens, jax.Array)
                if tl is not None and (on_acc or not from_host_memory):
                    deps.append(tl.record(H2D if on_acc else D2H, " ".join(moves[i]), moved,
                                          [producer.get(n) for n in moves[i]],
                                          dispatch=dispatch, bytes=nbytes))
            if tl is not None:
                deps += [producer.get(n) for n in seg.reads if n not in moves[i]]
                deps += [producer.get(("kv", layer)) for layer in seg.cache_layers]
            seg_caches = tuple(caches[layer] for layer in seg.cache_layers)
            args = (seg_params, acts, seg_caches, steps[seg.device])
            compiled, temp = self._compiled_for(phase, i, shapes, args)
            if on_acc:
                acct.allocate("activations", ("temp",), temp)
            dispatch = time.perf_counter()
            out, seg_caches = compiled(*args)
            for layer, cache in zip(seg.cache_layers, seg_caches):
                caches[layer] = cache
            for name, value in out.items():
                env[name] = value
                if on_acc:
                    acct.allocate("activations", ("act", name), value.nbytes)
                else:
                    acct.free(("act", name))
            if tl is not None:
                ops = " ".join(op if layer is None else f"{op}{layer}" for layer, op in seg.ops)
                layers = sorted({layer for layer, _ in seg.ops if layer is not None})
                event = tl.record(ACC_COMPUTE if on_acc else HOST_COMPUTE, ops,
                                  (out, seg_caches), deps, dispatch=dispatch, segment=i,
                                  layers=layers)
                producer.update({name: event for name in out})
                producer.update({("kv", layer): event for layer in seg.cache_layers})
            if seg.streams:
                previous_stream = (i, out)

        if previous_stream is not None:
            done, outputs = previous_stream
            jax.block_until_ready(outputs)
            staged.pop(done)
            acct.free(("staging", done))
        for key in [("temp",), ("step",), ("input",)] + [("act", name) for name in env]:
            acct.free(key)
        return env["logits"], caches

    def _stage(self, phase: str, index: int) -> tuple[tuple, int | None]:
        """Issue the copy of segment ``index``'s staged weights into accelerator memory.

        Returns ((staged tree or None per op), timeline event id or None).
        """
        seg, sources = self.segments[phase][index], self._params[phase][index]
        dispatch = time.perf_counter()
        trees = tuple(jax.device_put(p, self._acc_memory) if staged else None
                      for p, staged in zip(sources, seg.staged))
        self.accountant.allocate("staging", ("staging", index), tree_bytes(trees))
        event = None
        if self.timeline is not None:
            ops = " ".join(f"{op}{layer if layer is not None else ''}"
                           for (layer, op), st in zip(seg.ops, seg.staged) if st)
            layers = sorted({layer for (layer, _), st in zip(seg.ops, seg.staged)
                             if st and layer is not None})
            event = self.timeline.record(H2D, f"weights {ops}", trees, dispatch=dispatch,
                                         bytes=tree_bytes(trees), layers=layers)
        return trees, event
