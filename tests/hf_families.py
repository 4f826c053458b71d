"""Tiny random checkpoints of every family, written by ``transformers`` itself, and its outputs.

Each is what a user would bring: ``config.json`` + ``model.safetensors`` from ``save_pretrained``
(``AutoConfig.for_model``; weights drawn with a fixed seed, wider than transformers' own
initialiser so that the logits of different tokens stand apart and a greedy choice does not hang
on rounding), beside a byte-level ``tokenizer.json`` written with ``tokenizers``.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np

VOCAB = 320  # 256 bytes + specials, rounded up
EOS = "<|end|>"

# family -> config.json fields of a tiny model (AutoConfig.for_model(model_type, **fields))
SHAPES = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(SHAPES)),
    # Llama 3.1's ramp over wavelengths 8 to 64 (original 8192 / 1024 to 8192 / 128): of the
    # 8 frequencies (head dim 16, base 5 x 10^5) the first (wavelength 6.3) kept, the second
    # (32.5) on the ramp, the others divided by 8 -- with Llama 3.1's original context, 8192,
    # the one llama.cpp's converter assumes (it looks for original_max_position_embeddings at
    # the config's top level, where Llama 3.1 keeps none)
    "llama3": ("llama", dict(SHAPES, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 128.0,
        "high_freq_factor": 1024.0, "original_max_position_embeddings": 8192})),
    "mistral": ("mistral", dict(SHAPES, sliding_window=6)),
    "qwen2": ("qwen2", dict(SHAPES, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(SHAPES, head_dim=32)),
    "phi3": ("phi3", dict(SHAPES, num_key_value_heads=2, pad_token_id=0)),
    "opt": ("opt", dict(hidden_size=64, ffn_dim=112, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=256, word_embed_proj_dim=64,
                        pad_token_id=1, tie_word_embeddings=True)),
    # local layers (a window of 6, shorter than the prompts; RoPE base 10^4) beside global
    # ones (base 5 x 10^5, linear scaling); head dim 32 beside 64 / 4 and an attention scale
    # of 24^-1/2, not 32^-1/2
    "gemma3": ("gemma3_text", dict(
        SHAPES, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
        tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 500000.0}})),
    # Mixtures of Experts: 4 experts, the top 2; Mixtral's are its MLPs (intermediate_size),
    # Qwen's of moe_intermediate_size, with a shared expert in Qwen2-MoE
    "mixtral": ("mixtral", dict(SHAPES, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(SHAPES, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, norm_topk_prob=True)),
    "qwen2_moe": ("qwen2_moe", dict(SHAPES, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80)),
    "olmoe": ("olmoe", dict(SHAPES, num_experts=4, num_experts_per_tok=2)),
    # DeepSeek-V2-Lite's layout at tiny sizes: latent attention (q projected directly, a latent
    # of 32, heads of 16 + 8 rotated, values of 16), a dense first layer (of intermediate_size)
    # before 2 MoE layers of 8 routed experts in 4 groups, of which a token's top 2 come from
    # the best 2, weights x 2.5, two shared experts
    "deepseek_v2": ("deepseek_v2", dict(
        SHAPES, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    # DeepSeek-V3's layout at the same sizes, q through its own latent of 24: sigmoid scores
    # and a score bias (drawn: ``write_checkpoint``) choosing the top 2 of the best 2 of 4
    # groups by their two best experts, renormalised, x 2.5, one shared expert
    "deepseek_v3": ("deepseek_v3", dict(
        SHAPES, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # gpt-oss's layout at tiny sizes: 4 experts of 48, the top 2, biases everywhere, sinks,
    # a window of 6 on layer 0 (full attention on layer 1), YaRN by 4 over 64 positions
    # (not truncated), the SwiGLU clamped at 1 (so that the clamp acts on these weights)
    "gpt_oss": ("gpt_oss", dict(
        SHAPES, intermediate_size=48, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return"]
EOS_ID = 256  # the tokenizer's one special token, after the 256 bytes

# Where llama.cpp's GGUF of a family's checkpoint is another model, and why. Its converter
# writes none of OPT (llama.cpp defines no OPT architecture):
NO_GGUF = {"opt": "llama.cpp defines no OPT architecture (its converter has no OPTForCausalLM)",
           **{name: f"hx reads DeepSeek-V{name[-1]} from Hugging Face folders, not "
                    f"llama.cpp's deepseek2 files" for name in ("deepseek_v2", "deepseek_v3")},
           "gpt_oss": "hx reads gpt-oss from Hugging Face folders, not llama.cpp's gpt-oss files"}
# The checkpoint the GGUF test converts in place of the family's where a llama.cpp file cannot
# carry the latter: Gemma 3's GGUF holds no layer types or query_pre_attn_scalar (llama.cpp
# makes every 6th layer global and scales attention by E^-1/2 below 27B), and its converter cuts
# the embedding to the tokenizer's tokens -- so 6 layers, the 6th global, the scalar E, the
# vocabulary the tokenizer's (and another local RoPE base, which newer files carry).
GGUF_CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "gemma3": ("gemma3_text", dict(
        CONFIGS["gemma3"][1], num_hidden_layers=6, query_pre_attn_scalar=32, vocab_size=257,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 500000.0}})),
}
# The config fields whose values a llama.cpp file drops (its model: transformers with these
# values): Mistral's window (written as a ``llama`` file, which has none)
GGUF_DROPPED: dict[str, dict] = {"mistral": {"sliding_window": None}}


def write_tokenizer(directory: str) -> None:
    """A byte-level BPE tokenizer without merges (every byte a token) and one special token,
    ``EOS``, as ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in
             enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {token: i for i, token in enumerate(sorted(vocab))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "add_bos_token": False}, f)


def write_checkpoint(name: str, directory: str, seed: int = 0,
                     config: tuple[str, dict] | None = None):
    """Write family ``name``'s tiny checkpoint (or one of ``config``: (model_type, fields))
    into ``directory``; returns the transformers model (float32, eval mode) it holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = config or CONFIGS[name]
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and "norm" in pname and "bias" not in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))  # norm scales away from 1
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for bname, b in model.named_buffers():  # DeepSeek-V3's score bias: it moves choices
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return model


def reference(model, prompts: list[list[int]], new_tokens: int, eos: int
              ) -> tuple[list[np.ndarray], list[list[int]]]:
    """transformers' last-position logits (float64) and greedy continuations (cut at ``eos``)
    of each prompt, alone."""
    import torch

    logits, greedy = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            logits.append(model(x).logits[0, -1].double().numpy())
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=eos,
                                 pad_token_id=eos)[0, len(ids):].tolist()
            greedy.append(out[:out.index(eos)] if eos in out else out)
    return logits, greedy


def with_fields(model, fields: dict):
    """The transformers ``model``'s weights under its config with ``fields`` changed."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for key, value in fields.items():
        setattr(config, key, value)
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    other.load_state_dict(model.state_dict())
    return other.eval()


def write_gguf(directory: str, path: str, vocab_size: int, quantized=None) -> None:
    """The checkpoint in ``directory`` as llama.cpp's converter writes it
    (``gguf_files.convert``), with the byte-level vocabulary padded to ``vocab_size`` as
    the converter pads it (``[PAD{i}]``, unused) as GGUF metadata; its matrices in block type
    ``quantized`` where given (``gguf_files.convert``)."""
    from tokenizers import pre_tokenizers

    from gguf_files import convert

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [EOS]
    pads = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    convert(directory, path, {"model": "gpt2", "pre": "default", "tokens": tokens + pads,
                              "token_type": [1] * 256 + [3] + [5] * len(pads), "merges": [],
                              "eos_token_id": EOS_ID}, quantized)
