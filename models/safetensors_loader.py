"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) into hx's tree.

The files -- one, or shards listed by ``model.safetensors.index.json`` -- are memory-mapped
(``models.mapped``) and each tensor is a view of its file: hx's ops take the checkpoint's
(out, in) layout, so a checkpoint loaded in its own dtype costs no copy at all (a bfloat16
checkpoint loaded as bfloat16 is bit for bit the file). A tensor converted to another dtype or
compressed (``weights``) is made once, tensor by tensor, and its mapped pages released; FP8
matrices with block scales (``quantization_config``) are dequantized as they are read
(``models.fp8_blocks``).

The safetensors format (huggingface/safetensors, "Format"): an 8-byte little-endian header
length N, N bytes of JSON mapping each tensor name to its dtype, shape and [begin, end) byte
offsets from the end of the header, then the data.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any, Callable

import numpy as np

from hx.errors import HxError
from hx.models.family import for_model_type
from hx.models.formats import DENSE
from hx.models.fp8_blocks import E4M3, Dequantized, read_quantization
from hx.models.holding import held_tensor
from hx.models.mapped import map_file
from hx.models.tensors import layer_key, weight_tree
from hx.models.spec import EMBED, HEAD, LAYER_OPS, ModelSpec, numpy_dtype

# safetensors' dtypes hx reads -> numpy's (F8_E4M3: FP8 weights, ``models.fp8_blocks``)
_DTYPES = {"F32": np.dtype("float32"), "F16": np.dtype("float16"),
           "BF16": numpy_dtype("bfloat16"), "F8_E4M3": E4M3}
INDEX = "model.safetensors.index.json"


def spec_from_config(config: dict[str, Any], directory: str) -> ModelSpec:
    """``ModelSpec`` from a Hugging Face ``config.json`` dict, by the family its
    ``model_type`` names (``models.family``); a ``quantization_config`` hx reads (FP8 blocks,
    ``models.fp8_blocks``) changes no field: the weights are held dequantized.

    Raises:
      HxError: no family of hx has the model type, a required key is missing, or a field
        changes the math in a way hx does not implement (one line naming it).
    """
    config = dict(config)
    read_quantization(config, directory)
    fam = for_model_type(config.get("model_type"), directory)
    return fam.spec_from_hf(config, directory)


def _shard_files(directory: str) -> list[str]:
    """The safetensors files of a folder: the shards its index names, else every file.

    Raises:
      HxError: no weights, an unreadable index, or a shard it names is missing.
    """
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise HxError(f"{index} is not a safetensors index ({e}); re-download it") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise HxError(f"{directory}: shards named by {INDEX} are missing: "
                          f"{', '.join(missing)}; download them")
        return [os.path.join(directory, n) for n in names]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise HxError(f"{directory}: expected config.json and *.safetensors files")
    return files


def map_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a read-only view of its mapping, in the file's
    dtype and shape.

    Raises:
      HxError: the file is truncated or corrupt, or holds a dtype hx does not load.
    """
    data = map_file(path)

    def corrupt(why: str) -> HxError:
        return HxError(f"{path} is not a readable safetensors file ({why}); re-download it")

    if data.size < 8:
        raise corrupt("shorter than its header")
    (length,) = struct.unpack("<Q", data[:8].tobytes())
    if 8 + length > data.size:
        raise corrupt(f"a header of {length} bytes runs past the end of the file")
    try:
        header = json.loads(data[8:8 + length].tobytes())
    except ValueError as e:
        raise corrupt(f"its header is not JSON: {e}") from None
    tensors, start = {}, 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in _DTYPES:
            raise HxError(f"{path}: tensor {name} is {entry.get('dtype')}; hx loads "
                          f"{', '.join(_DTYPES)} checkpoints")
        begin, end = (start + o for o in entry["data_offsets"])
        dtype = _DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        if end > data.size or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise corrupt(f"tensor {name} ends at byte {end} of {data.size}, or its size does "
                          "not match its shape")
        tensors[name] = data[begin:end].view(dtype).reshape(shape)
    return tensors


def load_safetensors_dir(directory: str, dtype: str = "float32", weights: str = DENSE
                         ) -> tuple[ModelSpec, dict[str, Any]]:
    """Spec and parameters of a Hugging Face folder of any of hx's families, mapped (module
    docstring); each tensor found by its family's name (``Family.from_hf``: fused ones split).

    Args:
      dtype: the dtype of dense tensors (``spec.dtype``); a tensor already in it is the
        file's own bytes.
      weights: ``dense`` or a compressed format (``models.formats.FORMATS``) for the
        projection matrices and embedding tables (``spec.weight_format``,
        ``spec.embedding_format``).
    Raises:
      HxError: missing config, weights or shards, a corrupt file, an unsupported model type,
        dtype or quantization, a missing tensor or one of the wrong size.
    """
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise HxError(f"{directory}: expected config.json and *.safetensors files")
    files = _shard_files(directory)
    with open(config_path) as f:
        config = json.load(f)
    fp8 = read_quantization(dict(config), directory)
    spec = spec_from_config(config, directory).replace(
        dtype=dtype, weight_format=weights, embedding_format=weights)
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(map_safetensors(path))
    if fp8 is not None:
        tensors = Dequantized(tensors, fp8)
    want = numpy_dtype(dtype)

    fam = spec.model_family

    def take(layer, op, path, shape):
        try:
            array = fam.from_hf(spec, tensors, layer, op, path)
        except KeyError:
            raise HxError(f"{directory}: tensor {fam.hf_name(layer, op, path)} is "
                          "missing") from None
        if array.dtype == E4M3:  # FP8 codes are a matrix only with their block scales
            raise HxError(f"{directory}: tensor {fam.hf_name(layer, op, path)} is FP8 but "
                          "config.json has no quantization_config giving its block scales")
        return held_tensor(array, shape, want, spec.matrix_format(path))

    return spec, weight_tree(spec, take)


def hf_tensors(spec: ModelSpec, params: dict[str, Any], layers) -> dict[str, np.ndarray]:
    """The inverse of ``load_safetensors_dir`` for dense trees: Hugging Face names -> (out, in)
    arrays of the decoder layers ``layers`` (plus the embedding when they hold the first, the
    final norm and LM head when they hold the last), for writing a checkpoint a shard at a
    time (``scripts/write_checkpoint.py``)."""
    def flat(path: str, a: np.ndarray) -> np.ndarray:
        """hx's (out..., in...) as the file's (out, in): wo contracts its last two axes."""
        if a.ndim == 1 or not path.endswith("kernel"):
            return a.reshape(-1)
        out, _ = spec.product_shape(path, a.shape)
        return a.reshape(out, -1)

    t = {}
    ops = [(i, op) for i in layers for op in LAYER_OPS]
    ops = ([(None, EMBED)] if 0 in layers else []) + ops + (
        [(None, HEAD)] if spec.n_layers - 1 in layers else [])
    for layer, op in ops:
        tree = params[op] if layer is None else params[layer_key(layer)][op]
        for path in (spec if layer is None else spec.layer_spec(layer)).op_weight_shapes(op):
            leaf = tree
            for key in path.split("/"):
                leaf = leaf[key]
            t[spec.model_family.hf_name(layer, op, path)] = np.ascontiguousarray(
                flat(path, leaf))
    return t


def write_hf_folder(directory: str, spec: ModelSpec, shards: int,
                    params_for: Callable[[list[int]], dict[str, Any]],
                    log: Callable[[str], None] = lambda message: None) -> int:
    """Write a Hugging Face Llama folder of ``spec``'s shapes: ``config.json`` and ``shards``
    safetensors files of consecutive layers (EMBED with the first, HEAD with the last), named
    as the Hub names shards, with their ``INDEX`` when there are several. ``params_for(layers)``
    gives a tree holding at least those layers' weights (and EMBED's or HEAD's in the first and
    last shard), so a large model can be drawn a shard at a time; ``log`` gets a line per
    shard.

    Returns:
      bytes of the tensors written.
    """
    from safetensors.numpy import save_file

    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(spec.model_family.hf_config(spec), f, indent=2)
    weight_map, total = {}, 0
    for shard, layers in enumerate(np.array_split(np.arange(spec.n_layers), shards)):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        layers = [int(i) for i in layers]
        tensors = hf_tensors(spec, params_for(layers), layers)
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        nbytes = sum(a.nbytes for a in tensors.values())
        total += nbytes
        log(f"{name}: layers {layers[0]}-{layers[-1]}, {nbytes / 2**30:.2f} GiB")
        del tensors
    if shards > 1:
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2)
    return total
