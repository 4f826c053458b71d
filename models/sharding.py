"""Tensor parallelism of the model's arrays: which axis of each weight, cache and activation
a group of accelerators splits (Megatron-LM, Shoeybi et al. 2019, §3), and the zero heads that
make the split even. The arithmetic is the same as ``ModelSpec.shard`` (what the planner
prices); this module is what a mesh of JAX devices holds (``hx.programs.Programs``' shardings;
issue 28; docs/architecture.md, "Devices and memory").

Split along ``TP_AXIS``, each weight in the checkpoint's (out..., in) layout
(``ModelSpec.op_weight_shapes``):

* Q, K, V kernels (heads, E, D) and biases (heads, E) by heads (column-parallel);
* OUT's kernel (D, H, E) by heads (row-parallel: its product is a partial sum, which XLA
  all-reduces);
* MLP1's gate and up (F, D) by F (column-parallel), MLP2's down (D, F) by F (row-parallel);
* the embedding (V, D) by the vocabulary, where ``tp`` divides it (else whole on every device);
* norms whole on every device; KV caches (B, S, K, E) by KV heads;
* activations crossing onto the mesh (from the host): q, k, v, o by heads and a by F, as the
  ops that take them split; x, h and the logits whole on every device.

Where ``tp`` does not divide the KV heads K (and K is not a divisor of ``tp`` whose heads every
device can hold a copy of), ``pad`` appends zero KV heads up to a multiple of ``tp`` and their
query groups (H' = K' x H / K), and zero rows of F up to a multiple of ``tp``: a padded query head
attends zero keys to zero values, and OUT's and MLP2's zero columns add nothing, so outputs are
the unpadded model's.

A compressed matrix (``models.formats``: codes, scales and offsets grouped along its last axis)
splits as its dense matrix does: each array keeps the matrix's leading axes at their indices and
has its groups where the last axis was, so the same axis index splits it (a row-parallel split
of the contracted axis, MLP2's F, cuts whole groups); F is then padded to a multiple of ``tp``
groups, and zero codes with zero scales and offsets decompress to zeros. Matrices held in a host
matmul's layout (``host_matmul`` torch-int4 or ggml) are not split (``HxError``).

Not yet as the planner prices it: with fewer KV heads than devices (Llama-2-70B's 8 over 16),
every device here holds all K heads of K, V and the cache, where ``ModelSpec.shard`` prices one
per device (Megatron's copies of a KV head on tp / K devices: a two-axis mesh, KV heads over one
axis, query heads over both).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hx.errors import HxError
from hx.models.family import TABLE
from hx.models.formats import PARTS, get_format
from hx.models.spec import XLA, ModelSpec

TP_AXIS = "tp"
KV_AXIS = 2  # of a cache's (B, S, K, E)


def padded_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """``spec`` with zero heads and feed-forward rows added so that ``tp`` splits them evenly
    (module docstring); ``spec`` itself where it already does.

    Raises:
      HxError: ``tp`` < 1, matrices in a host matmul's layout (``host_matmul`` not xla), or
        experts (``spec.moe``) to split.
    """
    if tp < 1:
        raise HxError(f"tensor-parallel degree {tp}: 1 or more accelerators")
    if spec.moe is not None and tp > 1:
        raise HxError(f"tensor parallelism does not split {spec.name}'s experts yet; run it "
                      "on one accelerator per pipeline stage")
    if spec.host_matmul != XLA and tp > 1:
        raise HxError(f"tensor parallelism does not split matrices held in the layout of "
                      f"--host-matmul {spec.host_matmul}; run {spec.name} with --host-matmul xla")
    K, group = spec.n_kv_heads, spec.n_heads // spec.n_kv_heads
    if K % tp and tp % K:
        K = -(-K // tp) * tp
    fmt = get_format(spec.weight_format)
    step = tp * (fmt.group if fmt else 1)  # MLP2's F splits by whole groups
    F = -(-spec.d_ff // step) * step
    if (K, F) == (spec.n_kv_heads, spec.d_ff):
        return spec
    return spec.replace(n_kv_heads=K, n_heads=K * group, d_ff=F)


def pad(spec: ModelSpec, params: Any, tp: int) -> tuple[ModelSpec, Any]:
    """(``padded_spec``, ``params`` with zeros appended along the padded axes): the same
    outputs, split evenly by ``tp``. ``params`` is the model's tree (``models.decoder.init_params``), numpy
    or JAX arrays; unpadded leaves are returned as they are."""
    wider = padded_spec(spec, tp)
    if wider is spec:
        return spec, params
    sizes = {"H": (spec.n_heads, wider.n_heads), "K": (spec.n_kv_heads, wider.n_kv_heads),
             "F": (spec.d_ff, wider.d_ff)}

    axes = spec.model_family.tp_axes

    def widen(key_path, node):
        path = "/".join(str(k.key) for k in key_path)  # a compressed matrix's: .../codes
        size, axis = axes.get(matrix_path(path), (None, 0))
        if size not in sizes:  # whole, or split by the vocabulary (never padded)
            return node
        old, new = sizes[size]
        if old == new:
            return node
        widths = [(0, 0)] * np.ndim(node)
        # a compressed array holds the groups of the last axis (old / group of them)
        widths[axis] = (0, (new - old) * np.shape(node)[axis] // old)
        return np.pad(np.asarray(node), widths)

    return wider, jax.tree_util.tree_map_with_path(widen, params)


def matrix_path(path: str) -> str:
    """The last two keys of a weight's tree path (``wq/kernel``, ``EMBED/embedding`` ->
    ``embedding``'s own two), the array part of a compressed matrix (``.../codes``) set aside:
    the key ``Family.tp_axes`` is looked up by."""
    keys = path.split("/")
    if len(keys) > 1 and keys[-1] in PARTS and keys[-2] in ("kernel", TABLE, "positions"):
        keys = keys[:-1]
    return "/".join(keys[-2:])


def partition(spec: ModelSpec, path: str, shape: tuple[int, ...], tp: int
              ) -> tuple[str | None, ...]:
    """The ``jax.sharding.PartitionSpec`` entries of the weight at ``path`` (its tree path,
    ``.../wq/kernel``) of ``shape`` under ``tp``-way tensor parallelism: ``TP_AXIS`` on the
    axis ``spec``'s family splits it along (``Family.tp_axes``) where ``tp`` divides it, else
    whole (all None)."""
    axes = spec.model_family.tp_axes
    leaf = matrix_path(path)
    _, axis = axes.get(leaf, axes.get(leaf.split("/")[-1], (None, None)))
    entries: list[str | None] = [None] * len(shape)
    if axis is not None and shape[axis] % tp == 0:
        entries[axis] = TP_AXIS
    return tuple(entries)


_ACTIVATION_AXIS = {"q": 2, "k": 2, "v": 2, "o": 2, "a": 2}  # (B, T, heads, E), (B, T, F)


def activation_partition(name: str, shape: tuple[int, ...], tp: int
                         ) -> tuple[str | None, ...]:
    """PartitionSpec entries of activation ``name`` (``models.tensors.ACTIVATIONS``) crossing
    onto a mesh: q, k, v, o by heads and a by F, as the ops that take them split, where ``tp``
    divides them; x, h and the logits whole on every device."""
    entries: list[str | None] = [None] * len(shape)
    axis = _ACTIVATION_AXIS.get(name)
    if axis is not None and shape[axis] % tp == 0:
        entries[axis] = TP_AXIS
    return tuple(entries)


def cache_partition(shape: tuple[int, ...], tp: int) -> tuple[str | None, ...]:
    """PartitionSpec entries of a dense KV cache (B, S, K, E): by KV heads where ``tp``
    divides them (else a copy on every device)."""
    entries: list[str | None] = [None] * len(shape)
    if shape[KV_AXIS] % tp == 0:
        entries[KV_AXIS] = TP_AXIS
    return tuple(entries)
