"""bfloat16 and float16 models: numerics against float64 numpy, where each weight is held and in
which dtype, byte counts equal to the arrays' own, the accountant's peak equal to the estimate,
loaders in a dtype, and the default dtype by platform. (SmolLM2 against Hugging Face bfloat16:
``test_reference_hf.py``.)"""

import jax
import numpy as np
import pytest

from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.executor import Executor, tree_bytes
from hx.memory import estimate
from hx.models.layers import Step
from hx.models.loader import Model, default_dtype, load, load_spec, resolve_dtype
from hx.models.spec import ModelSpec, host_dtype, numpy_dtype
from hx.models.tensors import activation_bytes, activation_shape, kv_bytes, weight_dtype
from hx.planner import policies
from hx.workload import Workload

from numpy_reference import logits_np
from plans import acceptance_plans

PLANS = acceptance_plans(3, splits=(1, 2, 4))


def in_dtype(model: Model, dtype: str) -> Model:
    """``model`` with its weights rounded to ``dtype`` (a tied table stays one array)."""
    params = jax.tree.map(lambda a: np.asarray(a).astype(numpy_dtype(dtype)), model.params)
    if model.spec.tie_embeddings:
        params["HEAD"]["embedding"] = params["EMBED"]["embedding"]
    return Model(model.spec.replace(dtype=dtype), params, model.tokenizer, f"tiny {dtype}")


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model):
    return in_dtype(tiny_model, "bfloat16")


def teacher_forced(executor: Executor, tokens: np.ndarray) -> np.ndarray:
    """Logits (B, T, V) of every position of ``tokens`` (B, T), one decode step per token."""
    B, T = tokens.shape
    caches = executor.new_cache(B, -(-T // 32) * 32)
    out = []
    for t in range(T):
        step = Step(np.full((B, 1), t, np.int32), np.int32(t), np.zeros(B, np.int32))
        logits, caches = executor.run("decode", tokens[:, t:t + 1], step, caches)
        out.append(np.asarray(logits))
    executor.release_cache()
    return np.stack(out, 1)


def test_spec_follows_its_dtype():
    spec = ModelSpec(name="s", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     d_ff=96, vocab_size=1000, context_length=64)
    half = spec.replace(dtype="bfloat16")
    assert (spec.dtype, spec.dtype_bytes, half.dtype_bytes) == ("float32", 4, 2)
    assert 2 * half.weight_bytes == spec.weight_bytes
    assert 2 * kv_bytes(half, 3, 5) == kv_bytes(spec, 3, 5) == 2 * 3 * 5 * 2 * 16 * 4
    # host ops hold a bfloat16 model's weights as they are, a float16 model's in float32
    assert half.op_weight_bytes("MLP1", host_dtype(half.dtype)) == half.op_weight_bytes("MLP1")
    assert half.op_weight_bytes("MLP1", host_dtype("float16")) == spec.op_weight_bytes("MLP1")
    assert activation_bytes(half, "x", 2, 3) == 2 * 3 * 64 * 2
    assert activation_bytes(half, "logits", 2, 3) == 2 * 1000 * 4  # logits stay float32
    with pytest.raises(ValueError, match="float8"):
        spec.replace(dtype="float8")


TOLERANCE = {"bfloat16": 3e-2, "float16": 3e-3}


@pytest.mark.parametrize("dtype, plan_name", [
    ("bfloat16", "all-accelerator"), ("bfloat16", "all-host"), ("bfloat16", "stream-all"),
    ("bfloat16", "alternating"), ("float16", "all-accelerator"), ("float16", "all-host")])
def test_forward_matches_float64_reference(tiny_model, dtype, plan_name, devices):
    """Every position's logits against float64 numpy over the same (rounded) weights: within
    the dtype's rounding of activations (bf16 keeps 8 significant bits, f16 11; measured
    1.2e-2 and 8.9e-4 of the largest logit), on the accelerator and on the host alike. (The
    top tokens are not compared: this random model's logits have near ties, which an H100's
    bf16 products ordered otherwise; the bound already implies every clear winner.)"""
    model = in_dtype(tiny_model, dtype)
    tokens = np.random.default_rng(0).integers(0, 1000, (1, 12)).astype(np.int32)
    ref = logits_np(model.spec, model.params, tokens[0])
    got = teacher_forced(Executor(model.spec, model.params, PLANS[plan_name], devices), tokens)
    assert got.dtype == np.float32
    assert np.abs(got[0] - ref).max() <= TOLERANCE[dtype] * np.abs(ref).max()


def test_weights_caches_and_activations_in_their_dtypes(tiny_bf16, devices):
    """Weights, KV caches and activations are bfloat16 and exactly the spec's bytes, on both
    devices: host segments hold no float32 copies (``spec.host_dtype``), and a host-homed
    weight staged into an accelerator segment is bfloat16 too (the alternating plan's prefill
    stages decode's host weights)."""
    spec, plan = tiny_bf16.spec, PLANS["alternating"]
    ex = Executor(spec, tiny_bf16.params, plan, devices)
    seen = set()
    for phase in ("prefill", "decode"):
        for seg, params in zip(ex.segments[phase], ex._params[phase]):
            held = weight_dtype(spec, seg.device)
            assert held == "bfloat16"
            for (layer, op), tree in zip(seg.ops, params):
                assert {leaf.dtype for leaf in jax.tree.leaves(tree)} <= {np.dtype(
                    numpy_dtype(held))}
                assert tree_bytes(tree) == spec.op_weight_bytes(op, held), (phase, layer, op)
                seen.add((seg.device, plan.weights.get(layer, op)))
    assert {(ACCELERATOR, "host"), (HOST, "host"), (ACCELERATOR, "resident")} <= seen
    B, S = 2, 32
    caches = ex.new_cache(B, S)
    for cache in caches:
        assert cache["k"].dtype == numpy_dtype("bfloat16")
        assert tree_bytes(cache) == kv_bytes(spec, B, S)
    tokens = np.zeros((B, 4), np.int32)
    step = Step(np.tile(np.arange(4, dtype=np.int32), (B, 1)), np.int32(0), np.zeros(B, np.int32))
    logits, _ = ex.run("prefill", tokens, step, caches)
    assert logits.dtype == np.float32
    ex.release_cache()
    for name in ("x", "q", "k", "a", "logits"):
        shape, dtype = activation_shape(spec, name, B, 4)
        assert np.prod(shape) * np.dtype(numpy_dtype(dtype)).itemsize == activation_bytes(spec, name, B, 4)


@pytest.mark.parametrize("name", ["all-accelerator", "stream-all", "kv-host-odd", "alternating",
                                  "host:SCORE,MLP1"])
def test_accelerator_peak_equals_the_estimate_in_bfloat16(tiny_bf16, name):
    """As in float32 (``test_schedule``): the peak of a real run is the dry run's, exactly.
    The budget also covers the executor's own check at batch 1, one token."""
    from test_executor import B, S, T, run_plan

    plan, spec = PLANS[name], tiny_bf16.spec
    need = estimate(plan, spec, Workload(B, T, S)).accelerator
    budget = max(need, estimate(plan, spec, Workload(1, 1, 1)).accelerator)
    ex, out = run_plan(tiny_bf16, plan, discover(accelerator_memory=budget))
    assert ex.accountant.peak == need > 0
    assert all(logits.dtype == np.float32 for logits in out)


def test_gguf_is_dequantized_to_the_dtype(tmp_path, tiny_model, smollm_metadata):
    from gguf_files import write_gguf

    from hx.models.gguf_loader import load_gguf

    path = str(tmp_path / "tiny.gguf")
    meta = {**smollm_metadata, "tokenizer.ggml.merges": []}  # a short vocabulary reads fast
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        meta[key] = meta[key][:256]
    write_gguf(path, tiny_model.spec.replace(n_layers=2), tiny_model.params, meta)
    full = load_gguf(path, "float32")
    for dtype in ("bfloat16", "float16"):
        model = load_gguf(path, dtype)
        assert model.spec == full.spec.replace(dtype=dtype)
        for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(full.params)):
            assert a.dtype == numpy_dtype(dtype)
            np.testing.assert_array_equal(a, b.astype(numpy_dtype(dtype)))  # rounded once
        assert model.params["HEAD"]["embedding"] is model.params["EMBED"]["embedding"]
    assert load_spec(path, dtype="bfloat16") == full.spec.replace(dtype="bfloat16")


def test_bfloat16_safetensors_stay_bfloat16(tmp_path, tokenizer):
    from hx.models.mapped import is_mapped

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    model = load(str(tmp_path), dtype="bfloat16")
    down = hf.model.layers[0].mlp.down_proj.weight.detach().float().numpy()  # (out, in)
    kernel = model.params["layer_0"]["MLP2"]["w_down"]["kernel"]
    assert kernel.dtype == numpy_dtype("bfloat16")
    assert is_mapped(kernel)  # the file's own bytes: no copy
    np.testing.assert_array_equal(kernel.astype(np.float32), down)  # bit for bit
    wide = load(str(tmp_path), dtype="float32")
    assert wide.params["layer_0"]["MLP2"]["w_down"]["kernel"].dtype == np.float32
    assert wide.spec.weight_bytes == 2 * model.spec.weight_bytes


def test_random_presets_in_a_dtype():
    full, half = load("smollm2-135m:1L", dtype="float32"), load("smollm2-135m:1L",
                                                                dtype="bfloat16")
    assert half.spec == full.spec.replace(dtype="bfloat16")
    assert half.params["HEAD"]["embedding"] is half.params["EMBED"]["embedding"]
    for a, b in zip(jax.tree.leaves(half.params), jax.tree.leaves(full.params)):
        np.testing.assert_array_equal(a, b.astype(numpy_dtype("bfloat16")))
    assert tree_bytes(half.params) - tree_bytes(half.params["HEAD"]["embedding"]) == (
        half.spec.weight_bytes)
    assert load_spec("llama2-7b:2L", dtype="float16").weight_bytes * 2 == (
        load_spec("llama2-7b:2L", dtype="float32").weight_bytes)


def test_default_dtype_by_platform(devices):
    want = "float32" if devices.accelerator.device.platform == "cpu" else "bfloat16"
    assert default_dtype(devices) == default_dtype() == resolve_dtype("auto") == want
    assert resolve_dtype("float16") == "float16"
    with pytest.raises(HxError, match="bfloat16"):
        resolve_dtype("bf16")


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_bfloat16_product_holds_no_float32_copy_of_its_matrix(devices, rows):
    """``models.compressed.product`` of ``rows`` rows against a bf16 (512, 256) matrix on the host device:
    its XLA temporaries stay below the matrix's float32 size (a one-row product is padded to
    two: XLA:CPU's matrix-vector path widened the matrix to float32), and its result equals a
    float64 product of the same rounded operands to float32 accumulation."""
    from hx.models.compressed import product

    rng = np.random.default_rng(rows)
    bf16 = numpy_dtype("bfloat16")
    x = rng.standard_normal((rows, 256)).astype(bf16)
    w = rng.standard_normal((512, 256)).astype(bf16)
    host = devices[HOST]
    compiled = jax.jit(lambda x, w: product(w, x)).lower(jax.device_put(x, host),
                                                         jax.device_put(w, host)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < w.size * 4
    got = np.asarray(compiled(jax.device_put(x, host), jax.device_put(w, host)))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (rows, 512) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_stream_all_halves_its_staging_in_bfloat16(tiny_model, tiny_bf16):
    plan, work = policies.stream_all(3), Workload(2, 8, 32)
    full, half = (estimate(plan, m.spec, work) for m in (tiny_model, tiny_bf16))
    assert half.staging * 2 == full.staging > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["stream-all", "alternating", "host:SCORE,MLP1", "all-host"])
def test_host_estimate_counts_the_buffers_the_executor_holds(tiny_model, devices, name, dtype):
    """Host-homed weights are held once in bfloat16, for host ops and accelerator segments
    alike; a float16 model's host ops hold float32 copies besides (``spec.host_dtype``). The
    estimate's host bytes, less its host KV caches, equal the distinct buffers the executor
    placed off accelerator memory."""
    model = in_dtype(tiny_model, dtype)
    plan, spec = PLANS[name], model.spec
    ex = Executor(spec, model.params, plan, devices)
    buffers = {id(leaf): leaf for phase in ex._params.values() for seg in phase
               for tree in seg for leaf in jax.tree.leaves(tree)}
    off_accelerator = sum(b.nbytes for b in buffers.values()
                          if b.sharding.memory_kind != "device"
                          or b.devices() != {devices[ACCELERATOR]})
    host_kv = kv_bytes(spec, 1, 1) * sum(home == HOST for home in plan.kv)  # B = S = 1
    assert estimate(plan, spec, Workload(1, 1, 1)).host - host_kv == off_accelerator
