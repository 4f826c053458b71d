"""Whole decoder layers on the host as one ggml graph: one FFI call for a run of layers where
the ops' composition makes about twenty XLA thunks and seven product calls a layer.

A host segment runs each run of consecutive decoder layers of one type whose family's layer is
Llama's (``Family.graph_layer``: Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, and Mixtral's,
Qwen3-MoE's, OLMoE's and Qwen2-MoE's, whose FFN is their routed experts (and a shared one): llama.cpp's MoE graph, the experts by
``ggml_mul_mat_id`` at any rows, held as ``ggml_kernel.EXPERT_LAYOUTS``) and whose matrices
ggml multiplies (``ModelSpec.host_matmul`` ``ggml``: a GGUF's blocks, or float32 rows), in float32
or bfloat16 (its KV cache in that dtype), as ``ggml_layer.cc``'s graph -- llama.cpp's own for those
layers: norms, projections, RoPE, the KV-cache write (``ggml_set_rows``, in place) and attention
(``ggml_flash_attn_ext``) -- on the thread pool ggml's products share (``ggml_pool.h``). The mask
comes from the same function XLA's attention masks with (``models.layers.attention_mask``: rings,
windows, left padding), RoPE's frequencies from the family (as factors over theta^(-2i/E), ggml's
``freq_factors``). Up to the rows ggml's products take (``ggml_kernel.KERNEL_ROWS``: 64, or a whole
512-token prefill chunk for repacked q4_0 and q4_1); past them the ops run one by one, each product
by ggml or XLA. A centred q4_1 matrix's product is q4_0's and the centres' part (``ggml_pool.h``'s
``Product``). The graph's results are placed by ggml's graph allocator, which reuses memory as
results die, so a graph's memory does not grow with its layers. Attention reads the cache's slots
up to the last written, rounded up to ``READ_PAD`` (the rest masked, which ggml's attention skips),
as llama.cpp pads its KV cache's view: a decode loop's steps then call with the same shapes and
buffers for ``READ_PAD`` steps, and ``ggml_layer.cc`` runs the graph it built the step before
instead of building it again (about a thousand tensors for SmolLM2's 30 layers).

SmolLM2 Q4_1 all-host decode, batch 1, 2 threads on the 2-core VM: see docs/measurements/log.md
("one ggml graph for a run of layers").
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hx.host_compute import ggml_kernel
from hx.models.compressed import GGUFBlocks
from hx.models.formats import GGUF_BLOCKS
from hx.models.layers import Cache, Step, attention_mask, inv_frequencies
from hx.models.moe import ROUTER, SHARED_GATE
from hx.models.spec import GGML, LAYER_OPS, ModelSpec

READ_PAD = 256  # attention reads cache slots in multiples of this (llama.cpp's KV padding)
DENSE_ROWS = 64  # float32 rows: up to where ggml's products were measured against XLA's
# each layer's seven matrices, (op, path), in ggml_layer.cc's order: a dense FFN's, or an MoE
# layer's stacked experts (models.moe)
ATTENTION = (("Q", "wq/kernel"), ("K", "wk/kernel"), ("V", "wv/kernel"), ("OUT", "wo/kernel"))
MATRICES = ATTENTION + (("MLP1", "w_gate/kernel"), ("MLP1", "w_up/kernel"),
                        ("MLP2", "w_down/kernel"))
MOE_MATRICES = ATTENTION + (("MLP2", "experts/gate_kernel"), ("MLP2", "experts/up_kernel"),
                            ("MLP2", "experts/down_kernel"))
# an MoE layer's shared expert's (Qwen2-MoE), after its router
SHARED_MATRICES = (("MLP2", "shared_w_gate/kernel"), ("MLP2", "shared_w_up/kernel"),
                   ("MLP2", "shared_w_down/kernel"))


def _held(params: Sequence[Mapping[str, Any]], table) -> list:
    """The layer's held arrays at ``table``'s (op, path)s."""
    p = dict(zip(LAYER_OPS, params))
    out = []
    for op, path in table:
        node = p[op]
        for key in path.split("/"):
            node = node[key]
        out.append(node)
    return out


def _matrices(spec: ModelSpec, params: Sequence[Mapping[str, Any]]) -> list:
    """The layer's seven held matrices (``MATRICES`` or ``MOE_MATRICES``)."""
    return _held(params, MOE_MATRICES if spec.moe else MATRICES)


def _shared(spec: ModelSpec, params: Sequence[Mapping[str, Any]]) -> list:
    """The layer's shared expert's three held matrices (``SHARED_MATRICES``), or none."""
    return _held(params, SHARED_MATRICES) if spec.moe and spec.moe.d_shared else []


def _matrix(m: Any) -> tuple[Any, Any, int] | None:
    """(the array ggml reads, a centred matrix's centres or None, its ggml type -- with
    ``ggml_kernel.REPACKED`` where repacked, ``ggml_kernel.CENTRED`` where centred; -1:
    float32 rows), or None where ggml cannot multiply the matrix as held."""
    if isinstance(m, GGUFBlocks):
        flags = ((ggml_kernel.REPACKED if m.repacked else 0)
                 | (ggml_kernel.CENTRED if m.centres is not None else 0))
        return m.blocks, m.centres, GGUF_BLOCKS[m.blocks_format.name] | flags
    if isinstance(m, (jax.Array, np.ndarray)) and m.dtype == jnp.float32:
        return m, None, -1
    return None


def _rows(m: Any) -> int:
    """The most rows ggml multiplies the held matrix ``m`` at (``ggml_kernel.KERNEL_ROWS`` of
    its layout; ``DENSE_ROWS`` for float32 rows)."""
    if not isinstance(m, GGUFBlocks):
        return DENSE_ROWS
    return dict(ggml_kernel.KERNEL_ROWS).get(m.layout, 0)


def runs(spec: ModelSpec, params: Sequence[Mapping[str, Any]], rows: int,
         cache: Cache) -> bool:
    """Whether ``decoder_layers`` runs this layer: its family's layer is a ``GraphLayer``, the
    model runs in float32 or bfloat16 with ggml's products (``host_matmul`` ggml, built),
    every matrix is held as ggml reads it at ``rows`` rows (``_rows``: up to 512 for
    repacked q4_0 and q4_1, a whole prefill chunk; 64 for the other layouts), and its cache
    is float keys and values."""
    if (spec.model_family.graph_layer(spec) is None or spec.host_matmul != GGML
            or spec.dtype not in ("float32", "bfloat16") or set(cache) != {"k", "v"}
            or ggml_kernel.unavailable() is not None):
        return False
    kernels = _matrices(spec, params)
    if spec.moe and not all(isinstance(m, GGUFBlocks) and m.layout in ggml_kernel.EXPERT_LAYOUTS
                            for m in kernels[4:]):
        return False
    shared = _shared(spec, params)  # 2-D products like attention's, never centred
    held = [_matrix(m) for m in kernels + shared]
    return (all(h is not None for h in held)
            and all(rows <= _rows(m) for m in kernels[:4] + shared)
            and all(h[1] is None for h in held[len(kernels):]))


def _f32(a) -> jax.Array:
    return jnp.asarray(a, jnp.float32).reshape(-1)


def _layer_tensors(spec: ModelSpec, graph, params: Sequence[Mapping[str, Any]], cache: Cache
                   ) -> tuple[list, list[int], list[int]]:
    """One layer's arguments of ``ggml_layer.cc`` in its order (its caches, norms, matrices,
    the switches' biases and q/k norms, the centred matrices' centres, then an MoE layer's
    router (X, D) and shared expert: its three matrices and sigmoid gate (D,)), its seven
    matrices' types and its shared expert's three."""
    p = dict(zip(LAYER_OPS, params))
    matrices = [_matrix(m) for m in _matrices(spec, params)]
    tensors = [cache["k"], cache["v"], _f32(p["Q"]["attn_norm"]["scale"]),
               *(a for a, _, _ in matrices[:4]), _f32(p["MLP1"]["ffn_norm"]["scale"]),
               *(a for a, _, _ in matrices[4:])]
    if graph.qkv_bias:
        tensors += [_f32(p[op][path.split("/")[0]]["bias"]) for op, path in ATTENTION[:3]]
    if graph.qk_norm:
        tensors += [_f32(p["Q"]["q_norm"]["scale"]), _f32(p["K"]["k_norm"]["scale"])]
    tensors += [c for _, c, _ in matrices if c is not None]
    if spec.moe:
        tensors.append(_f32(p["MLP1"][ROUTER]))
    shared = [_matrix(m) for m in _shared(spec, params)]
    if shared:
        tensors += [a for a, _, _ in shared] + [_f32(p["MLP2"][SHARED_GATE])]
    return tensors, [t for _, _, t in matrices], [t for _, _, t in shared]


def decoder_layers(spec: ModelSpec, layers: Sequence[Sequence[Mapping[str, Any]]],
                   x: jax.Array, step: Step, caches: Sequence[Cache]
                   ) -> tuple[jax.Array, list[Cache]]:
    """Consecutive decoder layers (Q through MLP2 each) of one spec as one ggml graph; only
    where ``runs`` says so of each.

    Args:
      spec: the layers' spec (``ModelSpec.layer_spec``; one for the run).
      layers: each layer's seven ops' parameter trees, in ``LAYER_OPS`` order.
      x: (B, T, D) float32 or bfloat16, the first layer's input (the residual stream stays
        float32 through the run's layers; its output is cast back to x's dtype).
      step: positions (B, T), write_index, kv_start (``models.layers.Step``).
      caches: each layer's {"k", "v"} (B, R, K, E), a ring where the layers have a window;
        written in place.
    Returns:
      (x after the last layer (B, T, D) in x's dtype, each layer's cache with the new keys
      and values, written in the cache's dtype).
    Raises:
      XlaRuntimeError (at run time): ``ggml_layer.cc`` refused an argument's size or type.
    """
    graph, moe = spec.model_family.graph_layer(spec), spec.moe
    B, T, D = x.shape
    R, E = caches[0]["k"].shape[1], spec.head_dim

    tensors, types, shared_types, firsts = [], [], [], []
    for params, cache in zip(layers, caches):
        layer_tensors, layer_types, layer_shared = _layer_tensors(spec, graph, params, cache)
        firsts.append(len(tensors))
        tensors, types = tensors + layer_tensors, types + layer_types
        shared_types += layer_shared
    mask = jnp.where(attention_mask(step, T, R, spec.sliding_window), 0.0, -jnp.inf)
    slots = (step.write_index + jnp.arange(T, dtype=jnp.int32)) % R
    used = jnp.minimum((step.write_index + T + READ_PAD - 1) // READ_PAD * READ_PAD, R)
    freq_factors = inv_frequencies(E, spec.rope_theta) / graph.inv_frequencies(spec)
    results = [jax.ShapeDtypeStruct((B * T, D), jnp.float32)]
    results += [jax.ShapeDtypeStruct(c[name].shape, c[name].dtype) for c in caches
                for name in ("k", "v")]
    first = 6  # x, positions, slots, mask, used, freq_factors
    aliases = {first + start + i: 1 + 2 * layer + i
               for layer, start in enumerate(firsts) for i in (0, 1)}
    y, *written = jax.ffi.ffi_call(ggml_kernel.LAYER_TARGET, results,
                                   input_output_aliases=aliases)(
        x.reshape(B * T, D).astype(jnp.float32), step.positions.astype(jnp.int32),
        slots.astype(jnp.int32),
        mask.astype(jnp.float16), used.astype(jnp.int32), _f32(freq_factors), *tensors,
        types=np.array(types, np.int64), heads=np.int64(spec.n_heads),
        eps=np.float32(spec.norm_eps), scale=np.float32(E ** -0.5),
        freq_base=np.float32(spec.rope_theta), qkv_bias=np.int64(graph.qkv_bias),
        qk_norm=np.int64(2 if graph.qk_norm and graph.qk_norm_whole else graph.qk_norm), experts=np.int64(moe.experts if moe else 0),
        top_k=np.int64(moe.top_k if moe else 0), norm_top_k=np.int64(bool(moe and moe.norm_top_k)),
        shared_types=np.array(shared_types, np.int64),
        threads=np.int64(len(os.sched_getaffinity(0))))
    return (y.reshape(B, T, D).astype(x.dtype),
            [{"k": k, "v": v} for k, v in zip(written[::2], written[1::2])])
