"""Model families: what differs between the decoders hx runs, one object per family.

A family (Llama, Qwen3, OPT, ...) gives everything hx needs to size, load, place and run a
model of it, so that nothing outside the family's own module tests which family a model is:

* **shapes**: ``weight_shapes(spec)``, the weights each op owns, keyed by hx's parameter paths
  (a shared vocabulary: ``wq/kernel`` (H, E, D), ``wo/kernel`` (D, H, E), ``w_up/kernel``
  (F, D), ``attn_norm/scale`` (D,), ``embedding`` (V, D), ...; matrices in the checkpoint's
  (out..., in) layout). The bytes table, the cost model (FLOPs from the matrices) and tensor
  parallelism (``models.sharding``, by path) read it.
* **math**: ``modules()``, the Flax module of each op (``module(spec, op)``: a layer's, where
  layers differ in kind; ``models.decoder.apply_op``); each maps
  its layer onto the seven ops ``Q K V SCORE OUT MLP1 MLP2`` that hx places.
* **files**: ``hf_name`` / ``gguf_name`` of each tensor, ``from_hf`` / ``gguf_rows`` to split
  a fused checkpoint tensor, ``gguf_rope_permuted`` (rows llama.cpp's converter permutes),
  ``gguf_offset`` (a constant it adds), and the spec built from a ``config.json``
  (``spec_from_hf``, through ``ConfigReader``) or GGUF metadata (``spec_from_gguf``, through
  ``MetadataReader``), refusing any field or key that would change the math and that hx does
  not implement.

The registry (``FAMILIES``: family name -> its module) is the one list of families; a family's
module defines ``FAMILY``. Modules load on first use (their Flax code imports JAX; shapes and
names do not need it, but the module is one file), so importing this module costs nothing.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from hx.errors import HxError
from hx.models.ops import HEAD

TABLE = "embedding"  # the token-embedding table's path in EMBED and HEAD (shared when tied)
# llama.cpp's per-frequency RoPE factors (Llama 3.1's scaling): a tensor in the file, a
# hyperparameter to hx, which ``models.gguf_loader.read_metadata`` puts among the keys
ROPE_FREQS = "rope_freqs.weight"

# The registry: family name -> the module defining its ``FAMILY`` (one line a family).
FAMILIES: dict[str, str] = {
    "llama": "hx.models.llama",
    "mistral": "hx.models.mistral",
    "qwen2": "hx.models.qwen2",
    "qwen3": "hx.models.qwen3",
    "phi3": "hx.models.phi3",
    "opt": "hx.models.opt",
    "gemma3": "hx.models.gemma3",
    "mixtral": "hx.models.mixtral",
    "qwen3_moe": "hx.models.qwen3_moe",
    "qwen2_moe": "hx.models.qwen2_moe",
    "olmoe": "hx.models.olmoe",
    "deepseek_v2": "hx.models.deepseek_v2",
    "deepseek_v3": "hx.models.deepseek_v3",
    "gpt_oss": "hx.models.gpt_oss",
}

# config.json keys that never change a model's outputs at inference, whatever the family:
# bookkeeping, token ids (the tokenizer's business), training-only settings (dropout,
# initialisation) and output switches of transformers' forward; ``auto_map`` names a
# checkpoint's own modeling code, which transformers runs only when trusted to -- by default it
# runs its own class of the ``model_type``, as hx runs its family's.
HF_IGNORED = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "auto_map",
    "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "is_encoder_decoder",
    "chunk_size_feed_forward", "tokenizer_class", "_attn_implementation_autoset",
})


class KeyReader:
    """What ``ConfigReader`` and ``MetadataReader`` share: ``expect``, over their ``get`` and
    ``setting``."""

    where: str

    def get(self, key: str, default: Any = None) -> Any:
        raise NotImplementedError

    def setting(self, key: str) -> str:
        raise NotImplementedError

    def expect(self, key: str, allowed: tuple, default: Any = None) -> Any:
        """The value of ``key`` (``default`` where absent), which must be one of ``allowed``.

        Raises:
          HxError: another value: one line naming the key, the value and what hx runs.
        """
        value = self.get(key, default)
        if value not in allowed:
            raise HxError(f"{self.where}: {self.setting(key)}={value!r}, which hx does not "
                          f"implement (it runs {' or '.join(map(repr, allowed))})")
        return value


class ConfigReader(KeyReader):
    """Reads a Hugging Face ``config.json`` dict and refuses what hx would silently get wrong.

    Every key must be read (``get``, ``need``, ``expect``) or listed as ignored
    (``HF_IGNORED``, or the family's own ``ignored``); ``finish`` raises on any other key, so a
    field hx does not know is never dropped without a word.
    """

    def __init__(self, config: Mapping[str, Any], where: str, ignored: frozenset = frozenset()):
        self.config, self.where = dict(config), where
        self.seen = set(HF_IGNORED) | set(ignored)

    def get(self, key: str, default: Any = None) -> Any:
        """``config[key]``, or ``default`` where absent or null."""
        self.seen.add(key)
        value = self.config.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        """``config[key]``.

        Raises:
          HxError: the key is missing.
        """
        self.seen.add(key)
        if self.config.get(key) is None:
            raise HxError(f"{self.where}/config.json lacks {key!r}")
        return self.config[key]

    def setting(self, key: str) -> str:
        """Where ``key`` is set, for ``expect``'s refusal: ``config.json sets KEY``."""
        return f"config.json sets {key}"

    def finish(self) -> None:
        """Raises HxError naming every key neither read nor ignored."""
        unknown = sorted(set(self.config) - self.seen)
        if unknown:
            raise HxError(f"{self.where}: config.json has field(s) hx does not implement: "
                          f"{', '.join(unknown)}; hx refuses a field it does not know rather "
                          "than run a model whose math it might change")


class MetadataReader(KeyReader):
    """Reads a GGUF file's model keys and refuses what hx would silently get wrong: the GGUF
    twin of ``ConfigReader``.

    The model keys are llama.cpp's ``{architecture}.*`` (``LLM_KV_*`` in its
    ``src/llama-arch.cpp``), named here without the prefix (``attention.head_count``), and the
    hyperparameters it keeps as tensors (``ROPE_FREQS``, ``tensor``); ``general.*``
    (bookkeeping) and ``tokenizer.*`` (the tokenizer's) are not model keys. Every model key
    must be read (``get``, ``need``, ``expect``, ``tensor``); ``finish`` raises on any other.
    """

    def __init__(self, meta: Mapping[str, Any], where: str):
        self.meta, self.where = meta, where
        self.arch = meta["general.architecture"]
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        """``{arch}.{key}``, or ``default`` where absent."""
        self.seen.add(f"{self.arch}.{key}")
        value = self.meta.get(f"{self.arch}.{key}")
        return default if value is None else value

    def tensor(self, name: str) -> list[float] | None:
        """The values of the hyperparameter tensor ``name`` (``ROPE_FREQS``); None: absent."""
        self.seen.add(name)
        return self.meta.get(name)

    def need(self, key: str) -> Any:
        """``{arch}.{key}``.

        Raises:
          HxError: the key is missing.
        """
        value = self.get(key)
        if value is None:
            raise HxError(f"{self.where}: GGUF metadata lacks {self.arch}.{key}; the file is "
                          "incomplete")
        return value

    def setting(self, key: str) -> str:
        """Where ``key`` is set, for ``expect``'s refusal: ``GGUF sets ARCH.KEY``."""
        return f"GGUF sets {self.arch}.{key}"

    def finish(self) -> None:
        """Raises HxError naming every model key not read."""
        unknown = sorted(k for k in self.meta if (k.startswith(f"{self.arch}.") or
                                                  k == ROPE_FREQS) and k not in self.seen)
        if unknown:
            raise HxError(f"{self.where}: GGUF sets {', '.join(unknown)}, which hx does not "
                          f"implement for {self.arch}; hx refuses a key it does not know rather "
                          "than run a model whose math it might change")


@dataclass(frozen=True)
class GraphLayer:
    """A decoder layer that is Llama's -- RMSNorm, q/k/v projections, RoPE (rotate-half),
    grouped-query attention over the KV cache, the output projection and residual add, RMSNorm,
    SwiGLU, the down projection and residual add (``models.llama``) -- with its relatives'
    switches: what a host kernel runs as one graph (``hx.host_compute.ggml_layer``).

    Attributes:
      qkv_bias: q, k, v add biases (Qwen2).
      qk_norm: q and k RMS-normed per head before RoPE (Qwen3).
      inv_frequencies: spec -> RoPE's inverse frequencies (E/2,) float32, scaling applied.
      qk_norm_whole: with ``qk_norm``, over the whole projection rather than per head (OLMoE).
    """

    qkv_bias: bool
    qk_norm: bool
    inv_frequencies: Callable[[Any], Any]
    qk_norm_whole: bool = False


@dataclass(frozen=True)
class Family:
    """What one model family is (module docstring); subclasses override what differs.

    Attributes:
      name: the registry key (``ModelSpec.family``).
      hf_model_types: the ``model_type`` values of its ``config.json`` files.
      gguf_architectures: ``general.architecture`` values of its GGUF files (llama.cpp's
        names; empty where llama.cpp defines none).
      hf_layer_names / hf_model_names: Hugging Face tensor name of each (op, path), within
        ``model.layers.{i}.`` for a layer's ops.
      gguf_layer_names / gguf_model_names: llama.cpp's, within ``blk.{i}.``.
      gguf_rope_permuted: the paths whose rows llama.cpp's converter permuted (its Llama
        RoPE layout), undone at load.
    """

    name: str
    hf_model_types: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    hf_layer_names: Mapping[tuple[str, str], str] = field(default_factory=dict)
    hf_model_names: Mapping[tuple[str, str], str] = field(default_factory=dict)
    gguf_layer_names: Mapping[tuple[str, str], str] = field(default_factory=dict)
    gguf_model_names: Mapping[tuple[str, str], str] = field(default_factory=dict)
    gguf_rope_permuted: tuple[str, ...] = ()
    # tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3): the weight at each path (by
    # its last two keys) split along (axis letter, axis): q/k/v by heads (column-parallel),
    # OUT by heads and MLP2 by F (row-parallel), MLP1 by F, the table by the vocabulary;
    # any other weight (norms, row-parallel biases) whole on every device
    tp_axes: ClassVar[Mapping[str, tuple[str, int]]] = {
        "wq/kernel": ("H", 0), "wq/bias": ("H", 0), "wk/kernel": ("K", 0), "wk/bias": ("K", 0),
        "wv/kernel": ("K", 0), "wv/bias": ("K", 0), "wo/kernel": ("H", 1),
        "w_gate/kernel": ("F", 0), "w_up/kernel": ("F", 0), "w_up/bias": ("F", 0),
        "w_down/kernel": ("F", 1), TABLE: ("V", 0)}
    # the family's own config.json keys that do not change its outputs, beside ``HF_IGNORED``
    # (each proven so in tests/test_families.py)
    hf_ignored: ClassVar[frozenset] = frozenset()
    # SCORE is softmax(q k^T / sqrt(E)) v over K heads of E keys and values, so the host's
    # attention kernels (``hx.host_compute``: XLA's blocked kernel, numpy's) may run it; False:
    # the family's own SCORE module runs wherever SCORE is placed (latent attention)
    host_attention: ClassVar[bool] = True
    # the value of a norm's ``scale`` that leaves the normed x as it is (random weights'
    # norms): 1 where a norm multiplies by its scale, 0 for Gemma's x (1 + w)
    norm_identity: ClassVar[float] = 1.0

    # -- shapes ------------------------------------------------------------------------------
    def weight_shapes(self, spec) -> dict[str, dict[str, tuple[int, ...]]]:
        """op -> {path: logical shape} of every op's weights (``ModelSpec.op_weight_shapes``
        reads it; paths as in the module docstring)."""
        raise NotImplementedError

    def matrix_kind(self, path: str) -> str | None:
        """``kernel`` for a projection matrix (held in ``spec.weight_format``), ``table`` for
        an embedding table (``spec.embedding_format``), ``index`` for an int32 index array
        (the ids of the routed experts a part of an MoE layer holds:
        ``ModelSpec.expert_part``), None for norms and biases (dense)."""
        if path.endswith("kernel"):
            return "kernel"
        if path.endswith("/ids"):
            return "index"
        if path in (TABLE, "positions"):
            return "table"
        return None

    # the matrices whose products contract their last two axes: OUT's (D, H, E)
    two_axes_contracted: ClassVar[frozenset] = frozenset({"wo/kernel"})

    def contracted_axes(self, path: str) -> int:
        """How many trailing axes of the matrix at ``path`` its product contracts: two for
        ``two_axes_contracted``, one for every other matrix."""
        return 2 if path in self.two_axes_contracted else 1

    def flops(self, spec, op: str, rows: int) -> float:
        """FLOPs of ``op``'s products over ``rows`` rows: 2 per multiply-add, one per element
        of each of its matrices per row (Kaplan et al. 2020, §2.1); HEAD's table once per
        row. Norms, biases and activations are left out (a few FLOPs an element)."""
        return 2.0 * rows * sum(math.prod(shape) for path, shape
                                in spec.op_weight_shapes(op).items()
                                if self.matrix_kind(path) == "kernel"
                                or (op == HEAD and path == TABLE))

    # -- math --------------------------------------------------------------------------------
    def modules(self) -> Mapping[str, type]:
        """op -> the Flax module computing it (``models.decoder.apply_op``)."""
        raise NotImplementedError

    def module(self, spec, op: str) -> type:
        """The Flax module computing ``op`` under ``spec`` (a layer's, ``ModelSpec.layer_spec``):
        ``modules()``'s, unless the family's layers differ in kind."""
        return self.modules()[op]

    def graph_layer(self, spec) -> GraphLayer | None:
        """The family's decoder layer as one host graph (``GraphLayer``), or None where it is
        not that graph's (hx then runs its ops one by one)."""
        return None

    # -- files -------------------------------------------------------------------------------
    def spec_from_hf(self, config: Mapping[str, Any], where: str):
        """``ModelSpec`` of a ``config.json`` dict (``where``: its folder, for messages).

        Raises:
          HxError: a required key is missing, or a field changes the math in a way hx does
            not implement.
        """
        raise NotImplementedError

    def spec_from_gguf(self, meta: Mapping[str, Any], where: str, has_output: bool):
        """``ModelSpec`` of GGUF metadata (``models.gguf_loader.read_metadata``), as llama.cpp
        reads it.

        Raises:
          HxError: llama.cpp defines no GGUF of this family here, a key is missing, or a key
            changes the math in a way hx does not implement.
        """
        raise HxError(f"{where}: hx reads {self.name} models from Hugging Face folders, "
                      "not GGUF files")

    def hf_config(self, spec) -> dict:
        """A ``config.json`` of ``spec``'s shapes (a checkpoint hx writes)."""
        raise HxError(f"hx writes no {self.name} checkpoints")

    def hf_name(self, layer: int | None, op: str, path: str) -> str:
        """The Hugging Face tensor name of ``path`` of ``op`` (of layer ``layer``, None for
        EMBED and HEAD)."""
        if layer is None:
            return self.hf_model_names[(op, path)]
        return f"model.layers.{layer}.{self.hf_layer_names[(op, path)]}"

    def from_hf(self, spec, tensors: Mapping[str, Any], layer: int | None, op: str,
                path: str):
        """The file's array of ``path`` of ``spec`` (as the file has it: (out, in) or (n,)),
        from a checkpoint's mapped ``tensors``; a family with fused tensors slices them here.

        Raises:
          KeyError: the tensor is missing (the caller names it).
        """
        return tensors[self.hf_name(layer, op, path)]

    def gguf_name(self, layer: int | None, op: str, path: str) -> str:
        """llama.cpp's tensor name of ``path`` of ``op`` (a fused tensor's, where ``gguf_rows``
        cuts it)."""
        if layer is None:
            return self.gguf_model_names[(op, path)]
        return f"blk.{layer}.{self.gguf_layer_names[(op, path)]}"

    def gguf_rows(self, spec, op: str, path: str) -> tuple[int, int] | None:
        """The rows [start, stop) of the file's tensor (``gguf_name``) that hold ``path`` where
        llama.cpp keeps it fused with others; None: the whole tensor."""
        return None

    def gguf_offset(self, path: str) -> float:
        """The constant llama.cpp's converter added to ``path``'s tensor (subtracted at load,
        in float32); 0: none."""
        return 0.0


_LOADED: dict[str, Family] = {}


def family(name: str) -> Family:
    """The registered family ``name`` (its module imported on first use).

    Raises:
      HxError: no such family (the message lists them).
    """
    if name not in _LOADED:
        if name not in FAMILIES:
            raise HxError(f"unknown model family {name!r}; hx runs {', '.join(FAMILIES)}")
        _LOADED[name] = importlib.import_module(FAMILIES[name]).FAMILY
    return _LOADED[name]


def _find(test: Callable[[Family], bool], what: str, kind: str, value: Any,
          where: str) -> Family:
    for name in FAMILIES:
        fam = family(name)
        if test(fam):
            return fam
    known = sorted({v for n in FAMILIES for v in getattr(family(n), what)})
    raise HxError(f"{where}: unsupported {kind} {value!r}; hx runs {', '.join(known)}")


def for_model_type(model_type: str, where: str) -> Family:
    """The family whose ``config.json`` says ``model_type``.

    Raises:
      HxError: none does (the message lists the model types hx runs).
    """
    return _find(lambda f: model_type in f.hf_model_types, "hf_model_types", "model_type",
                 model_type, where)


def for_gguf(architecture: str, where: str) -> Family:
    """The family of a GGUF whose ``general.architecture`` is ``architecture``.

    Raises:
      HxError: none (the message lists the architectures hx reads).
    """
    return _find(lambda f: architecture in f.gguf_architectures, "gguf_architectures",
                 "architecture", architecture, where)
