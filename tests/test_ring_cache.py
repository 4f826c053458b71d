"""A sliding-window layer's KV cache is a ring: it holds window + step - 1 slots, not the context.

Each attention kernel (XLA's whole-cache ``attention``, the host's blocked XLA kernel and its numpy
kernel) run step by step over a ring -- prefill chunks, then decode steps that wrap it several
times -- gives what float64 attention over the whole history gives; the compressed cache's ring
gives what its whole cache gives. Then what the bytes table, the memory estimate, the executor
and the planners count: the ring, per layer (Gemma 3's global layers hold the context).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hx.host_compute.attention import prefix_attention
from hx.host_compute.xla_attention import blocked_attention
from hx.memory import estimate
from hx.models.formats import kv_cache_format
from hx.models.layers import Step, append_kv, attention, ring_positions
from hx.models.spec import PRESETS
from hx.models.tensors import (RING_STEP, cache_bytes, held_slots, kv_arrays, kv_bytes,
                               layer_cache_bytes, step_limit, widest_slots)
from hx.planner import policies
from hx.planner.simulator import predict
from hx.workload import Workload, prefill_chunks

from profiles import gpu_like

B, H, K, E = 2, 4, 2, 8
WINDOW = 6
STARTS = np.array([0, 5])  # row 1 left-padded by 5 slots


def full_attention(q, k, v, write_index, window):
    """float64 attention of q (B, T, H, E) at slots write_index.. over the whole history
    k, v (B, write_index + T, K, E), each query seeing the last ``window`` slots from its
    row's start."""
    T, G = q.shape[1], H // K
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            at = write_index + t
            lo = max(STARTS[b], at - window + 1)
            if lo > at:  # a padding query: no key
                continue
            for h in range(H):
                s = k[b, lo:at + 1, h // G] @ q[b, t, h] / np.sqrt(E)
                p = np.exp(s - s.max())
                out[b, t, h] = p @ v[b, lo:at + 1, h // G] / p.sum()
    return out


KERNELS = {
    "xla": jax.jit(attention, static_argnums=(3, 4)),
    "blocked": jax.jit(blocked_attention, static_argnums=(3, 4)),
    "numpy": lambda q, cache, step, fmt, window: prefix_attention(
        np.asarray(q), np.asarray(cache["k"]), np.asarray(cache["v"]), int(step.write_index),
        np.asarray(step.kv_start), window),
}


def steps(prompt: int, decode: int, chunk: int):
    """(write index, tokens) of a prefill in chunks of ``chunk`` then ``decode`` steps."""
    at = 0
    for t in prefill_chunks(prompt, chunk) + [1] * decode:
        yield at, t
        at += t


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_kernel_over_a_ring_equals_float64_over_the_history(kernel):
    ring = held_slots(PRESETS["smollm2-135m"].replace(sliding_window=WINDOW), 1 << 20)
    assert ring == 16  # window + step limit - 1 = 11, rounded up to RING_QUANTUM
    rng = np.random.default_rng(0)
    history = 16 + 40  # a 16-token prompt, then decode wrapping the ring 2.5 times
    k_all, v_all = rng.standard_normal((2, B, history, K, E))
    cache = {"k": jnp.zeros((B, ring, K, E)), "v": jnp.zeros((B, ring, K, E))}
    append = jax.jit(functools.partial(append_kv, ring=True))
    for at, t in steps(16, 40, WINDOW):
        q = rng.standard_normal((B, t, H, E))
        step = Step(jnp.zeros((B, t), jnp.int32), jnp.int32(at), jnp.asarray(STARTS, jnp.int32))
        new = slice(at, at + t)
        cache = append(cache, jnp.asarray(k_all[:, new], jnp.float32),
                       jnp.asarray(v_all[:, new], jnp.float32), step.write_index)
        got = np.asarray(KERNELS[kernel](jnp.asarray(q, jnp.float32), cache, step, None,
                                         WINDOW))
        want = full_attention(q, k_all[:, :at + t], v_all[:, :at + t], at, WINDOW)
        valid = (at + np.arange(t))[None, :] >= STARTS[:, None]  # padding queries aside
        np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5)


def test_a_compressed_ring_equals_its_whole_cache():
    """int8 KV: the ring's attention equals the same format's whole cache's, step by step
    (both attend over the decoded values)."""
    fmt = kv_cache_format("int8", E)
    spec = PRESETS["smollm2-135m"].replace(kv_format="int8", head_dim=E, n_heads=H,
                                           n_kv_heads=K)
    rng = np.random.default_rng(1)
    ring = held_slots(spec.replace(sliding_window=WINDOW), 1 << 20)
    caches = [{n: jnp.zeros(shape, dtype) for n, (shape, dtype) in
               kv_arrays(spec, B, slots).items()} for slots in (ring, 64)]
    for at, t in steps(16, 30, WINDOW):
        q = jnp.asarray(rng.standard_normal((B, t, H, E)), jnp.float32)
        k, v = (jnp.asarray(a, jnp.float32) for a in rng.standard_normal((2, B, t, K, E)))
        step = Step(jnp.zeros((B, t), jnp.int32), jnp.int32(at), jnp.asarray(STARTS, jnp.int32))
        caches = [append_kv(c, k, v, step.write_index, fmt, ring=True) for c in caches]
        got, want = (np.asarray(attention(q, c, step, fmt, WINDOW)) for c in caches)
        valid = (at + np.arange(t))[None, :] >= STARTS[:, None]
        np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-6)


def test_ring_positions_name_the_last_slot_written_at_each_index():
    index = np.arange(8)
    assert ring_positions(index, 8, 5).tolist() == [0, 1, 2, 3, 4, -3, -2, -1]  # not wrapped
    assert ring_positions(index, 8, 19).tolist() == [16, 17, 18, 11, 12, 13, 14, 15]
    assert ring_positions(index, 64, 19).tolist() == list(range(8))  # a cache of S slots


def test_the_bytes_table_counts_the_ring_per_layer():
    """Mistral-7B at 32K slots holds a ring of 4,096 + 512 per layer (8x less than the
    context); Gemma 3 27B's local layers (5 of every 6) a ring of 1,024 + 512, its global ones
    the context; a model without windows the context everywhere."""
    mistral, gemma, llama = PRESETS["mistral-7b"], PRESETS["gemma3-27b"], PRESETS["llama3.1-8b"]
    S = 32768
    assert step_limit(mistral) == RING_STEP and step_limit(llama) is None
    assert held_slots(mistral, S) == 4608 and widest_slots(mistral, S) == 4608
    assert held_slots(mistral, 1024) == 1024  # a short run holds its slots
    L = mistral.n_layers
    assert cache_bytes(mistral, 1, S, range(L)) == L * kv_bytes(mistral, 1, 4608)
    local = [i for i in range(gemma.n_layers) if gemma.layer_spec(i).sliding_window]
    assert len(local) == 52  # of 62: every 6th global (5, 11, ..., 59)
    assert widest_slots(gemma, S) == S
    assert cache_bytes(gemma, 1, S, range(gemma.n_layers)) == (
        len(local) * kv_bytes(gemma, 1, 1536) + (gemma.n_layers - len(local)) * kv_bytes(gemma, 1, S))
    assert layer_cache_bytes(llama, 1, S) == kv_bytes(llama, 1, S)


def test_the_estimate_and_the_simulator_count_what_is_held():
    """The memory estimate's KV cache on the accelerator is the rings'; the simulator's decode
    step at 32K slots in use reads a ring, not the context, where the layers have a window."""
    spec = PRESETS["mistral-7b"].replace(n_layers=2)
    work = Workload(1, 512, 32768)
    plan = policies.all_accelerator(spec.n_layers)
    assert estimate(plan, spec, work, sizing="unsized").kv == 2 * kv_bytes(spec, 1, 4608)
    unwindowed = spec.replace(sliding_window=None)
    assert estimate(plan, unwindowed, work, sizing="unsized").kv == 2 * kv_bytes(spec, 1, 32768)
    ring, whole = (predict(plan, s, gpu_like(), "decode", 16, 1, 32768, 32000).seconds
                   for s in (spec, unwindowed))  # 16 rows: reading the cache dominates
    assert ring < 0.5 * whole
