"""Executor: runs a model segment by segment on the devices an ``ExecutionPlan`` names.

Weights are placed once, at construction, on every device where their op runs in some phase.
Each step walks the phase's segments: activations a segment reads are moved to its device with
``jax.device_put`` (a no-op when already there), the segment's jitted function runs, and the
activations it writes join the step's environment. KV caches start on their plan home and are
donated to, and returned by, the segments that update them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hx.devices import Devices, discover
from hx.models.llama import OPS, Cache, Step, apply_op, layer_key
from hx.models.spec import EMBED, HEAD, ModelSpec
from hx.plan import PHASES, ExecutionPlan
from hx.segments import Segment, split_segments


def _put(tree: Any, device: jax.Device) -> Any:
    """Every array of ``tree`` on ``device``; arrays already there are returned as they are."""

    def put(x):
        if isinstance(x, jax.Array) and x.devices() == {device}:
            return x
        return jax.device_put(x, device)

    return jax.tree.map(put, tree)


def op_params(params: dict[str, Any], layer: int | None, op: str) -> Any:
    """The parameter subtree owned by ``op`` of ``layer`` (None for EMBED/HEAD)."""
    return params[op] if op in (EMBED, HEAD) else params[layer_key(layer)][op]


def _segment_function(spec: ModelSpec, ops: tuple[str, ...], writes: tuple[str, ...]):
    """Jitted ``(params tuple, activations, caches tuple, step) -> (activations, caches)``."""

    def run(params, acts, caches, step):
        acts = dict(acts)
        caches = list(caches)
        slot = 0
        for op, p in zip(ops, params):
            if OPS[op].uses_cache:
                out, caches[slot] = apply_op(spec, op, p, acts, step, caches[slot])
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
      plan: op placement and KV homes; validated against ``spec``.
      devices: accelerator and host (discovered when omitted).
    Raises:
      HxError: the plan does not match the model.
    """

    def __init__(self, spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan,
                 devices: Devices | None = None):
        plan.validate(spec)
        self.spec, self.plan = spec, plan
        self.devices = devices or discover()
        self.segments = {phase: split_segments(plan.phase(phase)) for phase in PHASES}
        placed: dict[tuple[int, str], Any] = {}  # (id(array), device) -> array on device

        def place(tree, device_name):
            device = self.devices[device_name]

            def put_leaf(leaf):
                key = (id(leaf), device_name)  # tied embeddings: one copy per device
                if key not in placed:
                    placed[key] = jax.device_put(leaf, device)
                return placed[key]

            return jax.tree.map(put_leaf, tree)

        self._segment_params = {
            phase: [tuple(place(op_params(params, layer, op), seg.device)
                          for layer, op in seg.ops) for seg in segs]
            for phase, segs in self.segments.items()}
        self._functions: dict[tuple, Any] = {}

    def function(self, segment: Segment):
        """The jitted function of ``segment`` (shared by all segments of one signature)."""
        key = segment.signature
        if key not in self._functions:
            ops, _, writes = key
            self._functions[key] = _segment_function(self.spec, ops, writes)
        return self._functions[key]

    def new_cache(self, batch: int, length: int, dtype=jnp.float32) -> list[Cache]:
        """Zeroed KV caches, (batch, length, K, E) each, on every layer's plan home."""
        s = self.spec
        shape = (batch, length, s.n_kv_heads, s.head_dim)
        caches = []
        for layer in range(s.n_layers):
            device = self.devices[self.plan.kv[layer]]
            caches.append({name: jax.device_put(jnp.zeros(shape, dtype), device)
                           for name in ("k", "v")})
        return caches

    def run(self, phase: str, tokens: np.ndarray | jax.Array, step: Step,
            caches: list[Cache]) -> tuple[jax.Array, list[Cache]]:
        """One forward step of ``phase`` over new tokens.

        Args:
          tokens: (B, T) int32 new tokens (the prompt for prefill, T = 1 for decode).
          step: positions (B,T), write_index (), kv_start (B,) as numpy or JAX arrays.
          caches: per-layer KV caches; consumed (donated) and returned updated.
        Returns:
          (logits (B, V) float32 of the last position, on HEAD's device; updated caches).
        """
        env: dict[str, Any] = {"tokens": tokens}
        steps: dict[str, Step] = {}
        caches = list(caches)
        for seg, params in zip(self.segments[phase], self._segment_params[phase]):
            device = self.devices[seg.device]
            if seg.device not in steps:
                steps[seg.device] = _put(step, device)
            acts = {name: _put(env[name], device) for name in seg.reads}
            seg_caches = tuple(_put(caches[layer], device) for layer in seg.cache_layers)
            out, seg_caches = self.function(seg)(params, acts, seg_caches, steps[seg.device])
            for layer, cache in zip(seg.cache_layers, seg_caches):
                caches[layer] = cache
            env.update(out)
        return env["logits"], caches
