"""Streamed KV caches: what crosses the link for a layer whose cache lives in host memory and
is attended on the accelerator, and the KV recompute that replaces part of it (KVPR: Jiang et
al. 2024, "KVPR: Efficient LLM Inference with I/O-Aware KV Cache Partial Recomputation").

A ``streamed`` layer's cache is held on the host device: its K, V arrays (B, S, ...) as
``models.tensors.kv_arrays`` gives them (dense or compressed) and, where the plan recomputes
(r > 0), ``h`` (B, S, D) in the model's dtype: the layer's normed attention input of every
slot, the input of its K and V ops (made by the family's Q op). Every slot's, not only [0, r)'s as
in KVPR, so that a re-plan may raise r and re-framing a continuous batch moves ``h`` with K
and V. Per micro-batch, ``hx.executor`` carries out ``hx.schedule``'s instructions with these
programs:

  ``act load``   ``host_slice`` of ``h`` [0, r), copied H2D
  ``kv load``    ``host_slice`` of K, V [r, end), copied H2D: ``end``
                 (``hx.schedule.copy_end``) is the slots written before the step rounded up
                 to ``COPY_QUANTUM`` (one program per quantum, not per step); at r = 0 the
                 copy is ``assemble``d at once
  ``recompute``  ``recompute`` of K, V at [0, r) on the accelerator from ``h`` (the layer's K
                 and V ops, RoPE at each slot's position ``max(slot - kv_start, 0)``,
                 compressed into the cache's format), then ``assemble``: recomputed head,
                 copied tail, zeros up to S (slots no query reads yet)
  ``launch``     the segment appends the new positions to the assembled cache in place and
                 returns their ``h`` beside it (``hx.programs.segment_function``'s ``keep_h``)
  ``kv store``   ``new_positions`` of the launch's cache, copied D2H, then ``write_back``
                 into the host cache (donated)

Each program is dispatched asynchronously, so on a GPU the recompute runs while the tail of
the cache is still crossing the link (it waits only for ``h``).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp

from hx.models.layers import Cache, Step, kv_parts, read_slots, ring_positions, write_slots

from hx.models.decoder import apply_op
from hx.models.spec import ModelSpec
from hx.models.tensors import kv_format
from hx.plan import ExecutionPlan
from hx.segments import Segment

H = "h"  # the key of a recomputing layer's kept activations in its host cache


def keep_h(plan: ExecutionPlan, segment: Segment) -> tuple[int, ...]:
    """The cache slots of ``segment`` (``Segment.cache_layers``) whose layer recomputes:
    its program returns their new positions' ``h`` (``hx.programs.segment_function``)."""
    return tuple(slot for slot, layer in enumerate(segment.cache_layers)
                 if plan.recompute(layer))


def kv_only(cache: Cache) -> Cache:
    """The cache's K, V arrays (without the kept activations ``h``)."""
    return {name: a for name, a in cache.items() if name != H}


@functools.partial(jax.jit, static_argnums=(1, 2))
def host_slice(parts: Cache, start: int, stop: int) -> Cache:
    """Slots [start, stop) of every array of ``parts`` (B, S, ...), on the arrays' device."""
    return {name: a[:, start:stop] for name, a in parts.items()}


@functools.partial(jax.jit, static_argnums=(2,))
def assemble(head: Cache, tail: Cache, slots: int) -> Cache:
    """The accelerator's copy of a streamed cache, (B, S, ...) each: ``head``'s slots (the
    recomputed [0, r); {} at r = 0), then ``tail``'s ([r, end)), then zeros up to ``slots``."""
    out = {}
    for name, t in tail.items():
        pieces = [head[name].astype(t.dtype)] if name in head else []
        pieces.append(t)
        filled = sum(p.shape[1] for p in pieces)
        if filled < slots:
            pieces.append(jnp.zeros((t.shape[0], slots - filled) + t.shape[2:], t.dtype))
        out[name] = jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else t
    return out


@functools.lru_cache(maxsize=None)
def recompute_function(spec: ModelSpec, held: str):
    """``(K params, V params, h (B, r, D), kv_start (B,), written, slots) -> head``: the K, V
    of cache indices [0, r) from their kept activations, by the layer's own K and V ops
    (``models.decoder.apply_op`` with ``spec``, the layer's: ``ModelSpec.layer_spec``, its
    RoPE; weights in ``held``), in the cache's format (``models.layers.kv_parts``; dense in
    the model's dtype). Each index's position is that of the slot it holds once ``written``
    slots are (``models.layers.ring_positions`` of a cache of ``slots`` indices: a ring's
    indices hold later slots once it wraps). Jitted; runs where its arguments are (the
    accelerator)."""
    fmt = kv_format(spec)

    def run(k_params, v_params, h, kv_start, written, slots):
        r = h.shape[1]
        held_slot = ring_positions(jnp.arange(r, dtype=jnp.int32), slots, written)
        positions = jnp.maximum(held_slot[None, :] - kv_start[:, None], 0)
        step = Step(positions, jnp.int32(0), kv_start)
        k, _ = apply_op(spec, "K", k_params, {H: h}, step, held=held)
        v, _ = apply_op(spec, "V", v_params, {H: h}, step, held=held)
        return kv_parts(k["k"], v["v"], fmt, spec.dtype)

    return jax.jit(run, static_argnums=(5,))


@functools.partial(jax.jit, static_argnums=(2,))
def new_positions(cache: Cache, write_index: jax.Array, tokens: int) -> Cache:
    """The ``tokens`` slots from ``write_index`` of a launch's cache (its new positions; a
    ring's at their indices, ``models.layers.read_slots``), and ``h`` as it is (the launch
    returns only the new positions' ``h``)."""
    return {name: a if name == H else read_slots(a, write_index, tokens, ring=True)
            for name, a in cache.items()}


@functools.partial(jax.jit, donate_argnums=(0,))
def write_back(host: Cache, new: Cache, write_index: jax.Array) -> Cache:
    """``host`` (donated) with ``new``'s slots written from ``write_index`` (a ring's at their
    indices, ``models.layers.write_slots``)."""
    return {**host, **{name: write_slots(host[name], a, write_index, ring=True)
                       for name, a in new.items()}}
