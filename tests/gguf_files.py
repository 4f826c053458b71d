"""Write small GGUF files for tests, the way llama.cpp's converter lays them out."""

from __future__ import annotations

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


def write_gguf(path, spec, params, metadata, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write ``params`` as a GGUF of architecture ``arch`` with SmolLM2's tokenizer metadata.

    Tensors in ``QUANTIZED`` are stored quantized. Returns the float32 tensors as a reader
    should dequantize them (by GGUF name).
    """
    w = shapes_writer(path, spec, arch)
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
