"""SCORE on the host inside XLA, for small KV caches: attention over the used prefix.

The generic ``models.layers.attention`` scores every cache slot and masks the unused ones, so its
cost grows with the cache length S. This kernel walks the cache in blocks up to the last
written slot with an online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax"; the FlashAttention recurrence), so a decode step reads ``write_index + 1`` slots
rounded up to a block, not S. It stays in the host segment's XLA program, which the executor
dispatches without waiting; that wins while the cache is small (below
``host_compute.attention.NUMPY_MIN_BYTES``), above which the numpy kernel of
``host_compute.attention``, 2.5-5x faster per byte there, takes over.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hx.models.formats import Format
from hx.models.layers import Cache, Step, read_kv, visible

BLOCK = 64  # cache slots per iteration (reduced to a divisor of S when needed)


def blocked_attention(q: jax.Array, cache: Cache, step: Step, fmt: Format | None = None,
                      window: int | None = None) -> jax.Array:
    """Causal grouped-query attention of new queries over the used prefix of the cache.

    Args:
      q: (B, T, H, E) queries of the new tokens, at slots ``write_index .. write_index+T-1``.
      cache: {"k", "v"}: (B, R, K, E), the new tokens already appended; compressed in
        ``fmt`` when given (``models.tensors.kv_arrays``), each block decompressed as it is
        read (``models.layers.read_kv``), so only the compressed bytes are read. A ring of R
        slots (``models.layers.ring_positions``): slots are visited in order, slot s at
        index s mod R (a block never wraps: its size divides R).
      step: ``write_index`` bounds the blocks visited; ``kv_start`` masks left padding.
      window: the sliding window (``models.layers.attention``), None for none; the blocks
        before it are not visited (a ring holds at least the window and the new tokens).
    Returns:
      o: (B, T, H, E), equal to ``models.layers.attention`` for every query that has a valid
      key; a padding query (no valid key) gets zeros.
    """
    B, T, H, E = q.shape
    R, K = cache["k"].shape[1], cache["k"].shape[2]
    G = H // K
    block = math.gcd(R, BLOCK)
    qg = q.reshape(B, T, K, G, E).astype(jnp.float32) * E**-0.5
    query_slot = step.write_index + jnp.arange(T)  # (T,)
    end = step.write_index + T
    n_blocks = (end + block - 1) // block
    floor = jnp.finfo(jnp.float32).min

    def body(i, carry):
        m, denom, acc = carry  # (B,K,G,T), (B,K,G,T), (B,K,G,T,E)
        start = i * block
        kb = read_kv(cache, "k", fmt, start % R, block)  # (B,block,K,E) float32
        vb = read_kv(cache, "v", fmt, start % R, block)
        s = jnp.einsum("btkge,bske->bkgts", qg, kb)  # (B,K,G,T,block)
        slot = start + jnp.arange(block)
        valid = visible(slot[None, None, :], query_slot[None, :, None],
                        step.kv_start[:, None, None], window)[:, None, None]  # B,1,1,T,b
        valid &= (slot >= end - R)[None, None, None, None]  # not yet overwritten in a ring
        s = jnp.where(valid, s, floor)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * valid
        correction = jnp.exp(m - m_new)
        denom = denom * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bkgts,bske->bkgte", p, vb)
        return m_new, denom, acc

    init = (jnp.full((B, K, G, T), floor), jnp.zeros((B, K, G, T)), jnp.zeros((B, K, G, T, E)))
    first = jnp.maximum(end - R, 0) // block  # a ring's oldest slot still held
    if window is not None:
        first = jnp.maximum(first, jnp.maximum(step.write_index - window + 1, 0) // block)
    _, denom, acc = jax.lax.fori_loop(first, n_blocks, body, init)
    o = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)
    return jnp.einsum("bkgte->btkge", o).reshape(B, T, H, E).astype(q.dtype)
