"""The host attention kernel against float64 attention written out in numpy."""

import jax
import numpy as np
import pytest

from hx.host_compute.attention import prefix_attention
from hx.models.llama import Step, attention


def attention_np(q, k, v, kv_start, write_index):
    """softmax(q k^T / sqrt(E)) v with causal and left-padding masks, float64, per head."""
    B, T, H, E = q.shape
    K = k.shape[2]
    o = np.zeros((B, T, H, E))
    for b in range(B):
        for t in range(T):
            keys = np.arange(kv_start[b], write_index + t + 1)
            for h in range(H):
                kv = h // (H // K)
                s = k[b, keys, kv].astype(np.float64) @ q[b, t, h] / np.sqrt(E)
                w = np.exp(s - s.max())
                o[b, t, h] = (w / w.sum()) @ v[b, keys, kv]
    return o


@pytest.mark.parametrize("T, S, write_index", [(1, 192, 0), (1, 192, 70), (1, 192, 191),
                                               (5, 48, 20), (16, 64, 0), (3, 40, 10)])
def test_prefix_attention_matches_float64(T, S, write_index):
    rng = np.random.default_rng(T * 1000 + S + write_index)
    B, H, K, E = 3, 6, 2, 16
    q = rng.standard_normal((B, T, H, E)).astype(np.float32)
    k = rng.standard_normal((B, S, K, E)).astype(np.float32)
    v = rng.standard_normal((B, S, K, E)).astype(np.float32)
    kv_start = np.array([0, min(2, write_index), min(7, write_index)], np.int32)
    step = Step(np.zeros((B, T), np.int32), np.int32(write_index), kv_start)
    got = jax.jit(prefix_attention)(q, {"k": k, "v": v}, step)
    ref = attention_np(q, k, v, kv_start, write_index)
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5)
    generic = jax.jit(attention)(q, {"k": k, "v": v}, step)
    np.testing.assert_allclose(np.asarray(got), np.asarray(generic), atol=2e-5)


def test_unwritten_slots_are_never_read():
    """Garbage (NaN) past the last written slot does not reach the output."""
    B, T, S, H, K, E = 1, 1, 128, 2, 1, 8
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, E)).astype(np.float32)
    k = rng.standard_normal((B, S, K, E)).astype(np.float32)
    v = rng.standard_normal((B, S, K, E)).astype(np.float32)
    k[:, 64:], v[:, 64:] = np.nan, np.nan
    step = Step(np.zeros((B, T), np.int32), np.int32(40), np.zeros(B, np.int32))
    got = np.asarray(jax.jit(prefix_attention)(q, {"k": k, "v": v}, step))
    np.testing.assert_allclose(got, attention_np(q, k, v, [0], 40), atol=2e-5)
