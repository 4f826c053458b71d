"""Every tensor hx holds, with its shape, dtype and bytes: the one table of bytes.

The executor, the Schedule (``hx.schedule``), the memory estimate (``hx.memory``), CP-SAT's
constraint coefficients, the baselines and the simulator all size tensors here, so they cannot
disagree. It imports neither JAX nor Flax: a planner sizes a 70B model it never loads.

Axis letters (as in ``models/layers.py``): B rows, T new tokens per row, S KV-cache slots,
D hidden, H query heads, K key/value heads, E head dim, F FFN size, A the width of MLP1's
output (``ModelSpec.inner_width``: F, or an MoE layer's D + experts), V vocabulary.

* **Weights**: ``ModelSpec.op_weight_shapes`` gives each op's tensors (matrices in the
  checkpoint's (out..., in) layout); ``held_weights`` the arrays a device holds for them --
  dense ones in ``weight_dtype``, compressed matrices as their format's codes, scales and
  offsets (``models.formats``); ``layer_key`` names a layer in the parameter tree.
* **KV cache**: per layer a K and a V array of logical shape (B, S, K, E) (``kv_shape``; under
  latent attention the latent as K and the shared rotated key as V, of their own widths),
  held in the model's dtype or, compressed (``ModelSpec.kv_format``), as codes, scales and
  offsets grouped along E (``kv_format``, ``kv_arrays``, ``kv_bytes``). A sliding-window
  layer holds a ring of fewer slots (``held_slots``; ``cache_bytes`` sums the layers).
* **Activations** between ops: ``ACTIVATIONS`` maps each name of the op table (``OPS``) to its
  axes and dtype; ``activation_shape`` and ``activation_bytes`` read it.
* **Step inputs**: int32 positions (B, T), a write index and row starts (B,) (``step_bytes``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hx.devices import HOST
from hx.models.formats import KV_DTYPES, Format, kv_cache_format
from hx.models.spec import (EMBED, EXPERT_OPS, HEAD, LAYER_OPS, SCORE, ModelSpec, host_dtype,
                            numpy_dtype)
from hx.workload import round_up


@dataclass(frozen=True)
class OpDef:
    """How an op is wired: the activations it reads and writes (``ACTIVATIONS`` names), and
    whether it reads and appends to its layer's KV cache."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    uses_cache: bool = False


# The op table: what each op (each family's modules, ``models.family``) reads and writes.
OPS: dict[str, OpDef] = {
    EMBED: OpDef(("tokens",), ("x",)),
    "Q": OpDef(("x",), ("h", "q")),
    "K": OpDef(("h",), ("k",)),
    "V": OpDef(("h",), ("v",)),
    SCORE: OpDef(("q", "k", "v"), ("o",), uses_cache=True),
    "OUT": OpDef(("o", "x"), ("x",)),
    "MLP1": OpDef(("x",), ("a",)),
    "MLP2": OpDef(("a", "x"), ("x",)),
    HEAD: OpDef(("x",), ("logits",)),
    # an MoE layer's routed experts of one home, placed one by one (``models.ops.EXPERT_OPS``):
    # x plus their weighted outputs on the normed x and routing weights of a
    **{op: OpDef(("a", "x"), ("x",)) for op in EXPERT_OPS},
}

MODEL_DTYPE = "model"  # an activation held in the model's dtype (``ModelSpec.dtype``)

# Activations: name -> (axes, dtype). x is the residual stream, h the normed input of K and V,
# q/k/v/o attention's projections and output, a the MLP's inner activation (an MoE layer's: the
# normed x and the routing weights, ``models.moe``); logits score only each row's last position.
ACTIVATIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "tokens": (("B", "T"), "int32"),
    "x": (("B", "T", "D"), MODEL_DTYPE),
    "h": (("B", "T", "D"), MODEL_DTYPE),
    "q": (("B", "T", "H", "Eq"), MODEL_DTYPE),
    "o": (("B", "T", "H", "Eo"), MODEL_DTYPE),
    "k": (("B", "T", "K", "Ek"), MODEL_DTYPE),
    "v": (("B", "T", "K", "Ev"), MODEL_DTYPE),
    "a": (("B", "T", "A"), MODEL_DTYPE),
    "logits": (("B", "V"), "float32"),
}

_ITEM_BYTES = {"int32": 4, "float32": 4, "bfloat16": 2, "float16": 2}


def axis_sizes(spec: ModelSpec, batch: int, tokens: int) -> dict[str, int]:
    """Size of each axis letter at B = ``batch`` rows and T = ``tokens`` new tokens; the head
    widths of q, o, k and v (``Eq``, ``Eo``, ``Ek``, ``Ev``) are all E but under latent
    attention (``ModelSpec.q_width``, ``o_width``, ``kv_width``)."""
    return {"B": batch, "T": tokens, "D": spec.d_model, "H": spec.n_heads,
            "K": spec.n_kv_heads, "E": spec.head_dim, "Eq": spec.q_width, "Eo": spec.o_width,
            "Ek": spec.kv_width("k"), "Ev": spec.kv_width("v"), "F": spec.d_ff,
            "A": spec.inner_width, "V": spec.vocab_size}


def activation_shape(spec: ModelSpec, name: str, batch: int, tokens: int
                     ) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of activation ``name`` at B = ``batch``, T = ``tokens``: the model's
    dtype on either device; token ids int32, logits float32 (a pipeline stage's ``tokens`` in
    and ``logits`` out are the residual stream x: ``ModelSpec.embeds``, ``heads``).

    Raises:
      KeyError: ``name`` is not in ``ACTIVATIONS``.
    """
    axes, dtype = ACTIVATIONS[name]
    if (name == "tokens" and not spec.embeds) or (name == "logits" and not spec.heads):
        axes, dtype = ACTIVATIONS["x"]  # a pipeline stage's residual stream, in or out
    sizes = axis_sizes(spec, batch, tokens)
    return tuple(sizes[a] for a in axes), spec.dtype if dtype == MODEL_DTYPE else dtype


def activation_bytes(spec: ModelSpec, name: str, batch: int, tokens: int) -> int:
    """Bytes of activation ``name`` at B = ``batch``, T = ``tokens``."""
    shape, dtype = activation_shape(spec, name, batch, tokens)
    return math.prod(shape) * _ITEM_BYTES[dtype]


def widest_activation_bytes(spec: ModelSpec, name: str, batch: int, tokens: int) -> int:
    """``activation_bytes`` of ``name`` in the layer type where it is widest (a dense first
    layer's ``a`` is d_ff wide, an MoE layer's D + X)."""
    return max(activation_bytes(s, name, batch, tokens) for s in _type_specs(spec))


KV_NAMES = ("k", "v")


def kv_shape(spec: ModelSpec, rows: int, slots: int, name: str = "k"
             ) -> tuple[int, int, int, int]:
    """Logical shape (B, S, K, E) of one layer's ``name`` (``k`` or ``v``): ``rows`` rows of
    ``slots`` cache slots, E the width of that name (``ModelSpec.kv_width``: latent attention's
    K and V differ); ``kv_arrays`` gives the arrays that hold it."""
    return rows, slots, spec.n_kv_heads, spec.kv_width(name)


# Most tokens one step writes into a sliding-window layer's ring (llama.cpp's default micro-batch,
# ``n_ubatch``, which its sliding-window cache is sized by: ``n_swa + n_ubatch``)
RING_STEP = 512
RING_QUANTUM = 16  # a ring's slots are a multiple of this (its blocked reads stay whole)


def _type_specs(spec: ModelSpec) -> list[ModelSpec]:
    """The spec of each of the model's layer types (the model's own where its layers are
    alike)."""
    return [spec.type_spec(kind) for kind in spec.layer_types or ("",)]


def step_limit(spec: ModelSpec) -> int | None:
    """Most tokens one step may write (a prefill chunk's bound) so that every sliding-window
    layer's ring holds what its queries see (``held_slots``): ``min(window, RING_STEP)`` of
    the smallest window; None for a model without sliding windows (no bound)."""
    windows = [s.sliding_window for s in _type_specs(spec) if s.sliding_window is not None]
    return min(min(w, RING_STEP) for w in windows) if windows else None


def held_slots(layer_spec: ModelSpec, slots: int) -> int:
    """KV-cache slots a layer holds in a run of ``slots`` slots (S), given the layer's spec
    (``ModelSpec.layer_spec``): S; for a sliding window of w, a ring of at most
    w + min(w, RING_STEP) - 1 slots (rounded up to ``RING_QUANTUM``), slot s at index
    s mod R (``models.layers.ring_positions``). A step of T <= ``step_limit`` tokens writes
    its keys then attends: its first query sees the w - 1 slots before it, its last the T - 1
    new ones after, so w + T - 1 slots must be held (llama.cpp sizes its sliding-window cache
    so: ``n_swa + n_ubatch``)."""
    w = layer_spec.sliding_window
    if w is None:
        return slots
    return min(slots, round_up(w + min(w, RING_STEP) - 1, RING_QUANTUM))


def layer_slots(spec: ModelSpec, layer: int, slots: int) -> int:
    """``held_slots`` of decoder layer ``layer`` of ``spec`` (its layer type's window)."""
    return held_slots(spec.layer_spec(layer), slots)


def widest_slots(spec: ModelSpec, slots: int) -> int:
    """Slots of the widest KV cache a run of ``slots`` slots holds: ``slots``, or where every
    layer has a sliding window, the largest ring (from which each layer's follows alike:
    ``held_slots`` of either gives the same caches)."""
    return max(held_slots(s, slots) for s in _type_specs(spec))


def cache_bytes(spec: ModelSpec, rows: int, slots: int, layers: Iterable[int]) -> int:
    """Bytes of the KV caches of decoder ``layers`` at ``rows`` rows in a run of ``slots``
    slots, each as held (``kv_bytes`` of its ``held_slots``)."""
    return sum(kv_bytes(spec, rows, layer_slots(spec, i, slots)) for i in layers)


def layer_cache_bytes(spec: ModelSpec, rows: int, slots: int) -> int:
    """One decoder layer's KV-cache bytes averaged over the model's layers (``cache_bytes``
    of them all over their count, rounded up): what planners that price every layer alike
    count per layer, exact in total where every layer's cache has one home (the memory
    estimate counts each layer's own)."""
    return -(-cache_bytes(spec, rows, slots, range(spec.n_layers)) // spec.n_layers)


def kv_format(spec: ModelSpec) -> Format | None:
    """The format the model's KV cache is held in, grouped along the head dim
    (``models.formats.kv_cache_format``: the format's group, or E where E is smaller); None
    when dense."""
    return kv_cache_format(spec.kv_format, spec.head_dim)


def kv_key(name: str, part: str) -> str:
    """Key in a layer's cache dict of ``part`` (``codes``, ``scale``, ``offset``) of ``name``
    (``k`` or ``v``): the codes under the name itself, the others as ``k_scale``..."""
    return name if part == "codes" else f"{name}_{part}"


def kv_arrays(spec: ModelSpec, rows: int, slots: int
              ) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of every array of one layer's KV cache, keyed as the cache dict
    (``models.layers.Cache``) keys them. Dense: ``k`` and ``v``, (B, S, K, E) in the model's dtype,
    or the dtype ``spec.kv_format`` names (``models.formats.KV_DTYPES``). Compressed (``kv_format``,
    group g along E): for each of ``k`` and ``v`` its codes uint8 (B, S, K, E/g, g·bits/8) under the
    name, float16 scales (B, S, K, E/g) under ``k_scale``, and for an asymmetric format float16
    offsets under ``k_offset`` (``models.formats.Format.arrays`` of the logical shape). Every array
    has B on axis 0 and S on axis 1 (re-framing and row gathers rely on it)."""
    fmt = kv_format(spec)
    if fmt is None:
        dtype = spec.kv_format if spec.kv_format in KV_DTYPES else spec.dtype
        return {name: (kv_shape(spec, rows, slots, name), dtype) for name in KV_NAMES}
    return {kv_key(name, part): array for name in KV_NAMES
            for part, array in fmt.arrays(kv_shape(spec, rows, slots, name)).items()}


def kv_bytes(spec: ModelSpec, rows: int, slots: int) -> int:
    """Bytes of one layer's KV cache, K and V, as held (``kv_arrays``): dense 2·B·S·K·E
    elements of the model's dtype; int4 (group 64) 2·B·S·K·E·(4 + 2·16/64)/8 bytes."""
    return sum(math.prod(shape) * numpy_dtype(dtype).itemsize
               for shape, dtype in kv_arrays(spec, rows, slots).values())


def step_bytes(batch: int, tokens: int) -> int:
    """Bytes of a step's inputs on a device: int32 positions (B, T), the write index and the
    row starts (B,)."""
    return 4 * (batch * tokens + 1 + batch)


def weight_dtype(spec: ModelSpec, device: str) -> str:
    """The dtype a segment on ``device`` holds its weights in: the model's dtype, except float32
    for a float16 model's host ops (``models.spec.host_dtype`` says why)."""
    return host_dtype(spec.dtype) if device == HOST else spec.dtype


def held_weights(spec: ModelSpec, op: str, device: str
                 ) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of every array a segment on ``device`` holds for ``op``'s weights,
    keyed by parameter path (``ModelSpec.op_weight_arrays`` with dense tensors in
    ``weight_dtype(spec, device)``; under ``host_matmul`` torch-int4, the 4-bit projection
    matrices the int4 kernel takes in its layout)."""
    return spec.op_weight_arrays(op, weight_dtype(spec, device))


@functools.lru_cache(maxsize=256)
def int4_matrices(spec: ModelSpec, op: str) -> bool:
    """Whether every compressed matrix of ``op`` is held in torch's int4 layout
    (``held_weights``: ``host_matmul`` torch-int4, 4-bit matrices the kernel takes), so that
    on the host that kernel multiplies them all."""
    held = held_weights(spec, op, HOST)
    return (any(path.endswith("/packed") for path in held)
            and not any(path.endswith("/codes") for path in held if "kernel" in path))


def layer_key(i: int) -> str:
    """Parameter-tree key of decoder layer ``i``."""
    return f"layer_{i}"


def weight_tree(spec: ModelSpec, take: Callable[[int | None, str, str, tuple[int, ...]], Any],
                layers: Iterable[int] | None = None) -> dict[str, Any]:
    """The parameter tree of ``models.decoder.init_params`` with leaves from ``take``: ``{"EMBED": ...,
    "layer_i": {op: ...}, "HEAD": ...}``, each ``ModelSpec.op_weight_shapes`` path nested at
    its "/", its leaf ``take(layer, op, path, shape)`` (layer None for EMBED and HEAD). Only
    the decoder layers ``layers`` (default: all); a tied model's HEAD embedding is EMBED's
    leaf itself (``take`` is not asked for it). Loaders and random weights build it so."""
    def op_tree(layer: int | None, op: str) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        held = spec if layer is None else spec.layer_spec(layer)  # its layer's weights
        for path, shape in held.op_weight_shapes(op).items():
            if op == HEAD and path == "embedding" and spec.tie_embeddings:
                continue
            *modules, last = path.split("/")
            node = tree
            for m in modules:
                node = node.setdefault(m, {})
            node[last] = take(layer, op, path, shape)
        return tree

    params = {EMBED: op_tree(None, EMBED)}
    for i in range(spec.n_layers) if layers is None else layers:
        params[layer_key(i)] = {op: op_tree(i, op) for op in LAYER_OPS}
    params[HEAD] = op_tree(None, HEAD)
    if spec.tie_embeddings:
        params[HEAD]["embedding"] = params[EMBED]["embedding"]
    return params
