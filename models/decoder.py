"""A decoder as the composition of its ops, whatever its family (``models.family``).

Every op is a Flax module of the model's family (``Family.modules``) whose parameters are
exactly the weights that op owns; ``apply_op`` turns it into a pure function ``(params,
activations, step[, cache]) -> (activations[, cache])`` that jits on its own, which is what the
executor compiles segment by segment. ``forward`` is the whole model as one function: the
single-jit reference the executor is checked and timed against. What each op reads and writes
is the op table (``models.tensors.OPS``); what it computes is its family's. A decoder layer's
ops run with that layer's spec (``ModelSpec.layer_spec``: its window and RoPE where the model's
layers differ in type, Gemma 3's local and global layers).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from hx.models.compressed import DEFAULT_PRODUCTS, Products
from hx.models.family import TABLE
from hx.models.formats import DENSE
from hx.models.holding import hold_tree
from hx.models.layers import Cache, Params, Step
from hx.models.spec import EMBED, HEAD, LAYER_OPS, ModelSpec
from hx.models.tensors import OPS, activation_shape, layer_key


def apply_op(spec: ModelSpec, op: str, params: Params, acts: Mapping[str, jax.Array],
             step: Step, cache: Cache | None = None, attend=None, held: str | None = None,
             products: Products = DEFAULT_PRODUCTS
             ) -> tuple[dict[str, jax.Array], Cache | None]:
    """Run one op of ``spec``'s family as a pure function.

    Args:
      spec: model shapes (static); for a decoder layer's op, that layer's
        (``ModelSpec.layer_spec``).
      op: op id, one of ``models.tensors.OPS``.
      params: that op's parameter tree (``params[layer][op]``).
      acts: activations by name; the op reads ``OPS[op].reads``.
      step: per-step positions and cache indices.
      cache: the layer's KV cache (SCORE only).
      attend: attention kernel for SCORE (default ``models.layers.attention``).
      held: the dtype the device holds dense weights in and decompresses compressed matrices
        to (``models.tensors.weight_dtype``; default the model's dtype).
      products: how the op's device multiplies held matrices (``models.compressed.Products``;
        the host's: ``hx.host_compute.products.products_on``).
    Returns:
      (activations written, keyed by ``OPS[op].writes``; the updated cache or None).
    Raises:
      ValueError: a decoder layer's op given the spec of a model whose layers differ in type
        (which layer's window and RoPE is unknown).
    """
    if spec.layer_types and op in LAYER_OPS:
        raise ValueError(f"{op} of {spec.name}, whose layers differ in type, runs with its "
                         "layer's spec (ModelSpec.layer_spec)")
    d, module_type = OPS[op], spec.model_family.module(spec, op)
    if d.uses_cache:
        module = module_type(spec, attend) if attend else module_type(spec)
    else:
        module = module_type(spec, held, products)
    inputs = [acts[name] for name in d.reads]
    with jax.named_scope(op):
        if d.uses_cache:
            outs, cache = module.apply({"params": params}, *inputs, step, cache)
        else:
            outs = module.apply({"params": params}, *inputs, step)
    return dict(zip(d.writes, outs)), cache


def decoder_layer(spec: ModelSpec, params: Params, acts: Mapping[str, jax.Array], step: Step,
                  cache: Cache, products: Products = DEFAULT_PRODUCTS
                  ) -> tuple[dict[str, jax.Array], Cache]:
    """One decoder layer: the seven ops composed in order.

    Args:
      spec: the layer's spec (``ModelSpec.layer_spec``).
      params: the layer's tree ``{op: op params}``.
      acts: must hold ``x`` (B,T,D).
      cache: the layer's KV cache, (B,S,K,E) each.
      products: how its device multiplies held matrices (``apply_op``).
    Returns:
      (activations with the layer's output ``x``, updated cache).
    """
    acts = dict(acts)
    for op in LAYER_OPS:
        out, cache = apply_op(spec, op, params[op], acts, step, cache, products=products)
        acts.update(out)
    return acts, cache


def forward(spec: ModelSpec, params: Params, tokens: jax.Array, step: Step,
            caches: list[Cache], products: Products = DEFAULT_PRODUCTS
            ) -> tuple[jax.Array, list[Cache]]:
    """The whole model as one function: EMBED, every layer, HEAD.

    Args:
      tokens: (B, T) int32.
      caches: one ``Cache`` per layer.
      products: how its device multiplies held matrices (``apply_op``).
    Returns:
      (logits (B, V) float32 of the last position, updated caches).
    """
    acts, _ = apply_op(spec, EMBED, params[EMBED], {"tokens": tokens}, step,
                       products=products)
    new_caches = []
    for i in range(spec.n_layers):
        acts, cache = decoder_layer(spec.layer_spec(i), params[layer_key(i)], acts, step,
                                    caches[i], products)
        new_caches.append(cache)
    out, _ = apply_op(spec, HEAD, params[HEAD], acts, step, products=products)
    return out["logits"], new_caches


def init_params(spec: ModelSpec, seed: int = 0) -> dict[str, Any]:
    """Random parameters with the model's tree layout (tests and benchmarks), initialised by
    the family's modules.

    Returns ``{"EMBED": ..., "layer_0": {"Q": ..., ...}, ..., "HEAD": ...}`` in ``spec.dtype``,
    matrices in the spec's formats (initialised dense, then compressed with
    ``models.holding.hold``: ``models.compressed.GroupMatrix`` leaves; torch's int4 layout
    is made from them where a model is loaded: ``host_compute.int4_kernel.int4pack_params``).
    For a tied model
    ``HEAD``'s table is the same array (or subtree) as ``EMBED``'s.
    """
    key = jax.random.PRNGKey(seed)
    B, T = 1, 1
    step = Step(jnp.zeros((B, T), jnp.int32), jnp.int32(0), jnp.zeros((B,), jnp.int32))
    dense = spec.replace(weight_format=DENSE, embedding_format=DENSE)
    def init(op, k, layer=None):
        d = OPS[op]
        if d.uses_cache:
            return {}
        op_spec = dense if layer is None else dense.layer_spec(layer)
        dummy = [jnp.zeros(*activation_shape(op_spec, n, B, T)) for n in d.reads]
        module = spec.model_family.module(op_spec, op)(op_spec)
        return hold_tree(module.init(k, *dummy, step)["params"], spec.matrix_format)

    keys = iter(jax.random.split(key, spec.n_layers * len(LAYER_OPS) + 2))
    params: dict[str, Any] = {EMBED: init(EMBED, next(keys))}
    for i in range(spec.n_layers):
        params[layer_key(i)] = {op: init(op, next(keys), i) for op in LAYER_OPS}
    params[HEAD] = init(HEAD, next(keys))
    if spec.tie_embeddings:
        params[HEAD] = {**params[HEAD], TABLE: params[EMBED][TABLE]}
    return params
