"""A Mixture of Experts' routing measured (issue 40, item 5): how many of a prompts file's
tokens each layer routes to each of its experts, written as the trace file that
``--expert-activity`` reads (``hx.planner.experts.ExpertActivity.from_trace``).

Each prompt is prefilled alone on the host, op by op (``models.decoder.apply_op``, the host's
products: ggml over a GGUF's blocks), and after each layer's router (MLP1) its routing weights
are read back: a token picks the experts whose weight is not 0, k of them. Prefill alone, not
the generated tokens: routing statistics of a prompts file, as a planner's calibration run
takes them (MoE-Infinity's activation traces, Fiddler's popularity profile).
"""

from __future__ import annotations

import functools
import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hx.devices import HOST
from hx.errors import HxError
from hx.host_compute.products import products_on
from hx.models.decoder import apply_op
from hx.models.layers import Step
from hx.models.loader import Model
from hx.models.spec import EMBED, LAYER_OPS, SCORE, ModelSpec
from hx.models.tensors import kv_arrays, layer_key, numpy_dtype, weight_dtype


@functools.partial(jax.jit, static_argnums=(0, 1))
def _op(spec: ModelSpec, op: str, params, acts, step: Step, cache):
    """One op of ``spec`` on the host (``apply_op`` with the host's held dtype and products)."""
    return apply_op(spec, op, params, acts, step, cache, held=weight_dtype(spec, HOST),
                    products=products_on(HOST))


def count_picks(model: Model, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """(layers, X) int64: of the tokens of ``prompts`` (token ids each), how many each layer
    routed to each of its X routed experts, each prompt prefilled alone (module docstring).
    Every row of the result sums to k x the tokens.

    Raises:
      HxError: a dense model, or no tokens.
    """
    spec = model.spec
    if spec.moe is None:
        raise HxError(f"{spec.name} has no routed experts to trace")
    if not any(len(p) for p in prompts):
        raise HxError("no prompt tokens to trace the routing of")
    counts = np.zeros((spec.n_layers, spec.moe.routed), np.int64)
    for prompt in prompts:
        T = len(prompt)
        if not T:
            continue
        step = Step(jnp.arange(T, dtype=jnp.int32)[None], jnp.int32(0),
                    jnp.zeros((1,), jnp.int32))
        acts, _ = _op(spec, EMBED, model.params[EMBED],
                      {"tokens": jnp.asarray([prompt], jnp.int32)}, step, None)
        for i in range(spec.n_layers):
            layer = spec.layer_spec(i)
            cache = {name: jnp.zeros(shape, numpy_dtype(dtype))
                     for name, (shape, dtype) in kv_arrays(layer, 1, T).items()}
            for op in LAYER_OPS:
                out, new = _op(layer, op, model.params[layer_key(i)][op], acts, step,
                               cache if op == SCORE else None)
                cache = new if op == SCORE else cache
                acts = {**acts, **out}
                if op == "MLP1" and layer.moe:  # a dense first layer routes nothing
                    weights = np.asarray(out["a"][..., spec.d_model:], np.float32)
                    counts[i] += (weights.reshape(-1, spec.moe.routed) != 0).sum(axis=0)
    return counts


def write_trace(path: str, counts: np.ndarray, spec: ModelSpec, tokens: int) -> None:
    """``counts`` (``count_picks``) as the trace file ``ExpertActivity.from_trace`` reads:
    ``{"layers": [[picks of expert 0, ...], ...], "model": NAME, "tokens": N}``."""
    with open(path, "w") as f:
        json.dump({"layers": counts.tolist(), "model": spec.name, "tokens": tokens}, f)
