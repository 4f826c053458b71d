"""The Flax ops, composed, against an independent float64 numpy Llama (tiny random model)."""

import jax
import numpy as np
import pytest

from hx.executor import Executor
from hx.generate import Engine
from hx.models.layers import Step
from hx.models.decoder import forward, init_params
from hx.plan import ExecutionPlan

from numpy_reference import logits_np

RTOL = 1e-5  # float32 vs float64: relative to the largest |logit|


def rel_err(a, ref):
    return np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max()


def test_prefill_logits_match_float64(tiny_model):
    tokens = [5, 901, 17, 3000, 42, 7, 7, 123, 49000]
    engine = Engine(tiny_model)
    got = engine.last_logits([tokens])[0]
    ref = logits_np(tiny_model.spec, tiny_model.params, tokens)[-1]
    assert rel_err(got, ref) < RTOL


def test_incremental_decode_matches_full_sequence(tiny_model, devices):
    """Prefill 4 tokens, then decode one at a time: each step's logits equal the float64
    logits of the whole prefix (KV-cache append and masking are right)."""
    spec, params = tiny_model.spec, tiny_model.params
    tokens = [11, 22, 33, 44, 55, 66, 77, 88]
    ref = logits_np(spec, params, tokens)
    ex = Executor(spec, params, ExecutionPlan.all_accelerator(spec.n_layers), devices)
    caches = ex.new_cache(1, 16)
    n0 = 4
    logits, caches = ex.run("prefill", np.array([tokens[:n0]], np.int32),
                            Step(np.arange(n0, dtype=np.int32)[None], np.int32(0),
                                 np.zeros(1, np.int32)), caches)
    assert rel_err(logits[0], ref[n0 - 1]) < RTOL
    for t in range(n0, len(tokens)):
        logits, caches = ex.run("decode", np.array([[tokens[t]]], np.int32),
                                Step(np.array([[t]], np.int32), np.int32(t),
                                     np.zeros(1, np.int32)), caches)
        assert rel_err(logits[0], ref[t]) < RTOL


def test_left_padding_does_not_change_rows(tiny_model):
    prompts = [[1, 2, 3], list(range(100, 121)), [7] * 9, [48000, 5]]
    got = Engine(tiny_model).last_logits(prompts)
    for row, tokens in zip(got, prompts):
        assert rel_err(row, logits_np(tiny_model.spec, tiny_model.params, tokens)[-1]) < RTOL


def test_untied_head_and_mha(tiny_model):
    """Untied LM head and plain multi-head attention (K = H) also match."""
    spec = tiny_model.spec.replace(n_kv_heads=4, tie_embeddings=False, n_layers=2)
    params = jax.tree.map(np.asarray, init_params(spec, seed=3))
    assert params["HEAD"]["embedding"] is not params["EMBED"]["embedding"]
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    step = Step(np.arange(8, dtype=np.int32)[None], np.int32(0), np.zeros(1, np.int32))
    caches = [{"k": np.zeros((1, 8, 4, 16), np.float32), "v": np.zeros((1, 8, 4, 16), np.float32)}
              for _ in range(2)]
    logits, _ = jax.jit(forward, static_argnums=0)(spec, params, np.array([tokens]), step, caches)
    assert rel_err(logits[0], logits_np(spec, params, tokens)[-1]) < RTOL


@pytest.mark.parametrize("bad", [dict(n_heads=6, n_kv_heads=4), dict(head_dim=15)])
def test_spec_rejects_impossible_shapes(tiny_model, bad):
    with pytest.raises(ValueError):
        tiny_model.spec.replace(**bad)
