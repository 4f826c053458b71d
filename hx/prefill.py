"""A batch of prompts into the KV cache: checked against the context (``check_prompts``),
left-padded to one length (``left_pad``) and prefilled in chunks (``prefill_in_chunks``), for
the engine's static batches, throughput mode's joins (``hx.continuous``) and the benchmarks
(``hx.measure.bench``). ``hx.generate``'s docstring gives the padding rules."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from hx.errors import HxError
from hx.executor import Executor
from hx.models.layers import Step
from hx.models.spec import ModelSpec
from hx.models.tensors import step_limit
from hx.workload import prefill_chunks


def check_prompts(lengths: Sequence[int], spec: ModelSpec, labels: Sequence[str] | None = None
                  ) -> None:
    """Reject empty prompts and prompts that leave no room in the context for a new token.

    Raises:
      HxError: naming the first offending prompt, its length and the context length.
    """
    for i, n in enumerate(lengths):
        label = labels[i] if labels else str(i)
        if n == 0:
            raise HxError(f"prompt {label} is empty after tokenization")
        if n >= spec.context_length:
            raise HxError(f"prompt {label} has {n} tokens but the model's context is "
                          f"{spec.context_length} tokens (one is needed for the answer); "
                          "shorten the prompt")


def run_prefill(executor: Executor, tokens: np.ndarray, step: Step, caches: list,
                chunk: int | None, on_chunk: Callable[[int, int], None] | None = None
                ) -> tuple:
    """Run a left-padded prompt batch through ``executor`` in chunks of at most ``chunk``
    tokens (``hx.workload.prefill_chunks``; None: one step): ``prefill_in_chunks``."""
    return prefill_in_chunks(executor, tokens, step, caches,
                             prefill_chunks(tokens.shape[1], chunk, step_limit(executor.spec)),
                             on_chunk)


def prefill_in_chunks(executor: Executor, tokens: np.ndarray, step: Step, caches: list,
                      chunks: Sequence[int], on_chunk: Callable[[int, int], None] | None = None
                      ) -> tuple:
    """Run a left-padded prompt batch through ``executor`` in steps of ``chunks`` tokens. Each
    chunk writes its keys and values at its own cache slots and attends over every slot
    written before it, so the logits equal an unchunked prefill's.

    Args:
      tokens: (B, T) int32 prompt tokens; step: the prefill ``Step`` of all T tokens.
      caches: per-layer KV caches (consumed).
      chunks: tokens per step, summing to T.
      on_chunk: called with (chunk index from 1, number of chunks) before each chunk runs.
    Returns:
      (logits (B, V) of the last position, updated caches).
    """
    start = int(step.write_index)
    logits = None
    for index, c in enumerate(chunks, 1):
        if on_chunk is not None:
            on_chunk(index, len(chunks))
        part = slice(start, start + c)
        logits, caches = executor.run(
            "prefill", tokens[:, part],
            Step(step.positions[:, part], np.int32(start), step.kv_start), caches)
        start += c
    return logits, caches


def left_pad(prompts: Sequence[Sequence[int]], padded: int, pad_id: int) -> tuple[np.ndarray, Step]:
    """Prompts left-padded to ``padded`` tokens with ``pad_id``, and their prefill ``Step``
    written from slot 0: (tokens (G, T) int32, Step with positions (G, T) counting from each
    prompt's first token (0 over its padding) and kv_start (G,) = T - its length)."""
    tokens = np.full((len(prompts), padded), pad_id, np.int32)
    kv_start = np.zeros(len(prompts), np.int32)
    for r, ids in enumerate(prompts):
        tokens[r, padded - len(ids):] = ids
        kv_start[r] = padded - len(ids)
    positions = np.maximum(np.arange(padded, dtype=np.int32)[None, :] - kv_start[:, None], 0)
    return tokens, Step(positions, np.int32(0), kv_start)
