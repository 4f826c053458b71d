"""A stand-in for OPT's tokenizer in a Hugging Face cache, so that FlexGen runs offline.

Usage: python scripts/flexgen_tokenizer.py --hf-home /tmp/hf [--repo facebook/opt-30b ...]

FlexGen (PyPI ``flexgen`` 0.1.8, ``flexgen/flex_opt.py`` ``run_flexgen``) always loads
``AutoTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")`` -- whatever
``--model`` says -- and with dummy weights (``--path _DUMMY_``) uses it only to left-pad one
prompt to ``--prompt-len`` tokens (``get_test_inputs``); the outputs are never decoded. The token
ids do not matter to throughput (every shape is set by the prompt length, the batch and the
model), but the tokenizer has to load, and the GPU machines cannot reach the hub.

This writes a small GPT-2-style byte-level BPE tokenizer (OPT's scheme, its vocabulary a few
hundred tokens trained on a few sentences, not OPT's 50265) laid out as the hub cache holds a
downloaded repository: ``$HF_HOME/hub/models--facebook--opt-30b/refs/main`` names a snapshot
and ``snapshots/<hash>/`` holds tokenizer.json, vocab.json, merges.txt, tokenizer_config.json,
special_tokens_map.json and config.json. With ``HF_HUB_OFFLINE=1`` and the same ``HF_HOME``,
``from_pretrained("facebook/opt-30b")`` then resolves locally. The special tokens have OPT's ids:
``<s>`` 0, ``<pad>`` 1 (FlexGen masks ``input_ids != 1``), ``</s>`` 2 (also OPT's BOS, put in
front of every text), ``<unk>`` 3. Every id is far below OPT's embedding rows (50272).

Needs only ``tokenizers`` (and ``transformers`` for the check it runs at the end, skipped with
``--no-check``). The snapshot hash is the SHA-1 of the files, so a rerun writes the same tree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0, 1, 2, 3, as in OPT's vocab.json

# FlexGen's prompt (get_test_inputs) and some ordinary English, so that the prompt takes a few
# tokens: it must fit the warmup's 32-token padding (padding="max_length" does not truncate).
CORPUS = [
    "Paris is the capital city of France.",
    "Paris is the capital city of",
    "The quick brown fox jumps over the lazy dog.",
    "A large language model generates text one token at a time, and a batch of prompts "
    "decodes together.",
    "Weights, activations and the attention cache can live in GPU memory, in CPU memory or "
    "on disk.",
    "hello world, Hello World! 0123456789",
]

# What OPT's own config.json says for OPT-30B (AutoConfig falls back on it in some versions).
OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 50272,
    "hidden_size": 7168, "num_hidden_layers": 48, "num_attention_heads": 56,
    "ffn_dim": 28672, "max_position_embeddings": 2048, "word_embed_proj_dim": 7168,
    "do_layer_norm_before": True, "activation_function": "relu", "torch_dtype": "float16",
    "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
}


def build_files(vocab_size: int) -> dict[str, bytes]:
    """The tokenizer's files, name -> bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    # OPT puts </s> (its BOS) in front of every text.
    tok.post_processor = processors.TemplateProcessing(
        single="</s> $A", pair="</s> $A </s> $B", special_tokens=[("</s>", 2)])

    files: dict[str, bytes] = {"tokenizer.json": tok.to_str(pretty=True).encode()}
    vocab = tok.get_vocab()  # with the specials
    files["vocab.json"] = json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1])),
                                     ensure_ascii=False).encode()
    merges = json.loads(files["tokenizer.json"])["model"]["merges"]
    lines = [" ".join(m) if isinstance(m, list) else m for m in merges]
    files["merges.txt"] = ("#version: 0.2\n" + "\n".join(lines) + "\n").encode()
    specials = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>",
                "pad_token": "<pad>"}
    files["special_tokens_map.json"] = json.dumps(specials, indent=2).encode()
    files["tokenizer_config.json"] = json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "add_prefix_space": False,
        "errors": "replace", "model_max_length": 1000000000000000019884624838656,
        **specials}, indent=2).encode()
    files["config.json"] = json.dumps({**OPT_CONFIG, "_name_or_path": "flexgen-tokenizer-stand-in"},
                                      indent=2).encode()
    return files


def write_cache(hf_home: Path, repo: str, files: dict[str, bytes]) -> Path:
    """Lay files out as the hub cache holds repo's main revision; returns the snapshot folder."""
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name] + b"\0")
    rev = h.hexdigest()  # 40 hex digits, like a commit hash
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(rev)
    return snap


def check(hf_home: Path, repo: str) -> None:
    """Load the stand-in offline the way FlexGen does and pad its prompt to 32 tokens."""
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(repo, padding_side="left")
    ids = t(["Paris is the capital city of"], padding="max_length", max_length=32).input_ids[0]
    assert len(ids) == 32 and ids[0] == 1 and t.pad_token_id == 1, (ids, t.pad_token_id)
    print(f"  check: {type(t).__name__} pad_token_id={t.pad_token_id} "
          f"prompt -> {32 - ids.count(1)} tokens + {ids.count(1)} pads", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-home", type=Path, default=os.environ.get("HF_HOME"),
                    help="the HF_HOME to write into (default: $HF_HOME)")
    ap.add_argument("--repo", action="append",
                    help="hub repo id to stand in for (repeatable; default facebook/opt-30b, "
                         "the one FlexGen's flex_opt.py loads)")
    ap.add_argument("--vocab-size", type=int, default=400)
    ap.add_argument("--no-check", action="store_true",
                    help="do not load it back with transformers")
    args = ap.parse_args()
    if args.hf_home is None:
        ap.error("give --hf-home or set HF_HOME")
    files = build_files(args.vocab_size)
    for repo in args.repo or ["facebook/opt-30b"]:
        snap = write_cache(args.hf_home, repo, files)
        print(f"{repo}: {snap}", file=sys.stderr)
        if not args.no_check:
            check(args.hf_home, repo)


if __name__ == "__main__":
    main()
