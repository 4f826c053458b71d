"""Weights as hx holds them, made tensor by tensor at load: dense ones as they are (a view of a
mapped file where it can be), compressed ones as ``models.compressed.GroupMatrix`` leaves of
``models.formats.quantize``'s arrays.

Imports neither JAX nor numpy until a tensor is held (loaders and planners import it to size
formats they never load; JAX comes with the first compressed matrix).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from hx.errors import HxError
from hx.models.formats import DENSE, get_format, quantize

if TYPE_CHECKING:
    import numpy as np


def hold(matrix, fmt_name: str):
    """``matrix`` as format ``fmt_name`` holds it: itself when dense, else ``quantize``'s
    arrays as a ``models.compressed.GroupMatrix``."""
    import numpy as np

    fmt = get_format(fmt_name)
    if fmt is None:
        return matrix
    from hx.models.compressed import GroupMatrix  # JAX: only where a matrix is compressed

    return GroupMatrix.from_parts(fmt, quantize(np.asarray(matrix), fmt))


def held_tensor(array: np.ndarray, shape: tuple[int, ...], dtype, fmt_name: str = DENSE):
    """A checkpoint tensor as hx holds it, made once, tensor by tensor: ``array`` reshaped to
    ``shape`` (a view), kept as it is when dense, already of numpy ``dtype`` and either mapped
    (no copy) or aligned for XLA:CPU to use in place (``models.buffers``); else converted to
    ``dtype`` (an aligned copy) or compressed into ``fmt_name`` -- and then the pages of a
    mapped source leave the resident set (``models.mapped.release``).

    Raises:
      HxError: ``array`` does not have ``shape``'s number of elements.
    """
    from hx.models.buffers import aligned_empty, is_aligned
    from hx.models.mapped import is_mapped, release

    if array.size != math.prod(shape):
        raise HxError(f"a tensor of shape {array.shape} cannot be held as {shape}")
    view = array.reshape(shape)
    if fmt_name == DENSE and view.dtype == dtype and (is_mapped(view) or is_aligned(view)):
        return view
    if fmt_name == DENSE:
        held = aligned_empty(shape, dtype)
        held[...] = view  # converted in place, no intermediate copy
    else:
        held = hold(view, fmt_name)
    release(array)
    return held


def hold_tree(tree: dict, format_of, prefix: str = "") -> dict:
    """A parameter (sub)tree with every leaf at path P (keys joined by "/", below
    ``prefix``) held as ``hold(leaf, format_of(P))``: compressed matrices become
    ``GroupMatrix`` leaves, other leaves stay as they are."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        out[key] = (hold_tree(value, format_of, path) if isinstance(value, dict)
                    else hold(value, format_of(path)))
    return out


def rows_stay(spec, op: str, path: str) -> bool:
    """Whether the matrix at ``path`` of ``op`` is only ever multiplied, never gathered by
    rows (an embedding lookup): a projection matrix, or an LM head's table that is not the
    embedding's (untied). Such a matrix may be held with its rows interleaved (ggml's
    repacked layout, ``models.compressed.GGUFBlocks``)."""
    from hx.models.spec import HEAD

    kind = spec.model_family.matrix_kind(path)
    return kind == "kernel" or (kind == "table" and op == HEAD and not spec.tie_embeddings)


@functools.lru_cache(maxsize=256)
def ggml_matrices(spec, op: str) -> tuple[tuple[str, int, int, bool, int], ...]:
    """(format, N, K, rows stay, stacked) of each matrix of ``op`` that a host segment holds in
    a GGUF's blocks for ggml's kernels (``models.tensors.held_weights``: ``PATH/blocks``,
    ``host_matmul`` ggml), its product (N, K), whether its rows are only multiplied
    (``rows_stay``: ggml may hold them repacked) and how many matrices of N / stacked rows
    it stacks (an MoE layer's routed experts, ``experts/...``, which ggml's ``mul_mat_id``
    multiplies each by its own rows; else 1); () when ``op`` holds no matrix so or any
    compressed matrix otherwise (its product is then decompressed)."""
    from hx.devices import HOST
    from hx.models.tensors import held_weights

    held = held_weights(spec, op, HOST)
    if any(path.endswith("/codes") for path in held):
        return ()
    return tuple((spec.matrix_format(path), *spec.product_shape(path, shape),
                  rows_stay(spec, op, path), shape[0] if path.startswith("experts/") else 1)
                 for path, shape in spec.op_weight_shapes(op).items()
                 if f"{path}/blocks" in held)


def relayout(spec, params: dict, part: str, convert) -> dict:
    """``params`` (a parameter tree of ``models.decoder.init_params`` in ``spec``'s formats)
    with every matrix that ``spec`` holds in another layout (``ModelSpec.op_weight_arrays``
    names its arrays ``PATH/part``: ``packed`` for torch's int4 layout, ``blocks`` for
    GGUF's) replaced by ``convert(held GroupMatrix, (N, K) product shape, whether its rows
    are gathered: not ``rows_stay``)``, in place, one
    matrix at a time (a tied table once, shared as before): a loader's own tree then never
    holds both layouts of more than one matrix, and a mapped matrix's pages leave the
    resident set once converted."""
    from hx.models.mapped import release
    from hx.models.spec import EMBED, HEAD, LAYER_OPS
    from hx.models.tensors import layer_key

    done: dict[int, tuple] = {}  # id of a converted matrix -> (it, kept alive; its new layout)
    owners = [(spec, EMBED, params[EMBED])] if EMBED in params else []
    owners += [(spec.layer_spec(i), op, params[layer_key(i)][op]) for i in range(spec.n_layers)
               for op in LAYER_OPS]
    owners += [(spec, HEAD, params[HEAD])] if HEAD in params else []
    for owner, op, tree in owners:
        held = owner.op_weight_arrays(op)
        for path, shape in owner.op_weight_shapes(op).items():
            if f"{path}/{part}" not in held:
                continue
            *parents, leaf = path.split("/")
            node = tree
            for p in parents:
                node = node[p]
            old = node[leaf]
            if id(old) not in done:
                done[id(old)] = (old, convert(old, owner.product_shape(path, shape),
                                              not rows_stay(owner, op, path)))
                for array in old.parts().values():
                    release(array)
            node[leaf] = done[id(old)][1]
    return params
