"""Building blocks every family's ops share (``models.family``): the step inputs, norms, RoPE,
products over held weight formats, the KV cache and attention.

Axis letters used in shapes and einsums throughout:
  B batch, T new tokens (queries), S KV-cache slots (context), D model (hidden),
  H query heads, K key/value heads, G = H / K query heads per KV head, E head dim,
  F feed-forward inner size, V vocabulary.

Model code never mentions a device: placement is the executor's job (``hx/executor.py``).

Dtypes. Activations between ops and KV caches are in ``spec.dtype`` (``float32``, ``bfloat16``
or ``float16``); logits are float32. A matmul runs in its weights' dtype with float32
accumulation (``preferred_element_type``), and an op rounds its result to ``spec.dtype`` once,
after its residual add or activation; norms, RoPE and softmax compute in float32. The
weights decide the math, not the device: the executor holds the weights of host-computed ops in
the model's dtype, except float32 for a float16 model (``spec.host_dtype``: XLA:CPU has no fast
float16 product), whose host ops then compute in float32 on float16 activations. A float32
model computes in float32 throughout (float32 dots at "highest" precision:
``hx.devices.configure_runtime``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from hx.models.compressed import (COMPRESSED, DEFAULT_PRODUCTS, GGUFBlocks, GroupMatrix,
                                  Products, check_shape, dequantize_parts, product, row_slice)
from hx.models.family import TABLE
from hx.models.formats import DENSE, Format, get_format
from hx.models.spec import ModelSpec
from hx.models.tensors import KV_NAMES, kv_format, kv_key


Params = Mapping[str, Any]
# One layer's KV cache: {"k": (B,S,K,E), "v": (B,S,K,E)} in the model's dtype, or compressed
# {"k": codes, "k_scale", "k_offset", "v": ...} (``models.tensors.kv_arrays``)
Cache = dict[str, jax.Array]


class Step(NamedTuple):
    """Per-step inputs shared by all ops (tiny; replicated to every device that needs them).

    Attributes:
      positions: (B, T) int32 RoPE positions of the new tokens.
      write_index: () int32 cache slot of the first new token (same for every row: prompts are
        left-padded to a common length).
      kv_start: (B,) int32 first valid cache slot of each row (its left-padding length).
    """

    positions: jax.Array
    write_index: jax.Array
    kv_start: jax.Array


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + scale) over the last axis, computed in float32
    and returned in ``x``'s dtype.

    (Zhang & Sennrich 2019, as in Llama: ``offset`` 0, ``scale`` initialised to 1; Gemma's
    stores scale - 1: ``offset`` 1, initialised to 0, as transformers' ``Gemma3RMSNorm``.)
    Parameter ``scale``: (D,) of ``param_dtype``.
    """

    eps: float
    param_dtype: Any = jnp.float32
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.constant(1.0 - self.offset),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * scale + bias over the last axis, in float32,
    returned in ``x``'s dtype (Ba et al. 2016; OPT). Parameters ``scale``, ``bias``: (D,)."""

    eps: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True)
                                    + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def inv_frequencies(head_dim: int, theta: float) -> jax.Array:
    """RoPE's inverse frequencies theta^(-2i/E), i < E/2 (Su et al. 2021), float32 (E/2,)."""
    return 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
         interleaved: bool = False) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), in the rotate-half layout (Hugging Face
    Llama: element i paired with i + E/2) or ``interleaved`` (the paper's and DeepSeek's:
    elements 2i and 2i + 1 paired, transformers' ``apply_rotary_emb`` over complex pairs).

    Args:
      x: (B, T, N, E) queries or keys.
      positions: (B, T) int32 absolute positions.
      inv_freq: (E/2,) float32 inverse frequencies (``inv_frequencies``, or a family's scaled
        ones); pair i turns by position x inv_freq[i].
    Returns:
      (B, T, N, E) rotated, same dtype as ``x`` (computed in float32).
    """
    angle = positions[..., None].astype(jnp.float32) * inv_freq  # (B,T,E/2)
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]  # (B,T,1,E/2)
    x32 = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def matrix(module: nn.Module, name: str, shape: tuple[int, ...], fmt: str, dtype, init):
    """Weight matrix ``name`` of ``module``, of logical ``shape``, as it is held: the dense
    parameter (``dtype``; ``init`` initialises it) where ``fmt`` is dense, else the compressed
    leaf the parameters give (``models.compressed``; made by quantizing a dense matrix, never
    initialised).

    Raises:
      ValueError: a compressed matrix absent, or of another shape.
    """
    if get_format(fmt) is None:
        return module.param(name, init, shape, dtype)
    if not module.has_variable("params", name):
        raise ValueError(f"{module.name}/{name}: a {fmt} matrix is made by compressing a dense "
                         "one (models.holding.hold), not initialised")
    held = module.get_variable("params", name)
    if not isinstance(held, COMPRESSED):
        raise ValueError(f"{module.name}/{name}: the model holds it {fmt}, the parameters "
                         f"give {type(held).__name__}")
    check_shape(held, shape, f"{module.name}/{name}")
    return held


class Dense(nn.Module):
    """y = x W^T [+ b], contracting ``axis`` of x with the trailing axes of W, in float32.

    ``kernel``: ``features + x.shape[axis]`` -- the checkpoint's (out..., in) layout; held in
    ``fmt`` (``dense``, or a compressed format: ``models.compressed``, decompressed to
    ``param_dtype`` or multiplied by the kernel ``products`` gives for its type);
    ``bias``: ``features``. The product (``models.compressed.product``) runs in the kernel's
    dtype (x is cast to it) with float32 accumulation, the bias is added in float32, and y is
    float32: the op rounds it to the activation dtype once, after what it adds to it.
    Initialised as ``nn.DenseGeneral`` (LeCun normal over the flattened matrix, zero bias).
    """

    features: tuple[int, ...]
    axis: tuple[int, ...] = (-1,)
    use_bias: bool = False
    param_dtype: Any = jnp.float32
    fmt: str = DENSE
    products: Products = DEFAULT_PRODUCTS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        axis = tuple(a % x.ndim for a in self.axis)
        n_out, n_in = len(self.features), len(axis)
        init = nn.initializers.lecun_normal(in_axis=tuple(range(n_out, n_out + n_in)),
                                            out_axis=tuple(range(n_out)))
        shape = self.features + tuple(x.shape[a] for a in axis)
        kernel = matrix(self, "kernel", shape, self.fmt, self.param_dtype, init)
        # as a 2-D product (..., in) x (out, in)^T: bitcasts of both (the contracted axes are
        # x's last and the kernel's last), which XLA multiplies without copying the kernel
        # (contracting a (D, H, E) kernel over (H, E) as it is, XLA:CPU transposed it each step)
        if axis != tuple(range(x.ndim - n_in, x.ndim)):
            raise ValueError(f"Dense contracts x's trailing axes, not {self.axis}")
        rows = x.reshape(-1, math.prod(shape[n_out:]))
        y = product(kernel, rows, self.param_dtype, self.products, after=x)
        y = y.reshape(*x.shape[:-n_in], *self.features)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), self.features,
                              self.param_dtype)
            y = y + bias.astype(jnp.float32)
        return y


def held_dtype(module: nn.Module):
    """The dtype an op module holds dense weights in and decompresses matrices to: its
    ``held`` (``models.tensors.weight_dtype`` of its device), else the model's dtype."""
    return jnp.dtype(module.held or module.spec.dtype)


def dense(module: nn.Module, features, axis=-1, name=None, use_bias=False) -> Dense:
    """A ``Dense`` of op module ``module`` (a ``WeightedOp``): its matrix held in the model's
    weight format, dense weights in ``held_dtype(module)``, multiplied with the products the
    op is given."""
    features = tuple(features) if isinstance(features, tuple) else (features,)
    axis = tuple(axis) if isinstance(axis, tuple) else (axis,)
    return Dense(features, axis, use_bias, held_dtype(module), module.spec.weight_format,
                 module.products, name=name)


class WeightedOp(nn.Module):
    """An op with weights: ``spec``; ``held``, the dtype its device holds dense weights in
    (``held_dtype``); ``products``, how its device multiplies held matrices
    (``models.compressed.Products``: the executor's choice, as SCORE's ``attend`` is)."""

    spec: ModelSpec
    held: str | None = None
    products: Products = DEFAULT_PRODUCTS



def quantize_kv(x: jax.Array, fmt: Format) -> dict[str, jax.Array]:
    """New keys or values x (..., E), any float dtype, compressed group-wise along E into
    ``fmt``'s arrays (``Format.arrays(x.shape)``: uint8 codes (..., E/g, g·bits/8), float16
    scales and offsets (..., E/g)).

    ``models.formats.quantize`` in JAX, step for step (FlexGen's min/max scheme, Sheng et al.
    2023 §5): in float32, an asymmetric group's offset is its minimum and its scale (max -
    min) / (2^bits - 1), both rounded to float16, and each code rounds (w - offset) / scale
    to nearest with those rounded values (a symmetric format: scale max|w| / (2^(bits-1) - 1),
    codes centred on 2^(bits-1)); a group of equal values gets scale 0. On XLA:CPU the codes,
    scales and offsets equal numpy's bit for bit (``tests/test_kv_formats.py``).
    """
    *lead, E = x.shape
    g, top = fmt.group, (1 << fmt.bits) - 1
    w = x.astype(jnp.float32).reshape(*lead, E // g, g)
    held = {}
    if fmt.asymmetric:
        low = w.min(axis=-1)
        held["offset"] = low.astype(jnp.float16)
        scale = ((w.max(axis=-1) - low) / top).astype(jnp.float16)
        base = held["offset"].astype(jnp.float32)[..., None]
    else:
        scale = (jnp.abs(w).max(axis=-1) / (fmt.zero - 1)).astype(jnp.float16)
        base = jnp.float32(0)
    held["scale"] = scale
    step = scale.astype(jnp.float32)[..., None]
    codes = jnp.where(step > 0, jnp.rint((w - base) / jnp.where(step > 0, step, 1)), 0)
    codes = jnp.clip(codes + fmt.zero, 0, top).astype(jnp.uint8)
    if fmt.bits == 4:  # low nibbles a group's first half, high nibbles its second
        codes = codes[..., :g // 2] | (codes[..., g // 2:] << 4)
    return {"codes": codes, **held}


def read_kv(cache: Cache, name: str, fmt: Format | None, start: jax.Array | int | None = None,
            size: int | None = None) -> jax.Array:
    """Cache array ``name`` (``k`` or ``v``) as float32 (B, S, K, E) -- or only its ``size``
    slots from ``start`` -- decompressed right here when ``fmt`` is a format
    (``dequantize`` of the slots read: attention reads the compressed bytes)."""
    def part(key: str) -> jax.Array:
        a = cache[key]
        return a if start is None else jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)

    if fmt is None:
        return part(name).astype(jnp.float32)
    held = {p: part(kv_key(name, p)) for p in ("codes", "scale", "offset")
            if kv_key(name, p) in cache}
    scale = held["scale"]
    return dequantize_parts(held, fmt, (*scale.shape[:-1], scale.shape[-1] * fmt.group),
                            jnp.float32)


def attention(q: jax.Array, cache: Cache, step: Step, fmt: Format | None = None,
              window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention of new queries over the (already appended) KV cache.

    Args:
      q: (B, T, H, E) queries of the new tokens, slots ``write_index .. write_index+T-1``.
      cache: {"k", "v"}: (B, R, K, E) with the new tokens' keys/values written (compressed
        in ``fmt`` when given: decompressed whole to float32 first, ``read_kv``); a ring of
        R slots, slot s at index s mod R (``ring_positions``; R >= every slot written: the
        slots in order).
      step: ``kv_start`` masks each row's left padding; causality masks future slots.
      window: a query sees only the last ``window`` slots, its own included (sliding-window
        attention, ``ModelSpec.sliding_window``); None: every slot before it.
      sinks: (B, T, H) float32, each head's sink logit (``ModelSpec.sinks``): its exp joins
        the softmax's denominator and weighs no value; None: none.
    Returns:
      o: (B, T, H, E) = softmax(q k^T / sqrt(E) + mask) v  (Vaswani et al. 2017, eq. 1),
      accumulated in float32. A row with no valid key (a padding query) gets a finite average.
    """
    B, T, H, E = q.shape
    ck, cv = read_kv(cache, "k", fmt), read_kv(cache, "v", fmt)
    R, K = ck.shape[1], ck.shape[2]
    qg = q.reshape(B, T, K, H // K, E).astype(jnp.float32)
    scores = jnp.einsum("btkge,bske->bkgts", qg, ck) * E**-0.5
    valid = attention_mask(step, T, R, window)
    scores = jnp.where(valid[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)  # (B,K,G,T,R)
    else:
        sink = sinks.reshape(B, T, K, H // K).transpose(0, 2, 3, 1)[..., None]  # (B,K,G,T,1)
        top = jnp.maximum(scores.max(axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))
    o = jnp.einsum("bkgts,bske->btkge", probs, cv)
    return o.reshape(B, T, H, E).astype(q.dtype)


def attention_mask(step: Step, tokens: int, size: int, window: int | None) -> jax.Array:
    """(B, T, R) bool: whether each of a step's ``tokens`` new queries sees each index of a
    cache of ``size`` (a ring or not: ``ring_positions``; ``visible``)."""
    slot = ring_positions(jnp.arange(size), size, step.write_index + tokens)[None, None, :]
    query_slot = step.write_index + jnp.arange(tokens)[None, :, None]  # (1,T,1)
    return visible(slot, query_slot, step.kv_start[:, None, None], window)


def ring_positions(index, size: int, end):
    """The slot held at cache index ``index`` (array or int, numpy or JAX) of a ring of ``size``
    indices once slots ``0 .. end - 1`` are written (slot s at index s mod size): the last
    such slot, ``index + size * floor((end - 1 - index) / size)``; negative where none was
    written (masked: below every ``kv_start``). A cache of at least ``end`` slots is the
    identity on its written part."""
    return index + size * ((end - 1 - index) // size)


def visible(slot, query_slot, kv_start, window: int | None):
    """Whether a query at ``query_slot`` sees the key at ``slot`` (broadcasting arrays, numpy
    or JAX): at or after its row's ``kv_start``, not after the query (causal), and where
    ``window`` is set within the last ``window`` slots (key > query - window: Mistral's
    sliding window, as transformers masks it)."""
    seen = (slot >= kv_start) & (slot <= query_slot)
    return seen if window is None else seen & (slot > query_slot - window)


def kv_parts(k: jax.Array, v: jax.Array, fmt: Format | None, dtype) -> Cache:
    """Keys and values k, v (B,T,K,E) as a cache holds them: {"k", "v"} in ``dtype``, or
    quantized into ``fmt``'s codes, scales and offsets (``quantize_kv``)."""
    if fmt is None:
        return {"k": k.astype(dtype), "v": v.astype(dtype)}
    return {kv_key(name, p): a for name, x in zip(KV_NAMES, (k, v))
            for p, a in quantize_kv(x, fmt).items()}


def append_kv(cache: Cache, k: jax.Array, v: jax.Array, write_index: jax.Array,
              fmt: Format | None = None, ring: bool = False) -> Cache:
    """Write k, v (B,T,K,E) into cache slots ``write_index .. write_index+T-1``: as they are
    (in the cache's dtype), or quantized into ``fmt`` (``quantize_kv``: only the new
    positions; the slots before are never touched). ``ring``: the cache may be a ring
    (a sliding-window layer's, ``models.tensors.held_slots``): slot s at index s mod R."""
    return {**cache, **{key: write_slots(cache[key], a, write_index, ring)
                        for key, a in kv_parts(k, v, fmt, cache["k"].dtype).items()}}


def write_slots(a: jax.Array, new: jax.Array, write_index: jax.Array, ring: bool) -> jax.Array:
    """``a`` (B, R, ...) with ``new`` (B, T, ...) written at slots ``write_index ..
    write_index+T-1`` (T <= R), as ``new`` stands or cast to ``a``'s dtype; ``ring``: at
    indices modulo R (``ring_positions``)."""
    new = new.astype(a.dtype)
    if not ring:
        return jax.lax.dynamic_update_slice(a, new, (0, write_index) + (0,) * (a.ndim - 2))
    return a.at[:, (write_index + jnp.arange(new.shape[1])) % a.shape[1]].set(
        new, unique_indices=True)


def read_slots(a: jax.Array, write_index: jax.Array, tokens: int, ring: bool) -> jax.Array:
    """The ``tokens`` slots of ``a`` (B, R, ...) from ``write_index`` (``write_slots``'
    inverse)."""
    if not ring:
        return jax.lax.dynamic_slice_in_dim(a, write_index, tokens, 1)
    return jnp.take(a, (write_index + jnp.arange(tokens)) % a.shape[1], axis=1)


class ScoreOp(nn.Module):
    """SCORE: append k, v to the layer's KV cache, attend q over it -> o (B,T,H,E).

    ``attend`` is the attention kernel, ``attend(q, cache, step, fmt, window)``:
    ``attention`` by default; the executor passes a host kernel (``host_compute``) when SCORE
    runs on the host; ``window`` is ``spec.sliding_window``. With a compressed
    ``spec.kv_format`` the new k, v are quantized as they are appended and the kernel
    decompresses what it reads, so attention computes on exactly the decoded values, the new
    token's own included.
    """

    spec: ModelSpec
    attend: Callable[..., jax.Array] = attention

    def __call__(self, q, k, v, step: Step, cache: Cache) -> tuple[tuple[jax.Array], Cache]:
        fmt, window = kv_format(self.spec), self.spec.sliding_window
        cache = append_kv(cache, k, v, step.write_index, fmt, ring=window is not None)
        return (self.attend(q, cache, step, fmt, window),), cache




HEAD_CHUNK_ELEMENTS = 1 << 22  # a compressed LM head decompresses this many weights at a time


def _compressed_logits(n: jax.Array, table: GroupMatrix, dtype) -> jax.Array:
    """Logits (B, V) float32 of normed ``n`` (B, D) against a compressed (V, D) ``table``, in
    chunks of ``HEAD_CHUNK_ELEMENTS`` weights: each chunk is decompressed after the previous
    chunk's logits exist (``product``'s ``after``), so one chunk is held at a time, not the
    whole table (SmolLM2's in float32: 113 MB), decompressed into ``dtype``."""
    vocab, D = table.shape
    rows = max(8, HEAD_CHUNK_ELEMENTS // D // 8 * 8)  # whole groups of a repacked table's rows
    parts, after = [], n
    for start in range(0, vocab, rows):
        chunk = row_slice(table, start, start + rows)
        after = product(chunk, n, dtype, after=after)
        parts.append(after)
    return jnp.concatenate(parts, axis=-1)


def lookup(module: nn.Module, name: str, ids: jax.Array, rows: int, fmt: str) -> jax.Array:
    """Rows ``ids`` (any shape, int32) of op module ``module``'s table ``name`` (``rows``, D),
    held in ``fmt``, as (*ids.shape, D) in the model's dtype: a compressed table decompresses
    only the rows looked up."""
    s = module.spec
    table = matrix(module, name, (rows, s.d_model), fmt, held_dtype(module),
                   nn.initializers.normal(0.02))
    if isinstance(table, GroupMatrix):
        return table.map(lambda a: jnp.take(a, ids, axis=0)).decompress(s.dtype)
    if isinstance(table, GGUFBlocks):  # rows of blocks, flattened to (rows, row bytes)
        picked = table.map(lambda a: jnp.take(a, ids.reshape(-1), axis=0))
        return picked.decompress(s.dtype).reshape(*ids.shape, s.d_model)
    return jnp.take(table, ids, axis=0).astype(s.dtype)


def lm_head(module: nn.Module, n: jax.Array) -> jax.Array:
    """Logits (B, V) float32 of the normed last positions ``n`` (B, D) against op module
    ``module``'s table ``embedding`` (V, D) (EMBED's when tied), in the model's embedding
    format: a compressed table in chunks (``_compressed_logits``; one row decompressed into
    float32 where the op's products ask it: ``Products.head_vector_f32``), or, in GGUF's
    blocks, multiplied as they are where the op's products take them
    (``Products.takes_blocks``)."""
    s = module.spec
    table = matrix(module, TABLE, (s.vocab_size, s.d_model), s.embedding_format,
                   held_dtype(module), nn.initializers.normal(0.02))
    if isinstance(table, GGUFBlocks) and module.products.takes_blocks(table, n.shape[0]):
        return product(table, n, products=module.products)
    if isinstance(table, (GroupMatrix, GGUFBlocks)):
        wide = module.products.head_vector_f32 and n.shape[0] == 1
        return _compressed_logits(n, table, jnp.float32 if wide else held_dtype(module))
    return product(table, n)
