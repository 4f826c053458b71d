"""A layer's streamed experts, copied to the accelerator as its routing asks
(docs/architecture.md, "Plans"; ``hx.plan.ExpertHomes``).

A routed expert homed ``streamed`` is held in host memory, one expert a tree (the accelerator's
``pinned_host`` kind), so that a copy moves one expert. Once the layer's router has run, the
executor reads its routing weights back (``route``), finds the experts of the part that some
row routes to (``routed``), copies just those (``experts in``) and writes them into a buffer of
``schedule.routed_slots`` experts on the accelerator (``assemble``): the most the step can
route to, so its shape, and the compiled function that runs it, are the step's whatever the
routing. Slots no expert fills hold zeros (an expert of zero weights adds 0) and id 0. In
decode few rows route to few experts: only those cross the link (Fiddler, Kamahori et al.
2024, instead computes an expert that is not on the GPU on the host in decode; both are
``hx.plan.ExpertHomes`` homes, chosen per expert).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

CROSS_AXIS_PARTS = ("centres", "sz")  # held arrays whose rows are their second axis


def routed(weights: np.ndarray, ids: Sequence[int]) -> list[int]:
    """Indices into ``ids`` (a part's experts, the layer's index of each) of the experts some
    row routes to: a nonzero routing weight in ``weights`` (..., X), the router's output
    over the layer's X experts (0 off each row's k)."""
    chosen = np.asarray(weights).reshape(-1, weights.shape[-1])[:, list(ids)] != 0
    return [j for j in range(len(ids)) if chosen[:, j].any()]


def _axes(tree: Any) -> tuple[int, ...]:
    """Per leaf of one expert's tree, the axis its rows (the expert) run along."""
    return tuple(1 if str(getattr(path[-1], "key", "")) in CROSS_AXIS_PARTS else 0
                 for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3,))
def _write(buffer: list, expert: list, slot: jax.Array, axes: tuple[int, ...]) -> list:
    """``buffer``'s leaves with slot ``slot`` of each set to ``expert``'s (in place)."""
    return [jax.lax.dynamic_update_slice_in_dim(b, e, slot * e.shape[axis], axis)
            for b, e, axis in zip(buffer, expert, axes)]


@functools.lru_cache(maxsize=64)
def _zeros(shapes: tuple[tuple[tuple[int, ...], str], ...], where: Any):
    """A compiled function making zero arrays of ``shapes`` on ``where`` (no copy crosses)."""
    return jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype in shapes],
                   out_shardings=[where] * len(shapes))


def assemble(copied: Sequence[Any], template: Any, slots: int, where: Any) -> Any:
    """The tree of ``slots`` experts the launch runs: ``copied`` (trees of one expert each, on
    the accelerator) in its first slots, zeros after; ``template`` is one expert's tree (its
    structure and shapes), ``where`` the accelerator's sharding."""
    leaves, structure = jax.tree.flatten(template)
    axes = _axes(template)
    shapes = tuple((tuple(n * slots if a == axis else n for a, n in enumerate(leaf.shape)),
                    str(leaf.dtype)) for leaf, axis in zip(leaves, axes))
    buffer = _zeros(shapes, where)()
    for slot, tree in enumerate(copied):
        buffer = _write(buffer, jax.tree.leaves(tree), jnp.int32(slot), axes)
    return jax.tree.unflatten(structure, buffer)
