"""Write a llama.cpp GGUF file of random weights at a preset's layer shapes.

Usage: python scripts/write_gguf.py OUT.gguf [--model llama2-7b:8L] [--type q4_0] [--seed 0]

Writes one GGUF of architecture ``llama`` (``qwen3moe``, ``olmoe`` for those Mixture-of-Experts
presets: ``qwen3-30b-a3b:8L``) that both llama.cpp (``llama-bench -m OUT.gguf``) and hx
(``hx.load(OUT.gguf)``, ``hx bench -m OUT.gguf``) read: the preset's layers
(``models.spec.PRESETS``, ``NAME[:NL]``) under llama.cpp's tensor names (``token_embd``,
``blk.N.attn_q`` ..., ``output``; untied), every matrix in ``--type`` (``q4_0``, ``q8_0``,
``q4_1``, ``f16``, ``f32``; quantized by ``gguf.quants.quantize``), the norms F32 ones, and the
``llama.*`` hyper-parameters. The tokenizer is SmolLM2's: all ``tokenizer.*`` keys of the shipped
GGUF (``loader.default_model_path()``) are copied, so the vocabulary is 49,152 ids rather than
the preset's and the embedding and output tables are (49152, D). The weights are random: normal
with standard deviation 0.02, each tensor from its own generator seeded by (seed, crc32(its
name)), so ``llama2-7b:2L``'s layers equal the first two of ``llama2-7b:8L``. Being random, the
q/k rows need no rope permutation (llama.cpp's converter applies it to real weights; hx's loader
undoes it on read, as llama.cpp's layout requires).

Memory stays at about one tensor in the file's type plus a 1024-row float32 chunk: the tensor
infos are written first, then each tensor is drawn and quantized a chunk of rows at a time,
written, and dropped.

Measured on the 2-core development VM, llama2-7b:8L (2.02 B parameters, llama-bench's count):
q4_0 1.14 GB in 40 s (peak RSS 0.22 GB), q8_0 2.15 GB in 44 s (0.32 GB); one layer in any type
15-17 s (mostly the two 49152 x 4096 tables). The time is numpy drawing normals and quantizing.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib

import gguf
import numpy as np

from hx.models.loader import default_model_path, load_spec

STD = 0.02
_ROWS = 1024  # rows drawn and quantized per pass
TYPES = {  # --type: (tensor type, general.file_type)
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
}
_T = gguf.MODEL_TENSOR


def tensor_name(kind: gguf.MODEL_TENSOR, layer: int | None = None) -> str:
    """llama.cpp's name of a weight tensor (``gguf.TENSOR_NAMES``)."""
    return gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight"


# family -> (llama.cpp architecture, q/k norms: None, per head, or over the whole projection)
ARCHS = {"llama": ("llama", None), "qwen3_moe": ("qwen3moe", "head"),
         "olmoe": ("olmoe", "whole")}


def tensor_shapes(spec, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape (out..., in) or (n,), is a matrix in --type) of every tensor, in file
    order: an MoE layer's router (``ffn_gate_inp``, (X, D)) F32 as llama-quantize leaves it,
    its experts stacked (``ffn_*_exps``: (X, F, D), (X, D, F))."""
    d, f, moe = spec.d_model, spec.d_ff, spec.moe
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    qk_norm = ARCHS[spec.family][1]
    out = [(tensor_name(_T.TOKEN_EMBD), (vocab, d), True)]
    for i in range(spec.n_layers):
        layer = [(_T.ATTN_NORM, (d,)), (_T.ATTN_Q, (q, d)), (_T.ATTN_K, (kv, d)),
                 (_T.ATTN_V, (kv, d)), (_T.ATTN_OUT, (d, q))]
        if qk_norm:
            whole = qk_norm == "whole"
            layer += [(_T.ATTN_Q_NORM, (q if whole else spec.head_dim,)),
                      (_T.ATTN_K_NORM, (kv if whole else spec.head_dim,))]
        layer += [(_T.FFN_NORM, (d,))]
        if moe:
            X, fe = moe.experts, moe.d_expert
            layer += [(_T.FFN_GATE_INP, (X, d)), (_T.FFN_GATE_EXP, (X, fe, d)),
                      (_T.FFN_UP_EXP, (X, fe, d)), (_T.FFN_DOWN_EXP, (X, d, fe))]
        else:
            layer += [(_T.FFN_GATE, (f, d)), (_T.FFN_UP, (f, d)), (_T.FFN_DOWN, (d, f))]
        out += [(tensor_name(kind, i), shape, len(shape) >= 2 and kind != _T.FFN_GATE_INP)
                for kind, shape in layer]
    out += [(tensor_name(_T.OUTPUT_NORM), (d,), False), (tensor_name(_T.OUTPUT), (vocab, d), True)]
    return out


def stored(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType):
    """(numpy shape, numpy dtype) of a tensor of logical ``shape`` held in ``qtype``."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return shape, np.float32
    if qtype == gguf.GGMLQuantizationType.F16:
        return shape, np.float16
    return gguf.quant_shape_to_byte_shape(shape, qtype), np.uint8


def random_tensor(name: str, shape: tuple[int, ...], qtype, seed: int) -> np.ndarray:
    """A matrix (or a stack of them) of normal(0, STD) values in ``qtype``, drawn and quantized
    ``_ROWS`` rows at a time straight into the returned array."""
    held, dtype = stored(shape, qtype)
    out = np.empty(held, dtype)
    flat = out.reshape(-1, held[-1])
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    for r in range(0, len(flat), _ROWS):
        rows = rng.standard_normal((min(_ROWS, len(flat) - r), shape[-1]), dtype=np.float32)
        rows *= np.float32(STD)
        flat[r:r + len(rows)] = gguf.quants.quantize(rows, qtype)
    return out


def copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> int:
    """Copy every ``tokenizer.*`` key of the GGUF ``source`` to ``writer``; the vocabulary
    size (length of ``tokenizer.ggml.tokens``)."""
    reader = gguf.GGUFReader(source)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    return len(reader.fields[gguf.Keys.Tokenizer.LIST].data)


def write_gguf(path: str, model: str, type_name: str, seed: int, log=print) -> int:
    """Write the GGUF (module docstring); its size in bytes."""
    spec = load_spec(model, "float32")
    if spec.family not in ARCHS or spec.rope_scaling or spec.layer_types:
        raise SystemExit(f"{model}: family {spec.family}; this script writes {', '.join(ARCHS)} "
                         "models without RoPE scaling, e.g. llama2-7b:8L, qwen3-30b-a3b:8L")
    qtype, file_type = TYPES[type_name]
    writer = gguf.GGUFWriter(path, ARCHS[spec.family][0])
    writer.add_name(f"{spec.name}, random weights ({type_name})")
    writer.add_file_type(file_type)
    if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.d_model)
    writer.add_block_count(spec.n_layers)
    writer.add_feed_forward_length(spec.d_ff)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    if spec.head_dim != spec.d_model // spec.n_heads:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if spec.moe:
        writer.add_expert_count(spec.moe.experts)
        writer.add_expert_used_count(spec.moe.top_k)
        if spec.family != "olmoe":  # llama.cpp's olmoe reads the experts' size off the tensors
            writer.add_expert_feed_forward_length(spec.moe.d_expert)
    vocab = copy_tokenizer(writer, default_model_path())
    writer.add_vocab_size(vocab)
    tensors = tensor_shapes(spec, vocab)
    for name, shape, matrix in tensors:
        held, dtype = stored(shape, qtype if matrix else gguf.GGMLQuantizationType.F32)
        nbytes = int(np.prod(held)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, held, np.dtype(dtype), nbytes,
                               raw_dtype=qtype if matrix else gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, shape, matrix) in enumerate(tensors):
        if matrix:
            data = random_tensor(name, shape, qtype, seed)
        elif len(shape) == 2:  # an MoE router
            data = random_tensor(name, shape, gguf.GGMLQuantizationType.F32, seed)
        else:
            data = np.ones(shape, np.float32)
        writer.write_tensor_data(data)
        del data
        if not name.startswith("blk.") or name.endswith(("ffn_down.weight",
                                                         "ffn_down_exps.weight")):
            log(f"  {i + 1}/{len(tensors)} tensors written ({name})")
    writer.close()
    return os.path.getsize(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="llama2-7b:8L", help="preset NAME[:NL]")
    parser.add_argument("--type", default="q4_0", choices=sorted(TYPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    size = write_gguf(args.out, args.model, args.type, args.seed,
                      lambda line: print(line, flush=True))
    print(f"{args.out}: {args.model} {args.type}, {size / 1e9:.2f} GB in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
