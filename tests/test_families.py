"""Every family hx runs, against transformers on the checkpoint transformers itself wrote.

For each family (``tests/hf_families.py``: Llama, Llama-3.1's rope scaling, Mistral with a window
shorter than the prompts, Qwen2, Qwen3, Phi-3, OPT, Gemma 3, and the Mixtures of Experts: Mixtral,
Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3, gpt-oss), a tiny random checkpoint in
float32: hx's last-position logits within 1e-4 relative and its 16-token greedy continuations equal
to transformers', for two prompts run as one left-padded batch, under all-accelerator, stream-all
(weights streamed, SCORE and the KV cache on the host), CP-SAT's plan for 30 % of the weight bytes
(the accountant raising if the budget is ever passed) and, for a Mixture of Experts, llama.cpp's
``--cpu-moe`` and ``--n-cpu-moe 1``, half of each layer's experts resident and the rest streamed, on
disk or on the host (and 8 rows in throughput mode); the same checkpoint as llama.cpp's converter
writes it, read from the GGUF (every family llama.cpp defines). Then what hx refuses and ignores.

CP-SAT's plan costs about 15 s a family to make (its pattern pricing), so the suite makes it for
the families whose layers differ most from Llama's (``CPSAT_IN_SUITE``);
``HX_FAMILIES_ALL_PLANS=1 pytest tests/test_families.py`` runs it for every family
(docs/measurements/log.md, "Model families").
"""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hx
from hx.devices import discover
from hx.errors import HxError
from hx.generate import Engine
from hx.models.family import HF_IGNORED, family
from hx.models.safetensors_loader import spec_from_config
from hx.models.tensors import step_limit
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.workload import Workload

from hf_families import (CONFIGS, GGUF_CHECKPOINTS, GGUF_DROPPED, NO_GGUF, PROMPTS, reference,
                         with_fields, write_checkpoint, write_gguf)
from profiles import gpu_like

NEW_TOKENS = 16


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(family, folder, hx model, transformers model, prompts as ids, reference)."""
    directory = str(tmp_path_factory.mktemp(request.param))
    ref_model = write_checkpoint(request.param, directory)
    model = hx.load(directory, dtype="float32")
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    return (request.param, directory, model, ref_model, prompts,
            reference(ref_model, prompts, NEW_TOKENS, model.tokenizer.eos_id))


CPSAT_IN_SUITE = ("opt", "gemma3")


def plans(name, model, prompts):
    """(name, plan, devices) of the three plans every family must run exactly (CP-SAT's
    where the module docstring says)."""
    spec, n = model.spec, model.spec.n_layers
    yield "all-accelerator", policies.all_accelerator(n), discover()
    yield "stream-all", policies.stream_all(n), discover()
    if spec.moe:  # llama.cpp's --cpu-moe and --n-cpu-moe 1: the routed experts on the host
        yield "cpu-moe", policies.cpu_moe(spec), discover()
        yield "n-cpu-moe:1", policies.cpu_moe(spec, 1), discover()
        half = spec.moe.routed // 2  # experts placed one by one: half resident, half not
        for rest in ("streamed", "disk", "host"):
            yield (f"resident-experts:{half}:{rest}",
                   policies.resident_experts(spec, half, rest), discover())
    if name not in CPSAT_IN_SUITE and not os.environ.get("HX_FAMILIES_ALL_PLANS"):
        return
    devices = discover(accelerator_memory=int(0.3 * spec.weight_bytes))
    work = Workload.for_prompts(len(prompts), max(map(len, prompts)), NEW_TOKENS, spec)
    yield "cpsat", policies.build("cpsat", spec, devices, work, profile=gpu_like(),
                                  time_limit_s=0.2), devices


def test_matches_transformers(checkpoint, tmp_path):
    name, _, model, _, prompts, (ref_logits, ref_greedy) = checkpoint
    assert CONFIGS[name][0] in family(model.spec.family).hf_model_types
    if name == "mistral":
        assert max(map(len, prompts)) > model.spec.sliding_window  # the window is exercised
    for plan_name, plan, devices in plans(name, model, prompts):
        engine = Engine(model, plan, devices, spill_dir=str(tmp_path))
        got = engine.last_logits(prompts)
        for row, ref in zip(got, ref_logits):
            assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4, plan_name
        completions = engine.generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [c.token_ids for c in completions] == ref_greedy, plan_name
        if devices.accelerator.capacity is not None:
            assert engine.accountant.peak <= devices.accelerator.capacity
    if step_limit(model.spec) is not None:  # its windowed layers held rings, the others S
        held = {c["k"].shape[1] for c in engine.executor.new_cache(1, 64)}
        assert held == ({16, 64} if model.spec.layer_types else {16})
        engine.executor.release_cache()
    assert sum(map(len, ref_greedy)) >= NEW_TOKENS  # real continuations were compared


EIGHT_PROMPTS = [f"{p} {i}" for i in range(4) for p in PROMPTS]


def test_an_moe_family_in_throughput_mode_at_8_rows(checkpoint):
    """A Mixture of Experts in throughput mode (``hx.continuous.ContinuousBatcher``: two
    micro-batches of 4 rows, a row's slot refilled as it ends): 8 prompts' greedy tokens equal
    transformers' for each prompt alone, all-accelerator and ``cpu-moe``."""
    from hx.continuous import ContinuousBatcher

    name, _, model, ref_model, _, _ = checkpoint
    if model.spec.moe is None:
        pytest.skip("dense families' throughput mode: tests/test_continuous.py")
    prompts = [model.tokenizer.encode(p) for p in EIGHT_PROMPTS]
    _, ref_greedy = reference(ref_model, prompts, NEW_TOKENS, model.tokenizer.eos_id)
    for plan in (policies.all_accelerator(model.spec.n_layers), policies.cpu_moe(model.spec)):
        got = ContinuousBatcher(Engine(model, plan, discover()), 4, 2).run(
            prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [c.token_ids for c in got] == ref_greedy, plan.name


def test_gguf_matches_transformers(checkpoint, tmp_path):
    """The checkpoint as llama.cpp's converter writes it (tests/gguf_files.convert: its tensor
    names, fused tensors, permuted q/k rows, norms + 1, RoPE factors, keys), read by hx: the
    logits and greedy tokens of transformers running the model the file describes
    (all-accelerator, stream-all). Where such a file cannot carry the family's checkpoint
    (``GGUF_CHECKPOINTS``: Gemma 3's layer pattern and attention scale) a sibling one is
    converted; where it drops a field (``GGUF_DROPPED``: Mistral's window) transformers runs
    without it -- and the field is shown to matter."""
    name, directory, model, ref_model, prompts, (ref_logits, ref_greedy) = checkpoint
    if name in NO_GGUF:
        pytest.skip(NO_GGUF[name])
    if name in GGUF_CHECKPOINTS:
        directory = str(tmp_path / "source")
        os.mkdir(directory)
        ref_model = write_checkpoint(name, directory, config=GGUF_CHECKPOINTS[name])
        ref_logits, ref_greedy = reference(ref_model, prompts, NEW_TOKENS, model.tokenizer.eos_id)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(directory, path, ref_model.config.vocab_size)
    from_gguf = hx.load(path, dtype="float32")
    assert from_gguf.spec.family == {"mistral": "llama"}.get(name, model.spec.family)
    assert from_gguf.tokenizer.encode(PROMPTS[0]) == prompts[0]
    if name in GGUF_DROPPED:
        dropped_logits = ref_logits
        ref_model = with_fields(ref_model, GGUF_DROPPED[name])
        ref_logits, ref_greedy = reference(ref_model, prompts, NEW_TOKENS, model.tokenizer.eos_id)
        assert all(np.abs(a - b).max() > 1e-3 * np.abs(b).max()
                   for a, b in zip(ref_logits, dropped_logits))
    n = from_gguf.spec.n_layers
    for plan in (policies.all_accelerator(n), policies.stream_all(n)):
        engine = Engine(from_gguf, plan, discover())
        for row, ref in zip(engine.last_logits(prompts), ref_logits):
            assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4, plan.name
        completions = engine.generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [c.token_ids for c in completions] == ref_greedy, plan.name


def test_hx_generate_runs_a_family_folder(checkpoint, tmp_path):
    """The CLI as a user runs it: `hx generate -m DIR -p TEXT -o FILE` on OPT's folder (every
    family loads through the same loader) writes transformers' greedy continuation."""
    name, directory, model, _, _, (_, ref_greedy) = checkpoint
    if name != "opt":
        pytest.skip("one family through the CLI; the others through the same loader above")
    out = tmp_path / "out.jsonl"
    result = subprocess.run([sys.executable, "-m", "hx", "generate", "-m", directory, "-p",
                             PROMPTS[0], "--max-new-tokens", str(NEW_TOKENS), "-o", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    row = json.loads(out.read_text())
    assert row["completion"] == model.tokenizer.decode(ref_greedy[0])
    assert row["completion_tokens"] == len(ref_greedy[0])


def changed(value):
    """A different value of a config field's type (the proof that hx may ignore it)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):  # rates and deviations in [0, 1]
        return value / 2 + 0.25
    if isinstance(value, int):
        return value * 2 + 1
    return None


def test_ignored_fields_do_not_change_the_outputs(checkpoint):
    """Every field of the family's config.json that hx reads past (``HF_IGNORED`` and the
    family's own) changes nothing in transformers' outputs either: each numeric or boolean
    one is changed and the logits compared; the rest are names, ids and bookkeeping
    (strings, mappings, the token ids the tokenizer decides)."""
    name, directory, model, ref_model, prompts, (ref_logits, _) = checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    ignored = (HF_IGNORED | family(model.spec.family).hf_ignored) & set(config)
    varied = [key for key in sorted(ignored) if changed(config[key]) is not None
              and not key.endswith("token_id")]
    state = ref_model.state_dict()
    for key in varied:
        altered = copy.deepcopy(config)
        altered[key] = changed(config[key])
        spec_from_config(altered, directory)  # hx still reads it past
        other = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**{k: v for k, v in altered.items()
                                    if k not in ("transformers_version",)}),
            dtype=torch.float32)
        other.load_state_dict(state)
        other.eval()
        with torch.no_grad():
            out = other(torch.tensor([prompts[0]])).logits[0, -1].double().numpy()
        assert np.abs(out - ref_logits[0]).max() <= 1e-5 * np.abs(ref_logits[0]).max(), key


@pytest.mark.parametrize("model_type,field,value", [
    ("llama", "unheard_of_field", 1), ("llama", "hidden_act", "gelu"),
    ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
    ("llama", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": 2.0, "beta": 1.0}),
    ("llama", "attention_bias", True), ("llama", "mlp_bias", True),
    ("qwen2", "use_sliding_window", True),
    ("qwen3", "layer_types", ["sliding_attention", "full_attention"]),
    ("opt", "do_layer_norm_before", False), ("opt", "word_embed_proj_dim", 32),
    ("opt", "activation_function", "gelu"),
    ("phi3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}),
    ("qwen3_moe", "decoder_sparse_step", 0), ("qwen3_moe", "mlp_only_layers", [2]),
    ("qwen2_moe", "qkv_bias", False), ("olmoe", "clip_qkv", 8.0),
    ("mixtral", "unheard_of_field", 1), ("deepseek_v2", "norm_topk_prob", True),
    ("deepseek_v2", "topk_method", "noaux_tc"),
    ("deepseek_v2", "scoring_func", "sigmoid"), ("deepseek_v3", "topk_method", "greedy"),
    ("deepseek_v3", "scoring_func", "softmax"), ("deepseek_v3", "n_group", 4),
    ("gpt_oss", "quantization_config", {"quant_method": "mxfp4"}),
    ("gpt_oss", "layer_types", ["sliding_attention", "chunked_attention"]),
    ("gpt_oss", "experts_per_token", 3),
    ("deepseek_v2", "rope_parameters", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
    ("deepseek_v2", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                        "original_max_position_embeddings": 64, "beta": 1.0})])
def test_a_field_hx_does_not_implement_is_refused(model_type, field, value):
    """One line naming the field (or the RoPE type, or its unknown part)."""
    config = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 112,
              "ffn_dim": 112, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 320}
    if model_type in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe"):
        config |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                   "shared_expert_intermediate_size": 48}
    if model_type == "gpt_oss":
        config |= {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6}
    if model_type.startswith("deepseek"):
        config |= {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                   "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    word = value.get("rope_type", field) if isinstance(value, dict) else field
    word = "beta" if isinstance(value, dict) and "beta" in value else word
    with pytest.raises(HxError, match=word) as refused:
        spec_from_config({**config, field: value}, "/m")
    assert "\n" not in str(refused.value)


def test_deepseek_v3_with_llamas_rope_pairing_matches_transformers(tmp_path):
    """DeepSeek-V3's ``rope_interleave`` False: RoPE pairs element i with i + 4 of the 8
    rotated ones (``MlaShape.interleaved``), the logits transformers' within 1e-4."""
    model_type, config = CONFIGS["deepseek_v3"]
    ref_model = write_checkpoint("deepseek_v3", str(tmp_path),
                                 config=(model_type, {**config, "rope_interleave": False}))
    model = hx.load(str(tmp_path), dtype="float32")
    assert not model.spec.mla.interleaved
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    ref_logits, _ = reference(ref_model, prompts, 1, model.tokenizer.eos_id)
    engine = Engine(model, policies.all_accelerator(model.spec.n_layers), discover())
    for row, ref in zip(engine.last_logits(prompts), ref_logits):
        assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.mark.parametrize("name,fields", [("qwen3_moe", {"mlp_only_layers": [0]}),
                                         ("qwen2_moe", {"decoder_sparse_step": 2})])
def test_moe_layers_beside_dense_ones_match_transformers(name, fields, tmp_path):
    """Qwen's MoE configs with dense layers (``mlp_only_layers``; ``decoder_sparse_step`` 2:
    every other layer): layer 0 is the layer type ``dense`` (an MLP of intermediate_size), layer
    1 ``moe``; all-accelerator, cpu-moe (the dense MLP stays) and half the experts streamed:
    transformers' logits within 1e-4 and its greedy tokens."""
    model_type, config = CONFIGS[name]
    ref_model = write_checkpoint(name, str(tmp_path), config=(model_type, {**config, **fields}))
    model = hx.load(str(tmp_path), dtype="float32")
    spec = model.spec
    assert spec.layer_types == ("dense", "moe") and spec.expert_layers == (1,)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    ref_logits, ref_greedy = reference(ref_model, prompts, NEW_TOKENS, model.tokenizer.eos_id)
    for plan in (policies.all_accelerator(spec.n_layers), policies.cpu_moe(spec),
                 policies.resident_experts(spec, spec.moe.routed // 2, "streamed")):
        engine = Engine(model, plan, discover())
        for row, ref in zip(engine.last_logits(prompts), ref_logits):
            assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4, plan.name
        got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [c.token_ids for c in got] == ref_greedy, plan.name


def test_deepseek_v3s_released_config_reads_as_its_preset():
    """A config.json with the fields of DeepSeek-V3's release (deepseek-ai/DeepSeek-V3: its
    own modeling code in ``auto_map``, FP8 blocks, DeepSeek's router keys, legacy
    ``rope_scaling``) reads as the ``deepseek-v3`` preset, every field but the name."""
    import dataclasses

    from hx.models.spec import PRESETS

    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
        "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
    spec = spec_from_config(config, "/models/DeepSeek-V3")
    assert dataclasses.replace(spec, name="DeepSeek-V3") == PRESETS["deepseek-v3"]
