"""Decoder layers as one ggml graph (``host_compute.ggml_layer``) compute what the composition of
their seven ops computes (``models.decoder.decoder_layer``, XLA).

Over float32 matrices ggml's products do not round the activations, so the two agree to float32
rounding: for one layer and three in one graph, for each switch of the Llama layer (Qwen2's biases,
Qwen3's q/k norms, Llama 3.1's RoPE scaling, Mistral's window over a ring that wraps), through a
left-padded prefill chunk and decode steps, the layer's output and its KV cache. Over a GGUF's
blocks ggml rounds each activation row to 8 bits a block as llama.cpp does: the graph gives what the
composition with ggml's products gives, and differs from XLA's products of the decoded blocks by
that rounding alone. A model whose layer is not Llama's (Gemma 3) or whose run ggml cannot take
keeps its ops.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hx.host_compute import ggml_kernel, ggml_layer
from hx.host_compute.products import HOST_PRODUCTS
from hx.models.compressed import DEFAULT_PRODUCTS
from hx.models.decoder import decoder_layer, init_params
from hx.models.holding import relayout
from hx.models.loader import RELAYOUTS
from hx.models.spec import GGML, LAYER_OPS, ModelSpec, MoeShape
from hx.models.tensors import held_slots, kv_arrays, kv_bytes, layer_key

from steps import left_padded_steps

pytestmark = pytest.mark.skipif(ggml_kernel.unavailable() is not None,
                                reason=str(ggml_kernel.unavailable()))

SLOTS = 32
LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 16.0), ("rope_type", "llama3"))
SWITCHES = {"llama": {}, "llama-3-layers": {"n_layers": 3}, "qwen2": {"family": "qwen2"},
            "qwen3": {"family": "qwen3"},
            "llama3-scaling": {"rope_scaling": LLAMA3},
            "mistral-ring": {"family": "mistral", "sliding_window": 6}}


def tiny(**fields) -> ModelSpec:
    shapes = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 96}
    return ModelSpec(name="tiny", vocab_size=128, context_length=SLOTS,
                     **{"n_layers": 1, **shapes, **fields})


def layer_params(spec: ModelSpec, seed: int = 0) -> dict:
    """Random weights with every layer's norm scales and biases perturbed (random weights'
    are 1 and 0)."""
    params = init_params(spec, seed)
    rng = np.random.default_rng(seed)

    def perturb(path, a):
        names = [getattr(k, "key", "") for k in path]
        if names[-1] in ("scale", "bias") and "kernel" not in names:
            return a + 0.3 * rng.standard_normal(a.shape).astype(a.dtype)
        return a

    for i in range(spec.n_layers):
        params[layer_key(i)] = jax.tree_util.tree_map_with_path(perturb, params[layer_key(i)])
    return params


def run_both(spec, params, products=DEFAULT_PRODUCTS, decode_steps=20, prompt=5, slots=SLOTS):
    """The model's layers over a left-padded prefill then decode steps, both ways: per step
    (ggml's x, XLA's x, the mask of real queries), and both ways' final caches."""
    layers = [params[layer_key(i)] for i in range(spec.n_layers)]
    R = held_slots(spec, slots)
    dtype = kv_arrays(spec, 2, R)["k"][1]
    zeros = [{name: np.zeros((2, R, spec.n_kv_heads, spec.head_dim), dtype)
              for name in ("k", "v")} for _ in layers]
    ours, theirs = list(zeros), list(zeros)
    fused = jax.jit(lambda x, step, caches: ggml_layer.decoder_layers(
        spec, [[layer[op] for op in LAYER_OPS] for layer in layers], x, step, caches))

    @jax.jit
    def composed(x, step, caches):
        caches = list(caches)
        for i, layer in enumerate(layers):
            acts, caches[i] = decoder_layer(spec, layer, {"x": x}, step, caches[i], products)
            x = acts["x"]
        return x, caches

    rng = np.random.default_rng(1)
    out = []
    for step in left_padded_steps(prompt, decode_steps):
        T = step.positions.shape[1]
        x = rng.standard_normal((2, T, spec.d_model)).astype(np.float32)
        got, ours = fused(x, step, ours)
        want, theirs = composed(x, step, theirs)
        real = (int(step.write_index) + np.arange(T))[None, :] >= step.kv_start[:, None]
        out.append((np.asarray(got), np.asarray(want), real))
    return out, ours, theirs


@pytest.mark.parametrize("name", list(SWITCHES))
def test_the_graph_is_the_composition_over_float32_matrices(name):
    spec = tiny(**SWITCHES[name])
    assert spec.model_family.graph_layer(spec) is not None
    steps, ours, theirs = run_both(spec, layer_params(spec))
    for got, want, real in steps:
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[real], want[real], atol=2e-5 * scale, rtol=0)
    padding = np.arange(ours[0]["k"].shape[1])[None, :] < np.array([0, 2])[:, None]
    for mine, other in zip(ours, theirs):  # past layer 0 a padding query's x differs: its
        for key in ("k", "v"):             # slots (masked for every query) differ too
            np.testing.assert_allclose(mine[key][~padding], other[key][~padding],
                                       atol=2e-5 * np.abs(other[key]).max(), rtol=0)
    if spec.sliding_window:  # 25 slots written into a ring of 16
        assert ours[0]["k"].shape[1] == 16 < 5 + 20


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_over_gguf_blocks_the_graph_is_the_composition_with_ggml_products(fmt):
    spec = tiny(weight_format=fmt, host_matmul=GGML, head_dim=32, n_layers=2)  # wo's blocks: E
    part, convert = RELAYOUTS[GGML]
    params = relayout(spec, layer_params(spec), part, convert)
    steps, _, _ = run_both(spec, params, HOST_PRODUCTS, decode_steps=4)
    for got, want, real in steps:  # the same products over the same rounded activations
        np.testing.assert_allclose(got[real], want[real], atol=1e-5 * np.abs(want).max(),
                                   rtol=0)
    steps, _, _ = run_both(spec, params, DEFAULT_PRODUCTS, decode_steps=4)
    for got, want, real in steps:  # XLA's products of the decoded blocks: no 8-bit rounding
        error = np.abs(got[real] - want[real]).max() / np.abs(want).max()
        assert 1e-4 < error < 3e-2
    if params["layer_0"]["Q"]["wq"]["kernel"].repacked:  # a 2 x 40-row prefill in the graph
        assert ggml_layer.runs(spec, [params["layer_0"][op] for op in LAYER_OPS], 80,
                               {"k": 0, "v": 0})
        steps, _, _ = run_both(spec, params, HOST_PRODUCTS, decode_steps=2, prompt=40,
                               slots=64)
        for got, want, real in steps:  # the same products; the activations differ by float32
            scale = np.abs(want).max()  # rounding (ggml's fused norm), which a centred q4_1's
            off = np.abs(got - want).max(-1) > 1e-5 * scale  # float32 block sums carry into
            assert (off & real).sum() <= real.sum() // 2  # k and v, where it can move a float16
            assert np.abs(got[real] - want[real]).max() <= 1e-2 * scale  # rounding: the rows
            # that attend to it differ (one run: rows 33-39 of 40, 3e-3; then 1 decode row of 2)


@pytest.mark.parametrize("family,norm_top_k,shared", [
    ("qwen3_moe", True, 0), ("qwen3_moe", False, 0), ("olmoe", False, 0), ("qwen2_moe", False, 96)])
def test_an_moe_layer_over_gguf_blocks_is_the_composition_with_ggml_experts(family, norm_top_k,
                                                                              shared):
    """Qwen3-MoE's layer (q/k norms per head), OLMoE's (over the whole projection) and
    Qwen2-MoE's (q/k/v biases, a shared expert behind a sigmoid gate), 4 experts, the top 2:
    the graph's router (softmax, top k, renormalised or not), experts by ``mul_mat_id`` and
    shared expert give what the ops give with the host's products -- XLA's router, the same
    experts through ggml_moe.cc -- to float32 rounding."""
    spec = tiny(family=family, moe=MoeShape(4, 2, 64, d_shared=shared, norm_top_k=norm_top_k),
                weight_format="q4_0", host_matmul=GGML, head_dim=32, n_layers=2)
    assert spec.model_family.graph_layer(spec) is not None
    part, convert = RELAYOUTS[GGML]
    params = relayout(spec, layer_params(spec), part, convert)
    assert ggml_layer.runs(spec, [params["layer_0"][op] for op in LAYER_OPS], 1,
                           {"k": 0, "v": 0})
    steps, _, _ = run_both(spec, params, HOST_PRODUCTS, decode_steps=4)
    for got, want, real in steps:
        np.testing.assert_allclose(got[real], want[real], atol=1e-5 * np.abs(want).max(),
                                   rtol=0)


def test_in_bfloat16_the_graph_keeps_float32_inside_and_a_bfloat16_cache():
    """A bfloat16 model: the graph takes and gives bfloat16 x and writes a bfloat16 cache,
    computing in float32 between (the composition rounds every op's output to bfloat16: the
    two differ by that rounding)."""
    spec = tiny(weight_format="q8_0", host_matmul=GGML, head_dim=32, dtype="bfloat16")
    part, convert = RELAYOUTS[GGML]
    layer = relayout(spec, layer_params(spec), part, convert)["layer_0"]
    ops = [layer[op] for op in LAYER_OPS]
    R = held_slots(spec, SLOTS)
    cache = {n: jnp.zeros((2, R, 2, 32), jnp.bfloat16) for n in ("k", "v")}
    assert ggml_layer.runs(spec, ops, 10, cache)
    step = next(left_padded_steps(5, 0))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 64)), jnp.bfloat16)
    got, (ours,) = jax.jit(lambda x, c: ggml_layer.decoder_layers(spec, [ops], x, step, [c]))(
        x, cache)
    want, theirs = jax.jit(lambda x, c: decoder_layer(spec, layer, {"x": x}, step, c,
                                                      HOST_PRODUCTS))(x, cache)
    assert got.dtype == jnp.bfloat16 and ours["k"].dtype == jnp.bfloat16
    real = np.array([[True] * 5, [False, False, True, True, True]])
    got, want = np.asarray(got, np.float32)[real], np.asarray(want["x"], np.float32)[real]
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    k_ours, k_theirs = (np.asarray(c["k"], np.float32) for c in (ours, theirs))
    assert np.abs(k_ours - k_theirs).max() <= 3e-2 * np.abs(k_theirs).max()


def test_a_float16_cache_is_written_and_read_as_the_composition_does():
    """``kv_format`` float16 (llama.cpp's cache): the graph writes the new keys and values
    rounded to float16 as the composition does, and attends over them as llama.cpp does --
    q rounded to float16 for its dots with K, V summed in float16 -- within that rounding of
    XLA's float32 attention over the same cache; the cache is half the bytes."""
    spec = tiny(kv_format="float16")
    assert kv_arrays(spec, 2, SLOTS)["k"] == ((2, SLOTS, 2, 16), "float16")
    assert kv_bytes(spec, 2, SLOTS) * 2 == kv_bytes(tiny(), 2, SLOTS)
    steps, ours, theirs = run_both(spec, layer_params(spec), decode_steps=6)
    assert ours[0]["k"].dtype == np.float16
    for got, want, real in steps:
        np.testing.assert_allclose(got[real], want[real], atol=2e-3 * np.abs(want).max(), rtol=0)
    for key in ("k", "v"):  # one float16 rounding of float32 values equal to 2e-5
        np.testing.assert_allclose(ours[0][key].astype(np.float32),
                                   theirs[0][key].astype(np.float32),
                                   atol=1e-3 * np.abs(theirs[0][key]).max(), rtol=0)


def test_runs_takes_llama_layers_in_float32_with_ggml_and_short_steps():
    spec = tiny(weight_format="q4_0", host_matmul=GGML, head_dim=32)
    part, convert = RELAYOUTS[GGML]
    layer = relayout(spec, init_params(spec), part, convert)["layer_0"]
    ops = [layer[op] for op in LAYER_OPS]
    cache = {"k": np.zeros((1, 8, 2, 32), np.float32), "v": np.zeros((1, 8, 2, 32), np.float32)}
    most = 512 if layer["Q"]["wq"]["kernel"].repacked else 64  # ggml_kernel.KERNEL_ROWS
    assert ggml_layer.runs(spec, ops, most, cache)
    assert not ggml_layer.runs(spec, ops, most + 1, cache)  # a longer prefill chunk
    assert not ggml_layer.runs(dataclasses.replace(spec, host_matmul="xla"), ops, 1, cache)
    int8 = {"k": cache["k"].astype(np.uint8), "k_scale": cache["k"], "v": cache["v"]}
    assert not ggml_layer.runs(spec, ops, 1, int8)
    gemma = ModelSpec(name="g", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      d_ff=96, vocab_size=128, context_length=SLOTS, family="gemma3")
    assert gemma.model_family.graph_layer(gemma) is None
