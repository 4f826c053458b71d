"""Write small GGUF files for tests, the way llama.cpp's converter lays them out.

``write_gguf`` writes hx's parameter tree as a Llama file (SmolLM2's tokenizer metadata, some
tensors quantized); ``convert`` writes a Hugging Face folder as llama.cpp's
``convert_hf_to_gguf.py`` (its ``conversion/`` package) writes it with ``--outtype f32``: the
tensor names from ``gguf``'s own name map (the converter's ``map_tensor_name``), each model
class's changes to tensors and its keys (``CONVERTERS``), never hx's tables.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import gguf
import numpy as np

from hx.models.tensors import layer_key

QUANTIZED = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0,
             "blk.1.ffn_gate.weight": gguf.GGMLQuantizationType.Q4_1}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (rotate-half -> interleaved pairs)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_layout(spec, params) -> dict[str, np.ndarray]:
    """hx's tree -> GGUF tensor names with (out, in) matrices, q/k permuted like llama.cpp."""
    t = {"token_embd.weight": params["EMBED"]["embedding"],
         "output_norm.weight": params["HEAD"]["final_norm"]["scale"]}
    if not spec.tie_embeddings:
        t["output.weight"] = params["HEAD"]["embedding"]
    for i in range(spec.n_layers):
        L, b = params[layer_key(i)], f"blk.{i}."
        t[b + "attn_norm.weight"] = L["Q"]["attn_norm"]["scale"]
        rows = lambda a: np.asarray(a).reshape(a.shape[0] * a.shape[1], -1)  # noqa: E731
        t[b + "attn_q.weight"] = llama_cpp_permute(rows(L["Q"]["wq"]["kernel"]), spec.n_heads)
        t[b + "attn_k.weight"] = llama_cpp_permute(rows(L["K"]["wk"]["kernel"]),
                                                   spec.n_kv_heads)
        t[b + "attn_v.weight"] = rows(L["V"]["wv"]["kernel"])
        wo = L["OUT"]["wo"]["kernel"]
        t[b + "attn_output.weight"] = np.asarray(wo).reshape(wo.shape[0], -1)
        t[b + "ffn_norm.weight"] = L["MLP1"]["ffn_norm"]["scale"]
        t[b + "ffn_gate.weight"] = L["MLP1"]["w_gate"]["kernel"]
        t[b + "ffn_up.weight"] = L["MLP1"]["w_up"]["kernel"]
        t[b + "ffn_down.weight"] = L["MLP2"]["w_down"]["kernel"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def shapes_writer(path, spec, arch: str):
    """A ``gguf.GGUFWriter`` of architecture ``arch`` at ``path`` holding ``spec``'s shapes
    as llama.cpp's metadata keys (head dim as key/value length and RoPE dimensions)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length(spec.d_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    return w


def write_gguf(path, spec, params, metadata, arch: str = "llama",
               more: Callable[[gguf.GGUFWriter], None] | None = None) -> dict[str, np.ndarray]:
    """Write ``params`` as a GGUF of architecture ``arch`` with SmolLM2's tokenizer metadata,
    and whatever keys and tensors ``more`` adds.

    Tensors in ``QUANTIZED`` are stored quantized. Returns the float32 tensors as a reader
    should dequantize them (by GGUF name).
    """
    w = shapes_writer(path, spec, arch)
    if more is not None:
        more(w)
    w.add_vocab_size(spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    w.add_token_list(metadata["tokenizer.ggml.tokens"])
    w.add_token_types(metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(metadata["tokenizer.chat_template"])
    expected = {}
    for name, a in hf_layout(spec, params).items():
        qtype = QUANTIZED.get(name)
        if qtype is None:
            w.add_tensor(name, a)
            expected[name] = a
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            expected[name] = gguf.quants.dequantize(q, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@dataclass(frozen=True)
class TextConverter:
    """convert_hf_to_gguf.py's ``TextModel``: its keys (``set_gguf_parameters``, the part a
    dense decoder's config reaches), tensors as they are (``modify_tensors``), no extra ones
    (``generate_extra_tensors``). Subclasses are its model classes."""

    arch: gguf.MODEL_ARCH

    def rope(self, config: dict) -> dict:
        """``TextModel.__init__``'s ``rope_parameters``: the config's (transformers 5), with
        ``rope_local_base_freq`` as the ``sliding_attention`` theta where not by type."""
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if "full_attention" not in rope and "rope_local_base_freq" in config:
            rope["sliding_attention"] = {"rope_theta": config["rope_local_base_freq"]}
        return rope

    def keys(self, w: gguf.GGUFWriter, config: dict) -> None:
        w.add_block_count(config["num_hidden_layers"])
        w.add_context_length(config["max_position_embeddings"])
        w.add_embedding_length(config["hidden_size"])
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_head_count(config["num_attention_heads"])
        if "num_key_value_heads" in config:
            w.add_head_count_kv(config["num_key_value_heads"])
        rope = self.rope(config)
        full = rope.get("full_attention", rope)
        if full.get("rope_type") == "linear" and full.get("factor") is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if full.get("rope_theta") is not None:
            w.add_rope_freq_base(full["rope_theta"])
        if rope.get("sliding_attention", {}).get("rope_theta") is not None:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        if config.get("head_dim") is not None:
            w.add_key_length(config["head_dim"])
            w.add_value_length(config["head_dim"])
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        experts = config.get("num_local_experts") or config.get("num_experts")
        if experts is not None:
            w.add_expert_count(experts)
        if config.get("num_experts_per_tok") is not None:
            w.add_expert_used_count(config["num_experts_per_tok"])

    def tensor(self, name: str, a: np.ndarray, config: dict, directory: str) -> np.ndarray:
        return a

    def merged(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``modify_tensors``' merging of a layer's per-expert tensors into one 3-D tensor a
        kind (none in a dense model)."""
        return tensors

    def extra(self, config: dict) -> Iterator[tuple[str, np.ndarray]]:
        return iter(())


@dataclass(frozen=True)
class LlamaConverter(TextConverter):
    """``LlamaModel`` (Llama, Mistral): also the vocabulary size and RoPE dims; q/k rows
    permuted (``LlamaModel.permute``); Llama 3.1's scaling as ``rope_freqs.weight``."""

    def keys(self, w, config):
        super().keys(w, config)
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(config.get("head_dim") or
                                   config["hidden_size"] // config["num_attention_heads"])

    def tensor(self, name, a, config, directory):
        heads = config["num_attention_heads"]
        if name.endswith("q_proj.weight"):
            return llama_cpp_permute(a, heads)
        if name.endswith("k_proj.weight"):
            return llama_cpp_permute(a, config.get("num_key_value_heads", heads))
        return a

    def extra(self, config):
        """``generate_extra_tensors``: the llama3 ramp as one factor per frequency, computed in
        float32 as the converter does -- its ``original_max_position_embeddings`` read from the
        config's top level (8192 where absent: Llama 3.1 keeps it inside ``rope_scaling``)."""
        rope = self.rope(config)
        rope = rope.get("full_attention", rope)
        if rope.get("rope_type") != "llama3":
            return
        import torch

        base = rope.get("rope_theta", 10000.0)
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor, low, high = (rope.get(k, d) for k, d in (("factor", 8.0),
                                                          ("low_freq_factor", 1.0),
                                                          ("high_freq_factor", 4.0)))
        old = config.get("original_max_position_embeddings", 8192)
        factors = []
        for freq in freqs:
            wavelength = 2 * math.pi / freq
            if wavelength < old / high:
                factors.append(1)
            elif wavelength > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelength - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        yield "rope_freqs.weight", torch.tensor(factors, dtype=torch.float32).numpy()


@dataclass(frozen=True)
class Phi3Converter(TextConverter):
    """``Phi3MiniModel``: its own keys (the window as 0 where the config has none); tensors
    as they are (``qkv_proj`` and ``gate_up_proj`` fused into ``attn_qkv``, ``ffn_up``)."""

    def keys(self, w, config):
        rope = self.rope(config)
        d, heads = config["hidden_size"], config["num_attention_heads"]
        w.add_context_length(config["max_position_embeddings"])
        # the newest converter reads it from rope_parameters, earlier ones from the top level
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 config["original_max_position_embeddings"]))
        w.add_embedding_length(d)
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_block_count(config["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(config["num_key_value_heads"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * d) // heads)
        w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_sliding_window(config.get("sliding_window") or 0)


@dataclass(frozen=True)
class Gemma3Converter(TextConverter):
    """``Gemma3Model``: ``TextModel``'s keys with Gemma 3's defaults, the window (no layer
    pattern, no ``query_pre_attn_scalar``); 1 added to every ``*norm.weight``; the embedding
    cut to the tokenizer's tokens."""

    def keys(self, w, config):
        super().keys(w, config)
        w.add_context_length(config.get("max_position_embeddings", 131072))
        w.add_head_count(config.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
        w.add_key_length(config.get("head_dim", 256))
        w.add_value_length(config.get("head_dim", 256))
        rope = self.rope(config)
        w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window_pattern") != 1:
            w.add_sliding_window(config["sliding_window"])
        w.add_head_count_kv(config.get("num_key_value_heads", 4))

    def tensor(self, name, a, config, directory):
        if "embed_tokens.weight" in name:
            with open(os.path.join(directory, "tokenizer.json")) as f:
                tok = json.load(f)
            a = a[:len(tok["model"]["vocab"]) + len(tok["added_tokens"])]
        return a + np.float32(1.0) if name.endswith("norm.weight") else a


def stack_experts(tensors: dict[str, np.ndarray], pattern: str, merged: str
                  ) -> dict[str, np.ndarray]:
    """Each layer's tensors named ``pattern`` (a regex of groups layer, expert, kind) stacked
    over the experts, in order, as ``merged.format(layer, kind)`` (the converters'
    ``torch.stack(datas, dim=0)``); the other tensors as they are."""
    import re

    out, experts = {}, {}
    for name, a in tensors.items():
        m = re.fullmatch(pattern, name)
        if m is None:
            out[name] = a
        else:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = a
    for (layer, kind), each in experts.items():
        out[merged.format(layer, kind)] = np.stack([each[e] for e in sorted(each)])
    return out


@dataclass(frozen=True)
class MixtralConverter(LlamaConverter):
    """``LlamaModel`` on a Mixtral: its experts' w1, w2, w3 stacked as
    ``layers.{i}.feed_forward.experts.{w}.weight``."""

    def merged(self, tensors):
        return stack_experts(tensors, r"model\.layers\.(\d+)\.block_sparse_moe\.experts\."
                             r"(\d+)\.(w[123])\.weight", "layers.{}.feed_forward.experts.{}.weight")


@dataclass(frozen=True)
class QwenMoeConverter(TextConverter):
    """``Qwen2MoeModel`` (and ``Qwen3MoeModel``, ``OlmoeModel``'s merging): the experts' size
    keys, each layer's experts stacked as ``model.layers.{i}.mlp.experts.{kind}.weight``."""

    def keys(self, w, config):
        super().keys(w, config)
        if config.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])

    def merged(self, tensors):
        return stack_experts(tensors, r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                             r"(\w+_proj)\.weight", "model.layers.{}.mlp.experts.{}.weight")


@dataclass(frozen=True)
class OlmoeConverter(QwenMoeConverter):
    """``OlmoeModel``: ``TextModel``'s keys, the RMSNorm epsilon written as 1e-5 whatever the
    config says; its experts stacked as Qwen's."""

    def keys(self, w, config):
        TextConverter.keys(self, w, config)
        w.add_layer_norm_rms_eps(1e-5)


# convert_hf_to_gguf.py's model class of each Hugging Face architecture hx's families have
# (none for OPT: llama.cpp defines no OPT architecture)
CONVERTERS: dict[str, TextConverter] = {
    "LlamaForCausalLM": LlamaConverter(gguf.MODEL_ARCH.LLAMA),
    "MistralForCausalLM": LlamaConverter(gguf.MODEL_ARCH.LLAMA),
    "Qwen2ForCausalLM": TextConverter(gguf.MODEL_ARCH.QWEN2),
    "Qwen3ForCausalLM": TextConverter(gguf.MODEL_ARCH.QWEN3),
    "Phi3ForCausalLM": Phi3Converter(gguf.MODEL_ARCH.PHI3),
    "Gemma3ForCausalLM": Gemma3Converter(gguf.MODEL_ARCH.GEMMA3),
    "MixtralForCausalLM": MixtralConverter(gguf.MODEL_ARCH.LLAMA),
    "Qwen3MoeForCausalLM": QwenMoeConverter(gguf.MODEL_ARCH.QWEN3MOE),
    "Qwen2MoeForCausalLM": QwenMoeConverter(gguf.MODEL_ARCH.QWEN2MOE),
    "OlmoeForCausalLM": OlmoeConverter(gguf.MODEL_ARCH.OLMOE),
}


def convert(directory: str, path, tokenizer: dict[str, Any],
            quantized: gguf.GGMLQuantizationType | None = None) -> None:
    """Write the Hugging Face folder ``directory`` (``config.json``, ``model.safetensors``) as
    convert_hf_to_gguf.py would, float32, at ``path``; ``tokenizer``: the ``tokenizer.ggml.*``
    keys (the converter's vocabulary detection is not followed: the test tokenizers are no
    released one). With ``quantized``, every matrix whose rows are whole blocks is written in
    that block type, as llama.cpp's ``llama-quantize`` writes it -- but an MoE router
    (``ffn_gate_inp``), which it keeps in F32.

    Raises:
      KeyError: llama.cpp has no converter for the folder's architecture.
    """
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    conv = CONVERTERS[config["architectures"][0]]
    names = gguf.get_tensor_name_map(conv.arch, config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[conv.arch])
    conv.keys(w, config)
    w.add_tokenizer_model(tokenizer["model"])
    w.add_tokenizer_pre(tokenizer["pre"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["token_type"])
    w.add_token_merges(tokenizer["merges"])
    w.add_eos_token_id(tokenizer["eos_token_id"])
    tensors = {name: conv.tensor(name, a.astype(np.float32), config, directory)
               for name, a in load_file(os.path.join(directory, "model.safetensors")).items()}
    for name, a in conv.merged(tensors).items():
        name, a = names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(a)
        if quantized is None or a.ndim < 2 or a.shape[-1] % 32 or "ffn_gate_inp" in name:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, quantized), raw_dtype=quantized)
    for name, a in conv.extra(config):
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
