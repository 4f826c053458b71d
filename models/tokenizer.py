"""Tokenizer built with the ``tokenizers`` library from a GGUF file's metadata or an HF folder.

GGUF: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) from ``tokenizer.ggml.tokens`` and
``.merges``; tokens of type CONTROL become special tokens that match as a whole in text; the
pre-tokenizer follows ``tokenizer.ggml.pre`` (llama.cpp's names). The chat template stored in the
file is rendered with jinja2 in a sandbox, as Hugging Face does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from hx.errors import HxError

GGUF_TOKEN_TYPE_CONTROL = 3

# llama.cpp pre-tokenizer names -> equivalent `tokenizers` pre-tokenizers. Only names whose
# splitting rule is exactly GPT-2's byte-level regex (optionally after single-digit splits) are
# listed; other names use different regexes and would tokenize wrongly, so they are refused.
_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}


@dataclass
class Tokenizer:
    """Text <-> token ids, plus the model's special tokens and chat template.

    Attributes:
      backend: the ``tokenizers.Tokenizer`` doing the work.
      bos_id / eos_id: begin/end-of-sequence ids (``None`` when the model has none).
      add_bos: prepend ``bos_id`` when encoding a prompt.
      chat_template: jinja2 template of the model, or ``None``.
    """

    backend: tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool = False
    chat_template: str | None = None
    _template: Any = field(default=None, repr=False)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], path: str) -> "Tokenizer":
        """Build from the ``tokenizer.ggml.*`` keys of a GGUF file.

        Raises:
          HxError: the tokenizer model or pre-tokenizer is one hx does not implement.
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise HxError(f"{path}: tokenizer model {kind!r} is not supported; hx reads "
                          "byte-level BPE ('gpt2') tokenizers")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise HxError(f"{path}: pre-tokenizer {pre!r} is not supported; supported: "
                          f"{', '.join(sorted(_PRE_TOKENIZERS))}")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                                  byte_fallback=False))
        backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([
            AddedToken(tok, special=True, normalized=False)
            for tok, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_CONTROL])
        return cls(backend=backend,
                   bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_id=meta.get("tokenizer.ggml.eos_token_id"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, directory: str) -> "Tokenizer":
        """Build from ``tokenizer.json`` (+ ``tokenizer_config.json``) in a Hugging Face folder.

        Raises:
          HxError: ``tokenizer.json`` is missing.
        """
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise HxError(f"{directory}: no tokenizer.json; hx needs the fast-tokenizer file")
        backend = tokenizers.Tokenizer.from_file(path)
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if tok else None

        return cls(backend=backend, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"),
                   add_bos=bool(config.get("add_bos_token", False)),
                   chat_template=config.get("chat_template"))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id``."""
        return self.backend.id_to_token(token_id)

    def render_chat(self, prompt: str | list[dict[str, str]]) -> str:
        """Render a user prompt (or a list of ``{"role", "content"}`` messages) with the model's
        chat template, ending with the assistant turn's header.

        Raises:
          HxError: the model has no chat template.
        """
        if not self.chat_template:
            raise HxError("this model has no chat template; run without --chat")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        special = {"bos_token": self.token(self.bos_id) if self.bos_id is not None else "",
                   "eos_token": self.token(self.eos_id) if self.eos_id is not None else ""}
        return self._template.render(messages=messages, add_generation_prompt=True, **special)
