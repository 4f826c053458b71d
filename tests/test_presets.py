"""Model presets, the NAME[:NL] syntax, random weights of real shapes, and the Q/K/V bias."""

import jax
import numpy as np
import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.models import random_weights
from hx.models.layers import Step
from hx.models.decoder import forward, init_params
from hx.models.loader import load, load_spec
from hx.models.spec import PRESETS, is_preset, preset
from hx.sampling import SamplingParams

from conftest import TINY
from numpy_reference import logits_np

# Published parameter counts (model cards / Hugging Face), for the presets' shapes.
PUBLISHED = {"smollm2-135m": 1.35e8, "llama2-7b": 6.74e9, "llama2-13b": 13.0e9,
             "llama2-70b": 69.0e9, "llama3-8b": 8.03e9, "llama3-70b": 70.6e9,
             "mistral-7b": 7.24e9, "qwen2.5-7b": 7.62e9, "opt-6.7b": 6.7e9, "opt-30b": 30e9,
             "opt-66b": 66e9, "opt-175b": 175e9, "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9,
             "qwen2.5-72b": 72.7e9, "qwen3-8b": 8.19e9, "qwen3-32b": 32.8e9,
             "phi3-mini": 3.82e9,
             # Gemma 3 technical report (arXiv:2503.19786), Table 1: embedding + non-embedding
             # parameters, the text decoder without the 417M vision encoder
             "gemma3-12b": 1.012e9 + 10.759e9, "gemma3-27b": 1.416e9 + 25.600e9,
             # Mixtures of Experts, every expert counted (their model cards' totals)
             "mixtral-8x7b": 46.7e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9,
             "qwen1.5-moe-a2.7b": 14.3e9, "olmoe-1b-7b": 6.92e9,
             # DeepSeek-V2 (arXiv:2405.04434) Appendix B: V2-Lite 15.7B; DeepSeek-V3 (arXiv:
             # 2412.19437) §1: 671B, without the 14B of its multi-token-prediction module
             "deepseek-v2-lite": 15.7e9, "deepseek-v3": 671e9,
             # gpt-oss model card (OpenAI, 2025-08-05), Table 1: total parameters
             "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9}


def test_every_preset_has_its_published_size():
    assert set(PRESETS) == set(PUBLISHED)
    for name, spec in PRESETS.items():
        params = spec.weight_bytes / spec.dtype_bytes
        assert params == pytest.approx(PUBLISHED[name], rel=0.02), name
        assert spec.dtype_bytes == 4  # float32, what hx holds


def test_layer_count_syntax():
    full = PRESETS["llama2-7b"]
    two = preset("llama2-7b:2L")
    assert two.n_layers == 2 and two.name == "Llama-2-7B (2 of 32 layers)"
    assert two.replace(n_layers=32, name=full.name) == full
    assert preset("llama2-7b") is full and preset("llama2-7b:32L") is full
    assert preset("Llama2-7B:2l") == two and preset("llama2-7b:2") == two
    assert load_spec("llama2-7b:8L").n_layers == 8
    assert load_spec("smollm2-135m") is PRESETS["smollm2-135m"]
    assert is_preset("qwen2.5-7b:3L") and not is_preset("model.gguf") and not is_preset(None)


@pytest.mark.parametrize("name,message", [
    ("llama5-7b", "unknown model preset 'llama5-7b'; presets: smollm2-135m, llama2-7b"),
    ("llama2-7b:0L", "1 to 32"), ("llama2-7b:33L", "Llama-2-7B has 32 layers"),
    ("llama2-7b:xL", "1 to 32"), ("llama2-7b:2.5L", "1 to 32"), ("llama2-7b:-1L", "1 to 32"),
    ("llama2-7b:", "1 to 32")])
def test_bad_names_are_errors(name, message):
    with pytest.raises(HxError, match=message.replace(".", r"\.")):
        preset(name)


def test_unknown_model_names_the_presets(tmp_path):
    for call in (load, load_spec):
        with pytest.raises(HxError, match="model file not found.*llama2-7b:8L"):
            call(str(tmp_path / "nope"))
        with pytest.raises(HxError, match="has 30 layers"):
            call("smollm2-135m:31L")


def shapes(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), tree)


@pytest.mark.parametrize("spec", [preset("smollm2-135m:2L"), preset("qwen2.5-7b:1L")],
                         ids=["tied", "untied-qkv-bias"])
def test_random_params_have_init_params_layout(spec, monkeypatch):
    """Tree and shapes of init_params (abstractly: nothing of a 7B size is built here)."""
    expected = jax.eval_shape(lambda: init_params(spec))
    drawn = {}
    monkeypatch.setattr(random_weights, "available_host_memory", lambda: None)
    # the arrays themselves are not needed for the layout: draw empty ones
    monkeypatch.setattr(random_weights, "_uniform",
                        lambda shape, seed, path, dtype=np.float32: drawn.setdefault(
                            path, np.empty(shape, dtype)))
    params = random_weights.random_params(spec)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    assert shapes(params) == shapes(expected)
    assert ("layer_0/Q/wq/bias" in drawn) == spec.model_family.qkv_bias
    total = sum(a.size for a in jax.tree.leaves(params)) - (
        spec.vocab_size * spec.d_model if spec.tie_embeddings else 0)
    assert total * 4 == spec.weight_bytes


def test_random_model_loads_small_preset():
    model = load("smollm2-135m:2L")
    p = model.params
    assert model.spec == preset("smollm2-135m:2L")
    assert "random weights" in model.source and "SmolLM2-135M (2 of 30 layers)" in model.source
    assert p["HEAD"]["embedding"] is p["EMBED"]["embedding"]
    assert all(type(a) is np.ndarray and a.dtype == np.float32 for a in jax.tree.leaves(p))
    np.testing.assert_array_equal(p["layer_1"]["MLP1"]["ffn_norm"]["scale"], 1.0)
    w = p["layer_1"]["MLP1"]["w_gate"]["kernel"]
    assert w.std() == pytest.approx(0.02, rel=0.01) and abs(w.mean()) < 1e-4
    assert not np.array_equal(w, p["layer_0"]["MLP1"]["w_gate"]["kernel"])
    # seeded per tensor: the same draw again, and a 1-layer cut is a prefix of it
    again = random_weights.random_params(preset("smollm2-135m:1L"))
    np.testing.assert_array_equal(again["layer_0"]["Q"]["wq"]["kernel"],
                                  p["layer_0"]["Q"]["wq"]["kernel"])
    np.testing.assert_array_equal(again["EMBED"]["embedding"], p["EMBED"]["embedding"])
    other = random_weights.random_params(preset("smollm2-135m:1L"), seed=1)
    assert not np.array_equal(other["EMBED"]["embedding"], p["EMBED"]["embedding"])


def test_random_model_runs_on_ids_and_refuses_text():
    model = load("smollm2-135m:1L")
    out = Engine(model).generate_ids([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert len(out[0].token_ids) == 2 and out[0].text == ""
    with pytest.raises(HxError, match="random weights and no tokenizer"):
        Engine(model).encode("hello")


def test_random_weights_beyond_host_memory_are_refused(monkeypatch):
    monkeypatch.setattr(random_weights, "available_host_memory", lambda: 2**30)
    with pytest.raises(HxError, match=r"need 25\.1 GiB .* fewer layers"):
        random_weights.random_params(PRESETS["llama2-7b"])


def test_default_name_is_the_real_file(smollm):
    assert smollm.source.endswith(".gguf") and smollm.spec.n_layers == 30


def test_qkv_bias_matches_float64_reference():
    """Q, K, V biases (Qwen2) are added before RoPE: forward equals the numpy reference."""
    spec = TINY.replace(family="qwen2", n_layers=2, tie_embeddings=False)
    assert spec.op_weight_shapes("Q")["wq/bias"] == (4, 16)
    assert spec.op_weight_shapes("K")["wk/bias"] == (2, 16)
    assert spec.op_weight_shapes("V")["wv/bias"] == (2, 16)
    rng = np.random.default_rng(0)

    def jitter(path, leaf):  # Flax starts biases at zero; make them matter
        leaf = np.asarray(leaf)
        if path[-1].key == "bias":
            return (0.5 * rng.standard_normal(leaf.shape)).astype(np.float32)
        return leaf

    params = jax.tree_util.tree_map_with_path(jitter, init_params(spec, seed=2))
    tokens = np.array([[5, 901, 17, 3000, 42, 7]], np.int32)
    T = tokens.shape[1]
    caches = [{name: np.zeros((1, T, 2, 16), np.float32) for name in ("k", "v")}
              for _ in range(spec.n_layers)]
    step = Step(np.arange(T, dtype=np.int32)[None], np.int32(0), np.zeros(1, np.int32))
    got, _ = jax.jit(forward, static_argnums=0)(spec, params, tokens, step, caches)
    ref = logits_np(spec, params, tokens[0])[-1]
    assert np.abs(np.asarray(got[0], np.float64) - ref).max() / np.abs(ref).max() < 1e-5
    unbiased = jax.tree_util.tree_map_with_path(
        lambda path, a: a * 0 if path[-1].key == "bias" else a, params)
    without = logits_np(spec, unbiased, tokens[0])[-1]
    assert np.abs(without - ref).max() > 1e-3 * np.abs(ref).max()  # the biases did matter


def test_opt_is_planned_and_run():
    """OPT's layer on the seven ops: one fc1 in MLP1 (half SwiGLU's FLOPs at the same F), MHA,
    biases, learned positions with the embedding; its random weights load and run."""
    from hx.planner.cost import op_cost

    opt = PRESETS["opt-30b"]
    D, F = opt.d_model, opt.d_ff
    assert opt.op_weight_bytes("MLP1") == (2 * D + D * F + F) * 4
    assert opt.op_weight_bytes("EMBED") == (opt.vocab_size + 2050) * D * 4
    assert op_cost(opt, "MLP1", 2, 3, 0).flops == 2 * 6 * D * F
    llama = opt.replace(family="llama")
    assert op_cost(llama, "MLP1", 2, 3, 0).flops == 4 * 6 * D * F
    model = load("opt-30b:1L", dtype="float32")
    assert model.spec.family == "opt" and "positions" in model.params["EMBED"]
