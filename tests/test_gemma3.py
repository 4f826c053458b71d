"""Gemma 3's local and global layers (``ModelSpec.layer_types``) beyond tests/test_families.py:
every path a layer's type must reach -- the single-jit ``forward``, host attention in numpy,
streamed KV caches recomputing K and V, pipeline stages that cut the types -- against
transformers on the tiny checkpoint transformers wrote; the types in specs, presets and
compiled segments; what the family refuses."""

import dataclasses

import numpy as np
import pytest

import hx
from hx.devices import discover
from hx.errors import HxError
from hx.generate import Engine
from hx.models.decoder import apply_op, forward
from hx.models.layers import Step
from hx.models.safetensors_loader import spec_from_config
from hx.models.spec import PRESETS, preset
from hx.planner import policies
from hx.programs import Programs
from hx.sampling import SamplingParams
from hx.segments import split_segments

from conftest import force_numpy_attention
from hf_families import CONFIGS, PROMPTS, reference, write_checkpoint

LOCAL, GLOBAL = "sliding_attention", "full_attention"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(hx model, prompts as ids, transformers' last logits and greedy tokens)."""
    directory = str(tmp_path_factory.mktemp("gemma3"))
    ref_model = write_checkpoint("gemma3", directory)
    model = hx.load(directory, dtype="float32")
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    return model, prompts, reference(ref_model, prompts, NEW_TOKENS, model.tokenizer.eos_id)


def close(got, want):
    for row, ref in zip(got, want):
        assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4


def test_the_checkpoint_has_both_layer_types(gemma):
    """The config's types reach the spec, each with its window and RoPE; the window is
    shorter than the prompts; the model's own fields are the global layers'."""
    model, prompts, _ = gemma
    spec = model.spec
    assert spec.layer_types == tuple(CONFIGS["gemma3"][1]["layer_types"])
    local, full = spec.layer_spec(0), spec.layer_spec(1)
    assert (local.sliding_window, local.rope_theta, local.rope_scaling) == (6, 1e4, ())
    assert (full.sliding_window, full.rope_theta) == (None, 5e5)
    assert dict(full.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    assert local.layer_types == full.layer_types == ()
    assert spec.sliding_window is None and spec.rope_theta == 5e5
    assert min(map(len, prompts)) > local.sliding_window
    assert spec.attention_scale == pytest.approx(24 ** -0.5)


def test_forward_matches_transformers(gemma):
    """The single-jit reference (``models.decoder.forward``), each layer with its own spec."""
    import jax

    model, prompts, (ref_logits, _) = gemma
    spec, ids = model.spec, prompts[0]
    step = Step(np.arange(len(ids), dtype=np.int32)[None], np.int32(0), np.zeros(1, np.int32))
    caches = [{name: np.zeros((1, len(ids), spec.n_kv_heads, spec.head_dim), np.float32)
               for name in ("k", "v")} for _ in range(spec.n_layers)]
    logits, _ = jax.jit(forward, static_argnums=0)(spec, model.params,
                                                   np.array([ids], np.int32), step, caches)
    close(np.asarray(logits), ref_logits[:1])


def test_a_layer_op_needs_its_layers_spec(gemma):
    model, _, _ = gemma
    with pytest.raises(ValueError, match="layer_spec"):
        apply_op(model.spec, "K", {}, {}, None)


@pytest.mark.parametrize("case", ["numpy-attention", "kv-recompute", "pipeline",
                                  "tensor-parallel"])
def test_every_path_matches_transformers(gemma, case, monkeypatch):
    """Host attention in numpy between XLA pieces (each piece with its layer's window), the
    KV caches streamed in with positions [0, 5) recomputed by each layer's own K (its RoPE),
    3 pipeline stages (types [local, global], [local], [local]: the last two alike), and the
    heads split over 2 accelerators (the host's device standing in as the second, as in
    tests/test_pipeline.py: the post-norms whole on each)."""
    model, prompts, (ref_logits, ref_greedy) = gemma
    n = model.spec.n_layers
    devices = discover()
    if case == "numpy-attention":
        force_numpy_attention(monkeypatch)
        plan = policies.stream_all(n)
    elif case == "kv-recompute":
        plan = policies.kv_streamed(n, 5)
    elif case == "pipeline":
        plan, devices = policies.stream_all(n), [devices] * 3
    else:
        acc = devices.accelerator
        plan, devices = policies.all_accelerator(n), dataclasses.replace(
            devices, accelerator=dataclasses.replace(acc, group=(acc.device,
                                                                 devices.host.device)))
    engine = Engine(model, plan, devices)
    close(engine.last_logits(prompts), ref_logits)
    completions = engine.generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [c.token_ids for c in completions] == ref_greedy


def test_local_and_global_layers_compile_apart_and_like_layers_share(gemma):
    """Per op its layer's type joins the segment's key: one layer a segment, the local layers
    0, 2 and 3 share one executable, global layer 1 has its own."""
    model, _, _ = gemma
    programs = Programs(model.spec, discover())
    plan = policies.stream_all(model.spec.n_layers)  # one accelerator segment per layer
    segments = [s for s in split_segments(plan, "decode")
                if s.device == "accelerator" and s.ops[0][1] == "Q"]
    keys = [programs.signature(s) for s in segments]
    assert [programs.layer_types(s)[0] for s in segments] == [LOCAL, GLOBAL, LOCAL, LOCAL]
    assert keys[0] == keys[2] == keys[3] != keys[1]
    assert len({s.signature for s in segments}) == 1  # the plan alone cannot tell them apart


def test_stages_and_cut_presets_keep_their_layers_types():
    """A pipeline stage and ``NAME:NL`` cut ``layer_types`` with the layers; where what is
    left is of one type, its window and RoPE become the spec's own."""
    spec = PRESETS["gemma3-27b"]
    assert spec.layer_types[:6] == (LOCAL,) * 5 + (GLOBAL,) and len(spec.layer_types) == 62
    stage = spec.pipeline_stage(range(4, 8), False, False)
    assert stage.layer_types == (LOCAL, GLOBAL, LOCAL, LOCAL)
    assert stage.layer_spec(1) == spec.layer_spec(5).replace(name=stage.name, n_layers=4,
                                                             embeds=False, heads=False,
                                                             tie_embeddings=False)
    alike = spec.pipeline_stage(range(0, 5), True, False)
    assert alike.layer_types == () and alike.sliding_window == 1024
    assert alike.rope_theta == 1e4 and alike.rope_scaling == ()
    with pytest.raises(ValueError, match="range of layers"):
        spec.pipeline_stage(4, True, False)
    cut = preset("gemma3-12b:8L")
    assert cut.layer_types == (LOCAL,) * 5 + (GLOBAL,) + (LOCAL,) * 2
    two = preset("gemma3-12b:2L")
    assert two.layer_types == () and two.sliding_window == 1024 and two.rope_theta == 1e4
    full = PRESETS["gemma3-12b"].layer_spec(5)
    assert full.sliding_window is None and full.rope_theta == 1e6
    assert dict(full.rope_scaling) == {"rope_type": "linear", "factor": 8.0}


def test_presets_attention_scale():
    """27B's query_pre_attn_scalar is 168 (= 5376 / 32) beside a head dim of 128; 12B's is its
    head dim, 256."""
    assert PRESETS["gemma3-27b"].attention_scale == pytest.approx(168 ** -0.5)
    assert PRESETS["gemma3-12b"].attention_scale == pytest.approx(256 ** -0.5)


BASE = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 112,
        "num_hidden_layers": 6, "num_attention_heads": 4}


def test_a_hub_config_reads_as_transformers_fills_it():
    """A config of the Hub's shape (Gemma 3 12B's text part: legacy ``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``; no layer types):
    every 6th layer global, transformers' defaults elsewhere."""
    spec = spec_from_config({**BASE, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                             "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                             "sliding_window": 1024, "sliding_window_pattern": 6,
                             "query_pre_attn_scalar": 256, "head_dim": 256}, "/m")
    assert spec.layer_types == (LOCAL,) * 5 + (GLOBAL,)
    assert spec.layer_spec(0).sliding_window == 1024 and spec.layer_spec(0).rope_theta == 1e4
    assert spec.layer_spec(5).rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
    assert spec.tie_embeddings and spec.vocab_size == 262208 and spec.n_kv_heads == 4
    one_type = spec_from_config({**BASE, "layer_types": [GLOBAL] * 6}, "/m")
    assert one_type.layer_types == () and one_type.sliding_window is None


@pytest.mark.parametrize("field,value", [
    ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
    ("use_bidirectional_attention", True), ("hidden_activation", "gelu"),
    ("attention_bias", True), ("layer_types", ["chunked_attention"] * 6),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}),
    ("rope_parameters", {GLOBAL: {"rope_type": "yarn", "factor": 4.0}}),
    ("unheard_of_field", 1)])
def test_what_gemma3_does_not_implement_is_refused(field, value):
    """One line naming the field (or the RoPE type or layer type)."""
    word = {"rope_parameters": "yarn" if GLOBAL in str(value) else "rope_type",
            "layer_types": "chunked_attention"}.get(field, field)
    with pytest.raises(HxError, match=word) as refused:
        spec_from_config({**BASE, field: value}, "/m")
    assert "\n" not in str(refused.value)


def test_a_layer_type_may_change_only_window_and_rope():
    with pytest.raises(ValueError, match="may set only"):
        PRESETS["gemma3-12b"].replace(layer_overrides=(
            (LOCAL, (("d_ff", 1),)), (GLOBAL, ())))
    with pytest.raises(ValueError, match="same layer types"):
        PRESETS["gemma3-12b"].replace(layer_overrides=())


def test_random_weights_have_init_params_layout_and_identity_norms(gemma):
    """Random weights of the tiny model's shapes: ``init_params``' tree, and every norm scale
    0, Gemma's identity x (1 + 0) (``Family.norm_identity``), as ``init_params`` draws it."""
    import jax

    from hx.models import random_weights
    from hx.models.decoder import init_params

    spec = gemma[0].spec
    params = random_weights.random_params(spec)
    expected = init_params(spec)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    for tree in (params, expected):
        for op, path in (("Q", "attn_norm"), ("OUT", "post_attn_norm"),
                         ("MLP2", "post_ffn_norm"), ("K", "k_norm")):
            np.testing.assert_array_equal(tree["layer_1"][op][path]["scale"], 0.0)
