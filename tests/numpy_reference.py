"""A float64 numpy Llama forward pass, written independently of hx's JAX code, for tests."""

from __future__ import annotations

import numpy as np

from hx.models.compressed import GroupMatrix, Int4Packed
from hx.models.formats import dequantize, get_format
from hx.models.tensors import layer_key


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
    # x: (T, N, E); rotate-half RoPE
    E = x.shape[-1]
    inv = theta ** (-np.arange(0, E, 2, dtype=np.float64) / E)
    ang = positions[:, None] * inv  # (T, E/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :E // 2], x[..., E // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _torch_int4(tree, shape) -> np.ndarray:
    """The matrix of logical ``shape`` a (``packed`` (N, K/2) uint8, ``sz`` (K/g, N, 2))
    pair holds in torch's int4pack layout: of each block of B output rows (B probed from torch
    by ``int4_kernel.row_block``), for each input k, byte j holds row j's code in its low nibble
    and row j + B/2's in its high one; W = (code - 8) * scale + zero per group of g inputs."""
    from hx.host_compute.int4_kernel import row_block

    packed, sz = np.asarray(tree.packed), np.asarray(tree.sz, np.float64)
    n, k, block = packed.shape[0], 2 * packed.shape[1], row_block()
    codes = np.zeros((n, k))
    for b in range(n // block):
        for j in range(block // 2):
            byte = packed[b * block:(b + 1) * block].reshape(k, block // 2)[:, j]
            codes[b * block + j] = byte & 15
            codes[b * block + j + block // 2] = byte >> 4
    g = k // sz.shape[0]
    scale, zero = (np.repeat(sz[..., i].T, g, axis=1) for i in (0, 1))  # (N, K)
    return ((codes - 8) * scale + zero).reshape(shape)


def dense_params(spec, params) -> dict:
    """``params`` with every compressed matrix (a ``GroupMatrix``, or an ``Int4Packed`` in
    torch's int4 layout) decompressed (``models.formats.dequantize``: the values the programs compute
    on)."""
    def walk(tree, path):
        if isinstance(tree, Int4Packed):  # torch's int4 layout (``host_matmul`` torch-int4)
            top, name = path[1], "/".join(path[2:])
            return _torch_int4(tree, spec.op_weight_shapes(top)[name])
        if isinstance(tree, GroupMatrix):
            top = path[0] if path[0] in ("EMBED", "HEAD") else path[1]
            name = "/".join(path[path.index(top) + 1:])
            assert tree.fmt == get_format(spec.matrix_format(name))
            return dequantize(tree.parts(), tree.fmt, spec.op_weight_shapes(top)[name])
        if not isinstance(tree, dict):
            return tree
        return {k: walk(v, path + (k,)) for k, v in tree.items()}

    return walk(params, ())


def logits_np(spec, params, tokens, cache=None, computed=None) -> np.ndarray:
    """Logits (T, V) float64 of every position of one unpadded sequence ``tokens``.

    ``cache``: per layer (k, v), each (T, K, E), that attention reads instead of the k and v
    the layer computes (a compressed KV cache's decoded values); ``computed``: a list that
    receives each layer's own float64 (k, v)."""
    p = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731

    params = dense_params(spec, params)

    def proj(h, dense):  # h (T, D) @ kernel (N, E, D)^T [+ bias (N, E)] -> (T, N, E)
        y = np.einsum("td,ned->tne", h, p(dense["kernel"]))
        return y + p(dense["bias"]) if "bias" in dense else y

    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = p(params["EMBED"]["embedding"])[np.asarray(tokens)]  # (T, D)
    G = spec.n_heads // spec.n_kv_heads
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(spec.n_layers):
        L = params[layer_key(i)]
        h = _rms(x, p(L["Q"]["attn_norm"]["scale"]), spec.norm_eps)
        q = _rope(proj(h, L["Q"]["wq"]), pos, spec.rope_theta)
        k = _rope(proj(h, L["K"]["wk"]), pos, spec.rope_theta)
        v = proj(h, L["V"]["wv"])
        if computed is not None:
            computed.append((k, v))
        if cache is not None:
            k, v = (p(a) for a in cache[i])
        o = np.zeros_like(q)
        for head in range(spec.n_heads):
            kv = head // G
            s = q[:, head] @ k[:, kv].T / np.sqrt(spec.head_dim)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            o[:, head] = (w / w.sum(axis=-1, keepdims=True)) @ v[:, kv]
        x = x + np.einsum("the,dhe->td", o, p(L["OUT"]["wo"]["kernel"]))
        n = _rms(x, p(L["MLP1"]["ffn_norm"]["scale"]), spec.norm_eps)
        g = n @ p(L["MLP1"]["w_gate"]["kernel"]).T
        a = g / (1 + np.exp(-g)) * (n @ p(L["MLP1"]["w_up"]["kernel"]).T)
        x = x + a @ p(L["MLP2"]["w_down"]["kernel"]).T
    n = _rms(x, p(params["HEAD"]["final_norm"]["scale"]), spec.norm_eps)
    return n @ p(params["HEAD"]["embedding"]).T
