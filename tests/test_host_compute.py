"""The host attention kernel against float64 attention written out in numpy."""

import jax
import ml_dtypes
import numpy as np
import pytest

from hx.host_compute import attention as host_attention
from hx.host_compute.attention import host_view, prefix_attention
from hx.models.layers import Step, attention


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
    got = prefix_attention(q, k, v, write_index, kv_start)
    ref = attention_np(q, k, v, kv_start, write_index)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    generic = jax.jit(attention)(q, {"k": k, "v": v}, step)
    np.testing.assert_allclose(got, np.asarray(generic), atol=2e-5)


def test_chunks_and_query_blocks_match_float64(monkeypatch):
    """Slot chunks and query blocks smaller than the prefix give the same result, on a
    bfloat16 cache (widened chunk by chunk) and one row split over KV head groups."""
    monkeypatch.setattr(host_attention, "SLOT_CHUNK", 7)
    monkeypatch.setattr(host_attention, "SCORE_BYTES", 4 * 2 * 3 * 30)  # 3-query blocks
    monkeypatch.setattr(host_attention, "threads", lambda: 4)
    monkeypatch.setattr(host_attention, "MIN_TASK_BYTES", 1)
    rng = np.random.default_rng(5)
    B, T, S, H, K, E, write_index = 1, 8, 40, 4, 2, 8, 21
    q = rng.standard_normal((B, T, H, E)).astype(np.float32)
    k = rng.standard_normal((B, S, K, E)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((B, S, K, E)).astype(ml_dtypes.bfloat16)
    got = prefix_attention(q, k, v, write_index, np.array([3]))
    ref = attention_np(q, k.astype(np.float64), v.astype(np.float64), [3], write_index)
    np.testing.assert_allclose(got, ref, atol=2e-5)


def test_padding_query_gets_zeros():
    """A query before its row's first valid slot has no key: zeros, not NaN."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    k = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    got = prefix_attention(q, k, k, 0, np.array([0, 2]))
    assert np.all(got[1, :2] == 0) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got[1, 2:], attention_np(q[1:, 2:], k[1:], k[1:], [2], 2)[0],
                               atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_host_view_reads_the_buffer_in_place(dtype):
    x = jax.device_put(np.arange(24, dtype=np.float32).astype(dtype).reshape(2, 3, 4),
                       jax.devices("cpu")[0])
    view = host_view(x)
    assert view.dtype == np.dtype(dtype) and not view.flags.writeable
    assert view.ctypes.data == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view, np.asarray(x))


def test_unwritten_slots_are_never_read():
    """Garbage (NaN) past the last written slot does not reach the output."""
    B, T, S, H, K, E = 1, 1, 128, 2, 1, 8
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, E)).astype(np.float32)
    k = rng.standard_normal((B, S, K, E)).astype(np.float32)
    v = rng.standard_normal((B, S, K, E)).astype(np.float32)
    k[:, 64:], v[:, 64:] = np.nan, np.nan
    got = prefix_attention(q, k, v, 40, np.zeros(B, np.int32))
    np.testing.assert_allclose(got, attention_np(q, k, v, [0], 40), atol=2e-5)
