"""FP8 checkpoints with a scale per block (DeepSeek-V3's, Qwen3's -FP8 releases;
``models.fp8_blocks``): the matrices dequantized as they are read run the checkpoint's weights
exactly, and what hx does not read is refused with one line."""

import json
import os

import numpy as np
import pytest
import torch

import hx
from hx.devices import discover
from hx.errors import HxError
from hx.generate import Engine
from hx.models.safetensors_loader import spec_from_config
from hx.planner import policies
from hx.sampling import SamplingParams

from hf_families import CONFIGS, PROMPTS, reference, write_checkpoint

BLOCK = (32, 16)  # not the released 128 x 128: matrices hold several blocks, the axes told apart
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK)}


def to_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 codes, scales (ceil(out / 32), ceil(in / 16)) float32) of ``w``: each
    block's largest magnitude at e4m3's largest, 448, as DeepSeek's ``weight_quant``."""
    out, n_in = w.shape
    rows, cols = -(-out // BLOCK[0]), -(-n_in // BLOCK[1])
    padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
    padded[:out, :n_in] = w
    blocks = padded.reshape(rows, BLOCK[0], cols, BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :n_in]
    return codes.to(torch.float8_e4m3fn), scale


def write_fp8(name: str, directory: str):
    """The family's tiny checkpoint with every projection matrix (not the embedding, LM head,
    router or norms) as FP8 blocks, and the transformers model running the same weights
    dequantized (loaded from a float32 copy of the folder beside it)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    write_checkpoint(name, directory)
    path, dense = os.path.join(directory, "model.safetensors"), directory + "-dequantized"
    tensors = load_file(path)
    stored, converted = dict(tensors), 0
    for key, w in tensors.items():
        if w.ndim == 2 and key.endswith("proj.weight") and "embed" not in key:
            codes, scale = to_fp8_blocks(w)
            stored[key], stored[key + "_scale_inv"] = codes, scale
            full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            tensors[key] = codes.to(torch.float32) * full[:w.shape[0], :w.shape[1]]
            converted += 1
    os.makedirs(dense)
    save_file(stored, path, metadata={"format": "pt"})
    save_file(tensors, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dense, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": QUANTIZATION}, f)
    ref = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    return ref, converted


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_an_fp8_checkpoint_runs_its_dequantized_weights(name, tmp_path):
    """Qwen3-MoE's and DeepSeek-V3's tiny checkpoints (matrices of 24 to 128 rows and columns:
    partial blocks too) in FP8 blocks: the logits of transformers running the dequantized
    weights within 1e-4 and its greedy tokens, all on the accelerator and with the routed
    experts on the host."""
    ref, converted = write_fp8(name, str(tmp_path))
    assert converted >= 10
    model = hx.load(str(tmp_path), dtype="float32")
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    ref_logits, ref_greedy = reference(ref, prompts, 8, model.tokenizer.eos_id)
    for plan in (policies.all_accelerator(model.spec.n_layers), policies.cpu_moe(model.spec)):
        engine = Engine(model, plan, discover())
        for row, want in zip(engine.last_logits(prompts), ref_logits):
            assert np.abs(row - want).max() / np.abs(want).max() <= 1e-4, plan.name
        got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=8))
        assert [c.token_ids for c in got] == ref_greedy, plan.name


@pytest.mark.parametrize("field,value", [
    ("quant_method", "gptq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
    ("weight_block_size", None), ("weight_block_size", [128]), ("ignored_layers", ["x"])])
def test_a_quantization_hx_does_not_read_is_refused(field, value):
    config = {"model_type": "qwen3_moe", **CONFIGS["qwen3_moe"][1],
              "quantization_config": {**QUANTIZATION, field: value}}
    with pytest.raises(HxError, match=field) as refused:
        spec_from_config(config, "/m")
    assert "\n" not in str(refused.value)


def test_fp8_tensors_without_their_quantization_config_are_refused(tmp_path):
    """Codes read without their scales would be other weights: the tensor is named."""
    write_fp8("qwen3_moe", str(tmp_path))
    config_path = os.path.join(tmp_path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(HxError, match=r"proj\.weight is FP8"):
        hx.load(str(tmp_path), dtype="float32")


def test_a_dequantized_matrix_leaves_its_codes_pages(tmp_path):
    """Once a 1 MiB FP8 matrix is dequantized, its codes' pages leave the process's resident
    set (as a held tensor's do), or an FP8 checkpoint's bytes would stay resident through its
    load; the weights are codes x the scale of their 128 x 128 block."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from hx.models.fp8_blocks import Dequantized, Fp8Blocks
    from hx.models.mapped import resident_bytes
    from hx.models.safetensors_loader import map_safetensors

    rng = np.random.default_rng(0)
    codes = rng.standard_normal((1024, 1024)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (8, 8)).astype(np.float32)
    path = str(tmp_path / "fp8.safetensors")
    save_file({"w": codes, "w_scale_inv": scale}, path)
    tensors = map_safetensors(path)
    assert int(tensors["w"].view(np.uint8).sum()) > 0  # read: its pages are resident
    assert resident_bytes(tensors["w"]) >= codes.nbytes
    weights = Dequantized(tensors, Fp8Blocks((128, 128)))["w"]
    assert resident_bytes(tensors["w"]) <= codes.nbytes // 8
    want = codes.astype(np.float64) * np.kron(scale, np.ones((128, 128)))
    np.testing.assert_array_equal(weights, want.astype(np.float32))
