"""Time llama.cpp (``llama-cpp-python``) greedy generation at batch 1; prints one JSON line.

Usage: PYTHON_WITH_LLAMA_CPP scripts/llama_cpp_decode.py MODEL.gguf PROMPT_IDS_JSON NEW THREADS

Takes seconds (one prefill and NEW decode steps at batch 1).

Runs under any interpreter that has ``llama_cpp`` (hx need not be installed there): prefill of
the given token ids with ``Llama.eval``, then ``NEW - 1`` decode steps, each the argmax of the
last logits fed back with ``Llama.eval``. Prints {"prefill_s", "decode_s", "decode_tok_s",
"tokens"}: decode tokens/s counts the tokens after the first, as hx's ``decode_tok_s`` does.
"""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def last_logits(llm: Llama) -> np.ndarray:
    """Logits of the last evaluated token (kept by llama.cpp's context; ``Llama.scores``
    holds them only with ``logits_all``)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def main() -> None:
    path, ids, new, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(
        sys.argv[4])
    llm = Llama(model_path=path, n_ctx=len(ids) + new + 8, n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)
    start = time.perf_counter()
    llm.eval(ids)
    token = int(np.argmax(last_logits(llm)))
    prefilled = time.perf_counter()
    tokens = [token]
    for _ in range(new - 1):
        llm.eval([token])
        token = int(np.argmax(last_logits(llm)))
        tokens.append(token)
    done = time.perf_counter()
    print(json.dumps({"prefill_s": prefilled - start, "decode_s": done - prefilled,
                      "decode_tok_s": (new - 1) / (done - prefilled), "tokens": tokens}))


if __name__ == "__main__":
    main()
