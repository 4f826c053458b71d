"""Shared fixtures: a tiny random Llama (fast), the real SmolLM2 and its HF reference (slow)."""

from __future__ import annotations

from hx.devices import configure_runtime

configure_runtime()  # before any JAX computation: two CPU devices (the emulated accelerator)

import pytest  # noqa: E402

import hx  # noqa: E402
from hx.devices import discover  # noqa: E402
from hx.models.gguf_loader import open_gguf, read_metadata  # noqa: E402
from hx.models.decoder import init_params  # noqa: E402
from hx.models.loader import Model, default_model_path  # noqa: E402
from hx.models.spec import ModelSpec  # noqa: E402
from hx.models.tokenizer import Tokenizer  # noqa: E402

# GQA (4 query heads over 2 KV heads), tied embeddings, SmolLM2's vocabulary so the real
# tokenizer serves it.
TINY = ModelSpec(name="tiny", n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 d_ff=96, vocab_size=49152, context_length=256, rope_theta=10000.0,
                 norm_eps=1e-5, tie_embeddings=True)


@pytest.fixture(scope="session")
def devices():
    return discover()


@pytest.fixture(scope="session")
def smollm_metadata():
    return read_metadata(open_gguf(default_model_path()))


@pytest.fixture(scope="session")
def tokenizer(smollm_metadata):
    return Tokenizer.from_gguf_metadata(smollm_metadata, "SmolLM2")


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 3-layer random model with SmolLM2's tokenizer (numpy float32 weights)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(1)
    params = jax.tree.map(np.asarray, init_params(TINY, seed=1))

    def jitter(path, leaf):  # norm scales away from 1, so a misplaced norm weight shows
        if path[-1].key == "scale":
            return (leaf + 0.2 * rng.standard_normal(leaf.shape)).astype(np.float32)
        return leaf

    params = jax.tree_util.tree_map_with_path(jitter, params)
    params["HEAD"]["embedding"] = params["EMBED"]["embedding"]  # stay tied
    return Model(TINY, params, tokenizer, "tiny")


@pytest.fixture(scope="session")
def smollm():
    """The default model as ``hx.load()`` gives it: its GGUF's Q4_1/Q8_0 blocks, float32 (the
    blocks as the file holds them, ggml's layout: ``host_matmul`` auto)."""
    return hx.load()


@pytest.fixture(scope="session")
def smollm_dense():
    """The default model with its matrices expanded to float32 (``weights="dense"``): 538 MB,
    the bytes the budget tests' quarters are of."""
    return hx.load(dtype="float32", weights="dense")



@pytest.fixture(scope="session")
def hf_smollm():
    """Hugging Face transformers loading the same GGUF, float32 on CPU torch: the reference."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    import os

    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def force_numpy_attention(monkeypatch) -> None:
    """Make every host segment holding SCORE attend in numpy (``SplitHostProgram``), whatever
    its cache size, with segment programs compiled afresh for the test."""
    from hx import programs
    from hx.host_compute import attention

    monkeypatch.setattr(attention, "NUMPY_MIN_BYTES", 0)
    monkeypatch.setattr(programs, "_PROGRAMS", {})
