"""Tiny random checkpoints of every family, written by ``transformers`` itself, and its outputs.

Each is what a user would bring: ``config.json`` + ``model.safetensors`` from ``save_pretrained``
(``AutoConfig.for_model``; weights drawn with a fixed seed, wider than transformers' own
initialiser so that the logits of different tokens stand apart and a greedy choice does not hang
on rounding), beside a byte-level ``tokenizer.json`` written with ``tokenizers``.
"""

from __future__ import annotations

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
    "llama3": ("llama", dict(SHAPES, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
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
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return"]


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


def write_checkpoint(name: str, directory: str, seed: int = 0):
    """Write family ``name``'s tiny checkpoint into ``directory``; returns the transformers
    model (float32, eval mode) it holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = CONFIGS[name]
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and "norm" in pname and "bias" not in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))  # norm scales away from 1
            else:
                p.copy_(0.15 * torch.randn_like(p))
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


GGUF_FAMILIES = ("llama", "qwen2", "qwen3")  # the tiny checkpoints llama.cpp defines GGUFs of


def write_gguf(ref_model, spec, path: str) -> None:
    """The checkpoint as llama.cpp's converter would write it (float32 tensors, the family's
    GGUF names, Llama's q/k rows permuted), with the byte-level vocabulary as GGUF metadata."""
    from tokenizers import pre_tokenizers

    from gguf_files import llama_cpp_permute, shapes_writer
    from hx.models.spec import EMBED, HEAD, LAYER_OPS

    fam = spec.model_family
    arch = fam.gguf_architectures[0]
    state = {k: v.float().numpy() for k, v in ref_model.state_dict().items()}
    w = shapes_writer(path, spec, arch)
    w.add_vocab_size(spec.vocab_size)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [EOS]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_merges([])
    w.add_eos_token_id(256)
    ops = [(None, EMBED)] + [(i, op) for i in range(spec.n_layers) for op in LAYER_OPS]
    for layer, op in ops + [(None, HEAD)]:
        for p in spec.op_weight_shapes(op):
            if op == HEAD and p == "embedding" and spec.tie_embeddings:
                continue
            a = state[fam.hf_name(layer, op, p)]
            if p in fam.gguf_rope_permuted:
                heads = spec.n_heads if p == "wq/kernel" else spec.n_kv_heads
                a = llama_cpp_permute(a, heads)
            w.add_tensor(fam.gguf_name(layer, op, p), np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
