"""Write a Hugging Face Llama checkpoint folder of a preset's layer shapes with random weights.

Usage: python scripts/write_checkpoint.py OUT_DIR [--model llama2-7b:8L] [--dtype bfloat16]
       [--shards 2]

Writes ``config.json``, ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json`` (the layout ``transformers``' ``save_pretrained`` uses), and
SmolLM2's ``tokenizer.json`` (from the shipped GGUF), so ``hx generate -m OUT_DIR`` takes text.
The vocabulary is the tokenizer's (49,152 ids) rather than the preset's, so every token the
tokenizer makes has an embedding row; the layers have the preset's shapes. Llama-2-7B:8L in
bfloat16 is 3.76 GiB (8 layers of 404 MB and two 403 MB embedding tables), the full 32 layers
13.5 GB.

Weights come from ``models.random_weights`` (seeded, one tensor at a time); each shard is
drawn, written and dropped before the next, so memory peaks at about one shard. Takes about
a minute per GB on the 2-core development VM.
"""

from __future__ import annotations

import argparse
import os

from hx.devices import configure_runtime
from hx.models.loader import load, load_spec
from hx.models.random_weights import random_params
from hx.models.safetensors_loader import write_hf_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="llama2-7b:8L")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    configure_runtime()
    smollm = load()  # the tokenizer, and its vocabulary size
    spec = load_spec(args.model, args.dtype).replace(
        vocab_size=smollm.spec.vocab_size, tie_embeddings=False, weight_format="dense",
        embedding_format="dense")
    os.makedirs(args.out, exist_ok=True)
    smollm.tokenizer.backend.save(os.path.join(args.out, "tokenizer.json"))
    total = write_hf_folder(  # each shard's layers as drawn for the whole model
        args.out, spec, args.shards, lambda layers: random_params(spec, seed=0, layers=layers),
        lambda line: print(line, flush=True))
    print(f"{args.out}: {spec.n_layers} layers of {spec.name}, {total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
