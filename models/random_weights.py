"""Random weights of a model's real shapes, for benchmarks, plans and tests of models hx does
not have on disk (``loader.load("llama2-7b:8L")``).

The tree is exactly ``models.decoder.init_params``' (built from ``ModelSpec.
op_weight_shapes``, which names the same paths), but drawn with numpy rather than through Flax,
so that gigabytes of weights come fast and without temporary copies:

* matrices and biases: float32 uniform on [-a, a] with a = 0.02·√3, i.e. standard deviation
  0.02 like ``init_params``' normal initialiser (numpy draws uniform float32 ~5× faster than
  normal);
* norm scales: the identity (``Family.norm_identity``: ones; Gemma's zeros);
* a tied model's ``HEAD/embedding`` is the very array of ``EMBED/embedding``;
* in ``spec.dtype``: a bfloat16 or float16 tensor is the float32 one rounded (to nearest even),
  so the three dtypes hold the same model; a matrix in a compressed format
  (``spec.weight_format``, ``spec.embedding_format``) is the float32 one compressed
  (``models.formats.quantize``), one matrix at a time.

Each tensor is drawn, in 1 MiB chunks, straight into its final array, so memory peaks at the
weights' own size, and has its own generator seeded by (seed, its path), so its values depend
neither on the other tensors nor on the thread that draws it: ``llama2-7b:2L``'s layers equal
the first two of ``llama2-7b:8L``. On the shared 2-core development VM 8 layers of Llama-2-7B
(7 GiB) take 7-16 s, 2 layers 2-4 s.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import numpy as np

from hx.devices import available_host_memory
from hx.errors import HxError
from hx.models.buffers import aligned_copy, aligned_empty
from hx.models.formats import DENSE
from hx.models.holding import hold
from hx.models.tensors import layer_key, weight_tree
from hx.models.spec import ModelSpec, numpy_dtype

STD = 0.02
_HALF_WIDTH = STD * 3**0.5  # uniform on [-a, a] has standard deviation a / sqrt(3)
_CHUNK = 1 << 18  # elements drawn and scaled per pass: 1 MiB, stays in cache


def _uniform(shape: tuple[int, ...], seed: int, path: str, dtype=np.float32) -> np.ndarray:
    """A fresh array of ``shape`` and ``dtype``, uniform with standard deviation ``STD``: drawn
    in float32 (into the array itself, or a chunk at a time and rounded into it)."""
    out = aligned_empty(shape, dtype)
    flat = out.reshape(-1)  # a view: ``out`` is contiguous
    scratch = None if out.dtype == np.float32 else np.empty(min(_CHUNK, flat.size), np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
    half, width = np.float32(0.5), np.float32(2 * _HALF_WIDTH)
    for i in range(0, flat.size, _CHUNK):
        part = flat[i:i + _CHUNK] if scratch is None else scratch[:min(_CHUNK, flat.size - i)]
        rng.random(dtype=np.float32, out=part)  # [0, 1)
        part -= half
        part *= width
        if scratch is not None:
            flat[i:i + part.size] = part
    return out


def _draw(shape: tuple[int, ...], seed: int, path: str, dtype, fmt: str):
    """``_uniform`` in ``dtype``, or drawn in float32 and held in compressed format ``fmt``."""
    if fmt == DENSE:
        return _uniform(shape, seed, path, dtype)
    return hold(_uniform(shape, seed, path), fmt)


def random_params(spec: ModelSpec, seed: int = 0, workers: int | None = None,
                  layers: Iterable[int] | None = None) -> dict[str, Any]:
    """Random numpy weights in ``spec.dtype`` with ``init_params(spec)``'s tree layout.

    Tensors are drawn on ``workers`` threads (default: one per CPU; numpy releases the GIL
    while it draws and scales); the values do not depend on the number of threads. With
    ``layers``, only those decoder layers are drawn (with EMBED and HEAD): a checkpoint is
    written a shard at a time.

    Returns:
      ``{"EMBED": {"embedding": (V,D)}, "layer_i": {"Q": {"attn_norm": {"scale": (D,)},
      "wq": {"kernel": (H,E,D)[, "bias": (H,E)]}}, ...}, "HEAD": {...}}``, host arrays of
      ``spec.dtype``, compressed matrices as subtrees of their formats' arrays
      (``spec.weight_bytes`` in all).
    Raises:
      HxError: the weights need more bytes than the host has available (the message gives the
        bytes and suggests fewer layers).
    """
    layers = range(spec.n_layers) if layers is None else sorted(layers)
    need = spec.weight_bytes - spec.layers_weight_bytes(
        sorted(set(range(spec.n_layers)) - set(layers)))
    dtype = numpy_dtype(spec.dtype)
    available = available_host_memory()
    if available is not None and need > available:
        raise HxError(f"random weights of {spec.name} need {need / 2**30:.1f} GiB of host "
                      f"memory but {available / 2**30:.1f} GiB is available; ask for fewer "
                      "layers, e.g. NAME:2L")
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        def take(layer, op, path, shape):
            if path.split("/")[-1] == "scale":  # a norm's scale
                return aligned_copy(np.full(shape, spec.model_family.norm_identity, dtype))
            name = "/".join(filter(None, (layer_key(layer) if layer is not None else "", op,
                                          path)))
            return pool.submit(_draw, shape, seed, name, dtype, spec.matrix_format(path))

        return _results(weight_tree(spec, take, layers))


def _results(tree: Any) -> Any:
    """The tree with every future replaced by its result."""
    if isinstance(tree, dict):
        return {k: _results(v) for k, v in tree.items()}
    return tree.result() if isinstance(tree, Future) else tree


class NoTokenizer:
    """The tokenizer of a random-weight model, which has none.

    Token-level work runs (``eos_id`` and ``bos_id`` are None, ``Engine.generate_ids`` and
    ``last_logits`` take ids); turning text into ids raises, and ids decode to "" (random weights
    produce no meaningful text).
    """

    bos_id = eos_id = chat_template = None
    add_bos = False

    def __init__(self, model_name: str):
        self.model_name = model_name

    def _no_text(self):
        raise HxError(f"{self.model_name} has random weights and no tokenizer, so it takes no "
                      "text; give a GGUF file or a Hugging Face folder to generate text "
                      "(presets serve hx plan, bench and ablate)")

    def encode(self, text: str) -> list[int]:
        """Raises HxError: a random-weight model has no vocabulary."""
        self._no_text()

    def render_chat(self, prompt) -> str:
        """Raises HxError: a random-weight model has no chat template."""
        self._no_text()

    def decode(self, ids: list[int]) -> str:
        """The empty string: random weights produce ids, not text."""
        return ""

    def token(self, token_id: int) -> None:
        """None: no token has a text form."""
        return None
