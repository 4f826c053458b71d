"""Generation: prefill + decode with a KV cache over a batch of prompts (DESIGN §7).

Prompts of different lengths are left-padded to a common length T (rounded up to a multiple of
``PREFILL_BUCKET`` so few prefill shapes get compiled); each row's padding is masked out of
attention through ``Step.kv_start`` and its RoPE positions start at 0 at its first real token.
Decode then writes every row's new token into the same cache slot, so one compiled decode step
serves the whole batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np

from hx.devices import Devices
from hx.errors import HxError
from hx.executor import Executor
from hx.memory import check_fits
from hx.models.llama import Step
from hx.models.loader import Model
from hx.models.spec import ModelSpec
from hx.models.tokenizer import Tokenizer
from hx.plan import ExecutionPlan
from hx.sampling import SamplingParams, sample
from hx.timeline import Timeline
from hx.workload import Workload, new_tokens, padded_length, prefill_chunks

@dataclass
class Completion:
    """One prompt's result.

    Attributes:
      prompt_tokens: prompt length in tokens.
      token_ids: generated ids, without the stop token.
      text: ``token_ids`` decoded.
      finish_reason: ``"stop"`` (a stop token), ``"length"`` (max_new_tokens reached) or
        ``"context"`` (cut short of max_new_tokens: the batch's longest prompt and the new
        tokens filled the model's context).
      ttft_s: seconds from the start of the batch to its first token (prefill + first sample).
      decode_tok_s: this row's tokens after the first, per second of decode; None when the
        first token already ended it.
      compile_s: seconds spent before the timed run compiling (and running once) the batch's
        prefill and decode shapes; 0 when they were already compiled. Not part of ttft_s.
    """

    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    decode_tok_s: float | None
    compile_s: float = 0.0


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
    tokens (``hx.workload.prefill_chunks``; None: one step). Each chunk writes its keys and
    values at its own cache slots and attends over every slot written before it, so the
    logits equal an unchunked prefill's.

    Args:
      tokens: (B, T) int32 prompt tokens; step: the prefill ``Step`` of all T tokens.
      caches: per-layer KV caches (consumed).
      on_chunk: called with (chunk index from 1, number of chunks) before each chunk runs.
    Returns:
      (logits (B, V) of the last position, updated caches).
    """
    start = int(step.write_index)
    logits = None
    chunks = prefill_chunks(tokens.shape[1], chunk)
    for index, c in enumerate(chunks, 1):
        if on_chunk is not None:
            on_chunk(index, len(chunks))
        part = slice(start, start + c)
        logits, caches = executor.run(
            "prefill", tokens[:, part],
            Step(step.positions[:, part], np.int32(start), step.kv_start), caches)
        start += c
    return logits, caches


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt, rendered with the model's chat template when ``chat``."""
    return tokenizer.encode(tokenizer.render_chat(prompt) if chat else prompt)


class Engine:
    """Generates text with a model under an execution plan.

    Args:
      model: a loaded model (``hx.load``).
      plan: op placement and memory homes; all-accelerator when omitted.
      devices: accelerator (with its memory budget) and host; discovered when omitted.
      timeline: records every segment and transfer when given (``--trace``).
    Attributes:
      model: ``model`` without its weight tree (``params`` is empty): once placed, the
        weights live where the plan put them, and the caller's ``Model`` is the only other
        reference to the loader's host arrays.
      on_status: when set, called with a short line as a batch moves through compiling,
        each prefill chunk and decoding (a progress display: compiling and a long prompt's
        prefill can take minutes).
    """

    def __init__(self, model: Model, plan: ExecutionPlan | None = None,
                 devices: Devices | None = None, timeline: Timeline | None = None):
        self.plan = plan or ExecutionPlan.all_accelerator(model.spec.n_layers)
        self.executor = Executor(model.spec, model.params, self.plan, devices, timeline)
        # the executor holds the weights where the plan put them; keep no second reference to
        # the loader's host copies, so dropping the ``Model`` frees them (one copy per weight)
        self.model = dataclasses.replace(model, params={})
        self._compiled: set[tuple] = set()  # shapes and sampler kinds already compiled
        self.on_status: Callable[[str], None] | None = None

    def status(self, line: str) -> None:
        """Pass a progress line to ``on_status`` (when set)."""
        if self.on_status is not None:
            self.on_status(line)

    @property
    def accountant(self):
        """The executor's accelerator memory accountant."""
        return self.executor.accountant

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt, rendered with the model's chat template when ``chat``."""
        return encode_prompt(self.model.tokenizer, prompt, chat)

    def check(self, workload: Workload):
        """Reject the job before it runs if the plan does not fit the memory budgets.

        Returns:
          the ``hx.memory.MemoryEstimate``.
        Raises:
          HxError: naming the limit and the bytes over.
        """
        return check_fits(self.plan, self.model.spec, self.executor.devices, workload)

    def generate(self, prompts: Sequence[str], sampling: SamplingParams = SamplingParams(),
                 chat: bool = False, cache_slots: int | None = None) -> list[Completion]:
        """Generate a completion for every prompt, as one batch.

        Raises:
          HxError: an empty prompt, one that does not fit the context, or a plan that does
            not fit the memory budget.
        """
        return self.generate_ids([self.encode(p, chat) for p in prompts], sampling, cache_slots)

    def last_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prefill a batch and return the next-token logits of every prompt.

        Returns:
          (B, V) float32 numpy, one row per prompt (padding does not change a row).
        Raises:
          HxError: an empty prompt, one that does not fit the context, or a plan that does
            not fit the memory budget.
        """
        lengths = self._check(prompts)
        tokens, step = self._left_pad(prompts, lengths)
        B, T = tokens.shape
        self.check(Workload(B, T, T))
        try:
            caches = self.executor.new_cache(B, T)
            logits, _ = run_prefill(self.executor, tokens, step, caches,
                                    self.plan.prefill_chunk)
            return np.asarray(logits)
        finally:
            self.executor.release_cache()

    def _compile(self, workload: Workload, sampling: SamplingParams) -> float:
        """Compile every segment of prefill (each chunk shape) and decode at ``workload``'s
        shapes ahead of time, from shapes alone, and the sampler on zero logits; returns the
        seconds it took (0 when already done). Keeps compilation out of TTFT and decode
        rates."""
        shapes = dataclasses.replace(workload, new_tokens=None)  # G changes no shape
        key = (shapes, sampling.greedy, sampling.top_k, sampling.top_p < 1.0)
        if key in self._compiled:
            return 0.0
        self.status(f"compiling batch {workload.batch} x {workload.prompt_tokens} tokens, "
                     f"{workload.cache_slots} KV slots")
        start = time.perf_counter()
        B, S = workload.batch, workload.cache_slots
        for chunk in set(prefill_chunks(workload.prompt_tokens, self.plan.prefill_chunk)):
            self.executor.compile("prefill", B, chunk, S)
        self.executor.compile("decode", B, 1, S)
        for phase in ("prefill", "decode"):
            device = self.executor.devices[self.plan.phase(phase).head]
            zeros = jax.device_put(np.zeros((B, self.model.spec.vocab_size), np.float32), device)
            sample(zeros, sampling, 0).block_until_ready()
        self._compiled.add(key)
        return time.perf_counter() - start

    def _check(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        lengths = np.array([len(p) for p in prompts], dtype=np.int32)
        check_prompts(lengths, self.model.spec)
        return lengths

    def _left_pad(self, prompts: Sequence[Sequence[int]], lengths: np.ndarray
                  ) -> tuple[np.ndarray, Step]:
        """(tokens (B,T) int32 left-padded to ``padded_length``, prefill ``Step``)."""
        T = padded_length(int(lengths.max()), self.model.spec)
        tokens = np.full((len(prompts), T), self.model.tokenizer.eos_id or 0, dtype=np.int32)
        for r, ids in enumerate(prompts):
            tokens[r, T - len(ids):] = ids
        kv_start = (T - lengths).astype(np.int32)
        positions = np.maximum(np.arange(T, dtype=np.int32)[None, :] - kv_start[:, None], 0)
        return tokens, Step(positions, np.int32(0), kv_start)

    def generate_ids(self, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams = SamplingParams(),
                     cache_slots: int | None = None, seeds: Sequence[int] | None = None,
                     on_finish: Callable[[int, Completion], None] | None = None,
                     max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        """Generate from token ids, as one (static) batch: it runs until its last row ends.

        Args:
          prompts: B prompts of token ids (lengths may differ).
          sampling: sampling and stopping rules.
          seeds: B sampling seeds, one per prompt (default: ``sampling.seed`` for all).
          on_finish: called with (row, its ``Completion``) the moment a row ends -- at its
            stop token or its own token limit, while the others go on (a batch run writes
            each result then).
          cache_slots: KV-cache length; by default ``hx.workload.cache_length`` of this batch.
            A batch run passes one value for all its batches so decode compiles once.
          max_new_tokens: B token limits, one per prompt (default: ``sampling``'s for all).
        Raises:
          HxError: an empty prompt, one that does not fit the context, a too-small cache, or a
            plan that does not fit the memory budget.
        """
        spec, tok = self.model.spec, self.model.tokenizer
        lengths = self._check(prompts)
        tokens, prefill_step = self._left_pad(prompts, lengths)
        B, T = tokens.shape
        longest = int(lengths.max())
        asked = list(max_new_tokens or [sampling.max_new_tokens] * B)
        max_new = new_tokens(longest, max(asked), spec)  # rows share slots: the longest caps
        limits = [min(n, max_new) for n in asked]
        workload = Workload.for_prompts(B, longest, max(asked), spec)
        if cache_slots is not None:
            if cache_slots < T + max_new - 1:
                raise HxError(f"KV cache of {cache_slots} slots is too small for a {T}-token "
                              f"prompt and {max_new} new tokens")
            workload = Workload(B, T, cache_slots)
        self.check(workload)
        stop = set(sampling.stop_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        compile_s = self._compile(workload, sampling)
        outputs: list[list[int]] = [[] for _ in range(B)]
        stopped = [False] * B
        results: list[Completion | None] = [None] * B

        def complete(r: int, now: float) -> None:
            after_first = len(outputs[r]) - 1 + (1 if stopped[r] else 0)
            elapsed = now - first
            results[r] = Completion(
                prompt_tokens=int(lengths[r]), token_ids=outputs[r], text=tok.decode(outputs[r]),
                finish_reason=("stop" if stopped[r] else
                               "context" if limits[r] < asked[r] else "length"),
                ttft_s=first - start,
                decode_tok_s=after_first / elapsed if after_first > 0 and elapsed > 0 else None,
                compile_s=compile_s)
            if on_finish is not None:
                on_finish(r, results[r])

        def record(new: np.ndarray, drawn: int, now: float) -> None:
            """Each running row's ``drawn``-th token; a row ends at a stop or its limit."""
            for r in range(B):
                if results[r] is not None:
                    continue
                if int(new[r]) in stop:
                    stopped[r] = True
                else:
                    outputs[r].append(int(new[r]))
                if stopped[r] or drawn == limits[r]:
                    complete(r, now)

        start = time.perf_counter()
        try:
            caches = self.executor.new_cache(B, workload.cache_slots)
            logits, caches = run_prefill(
                self.executor, tokens, prefill_step, caches, self.plan.prefill_chunk,
                lambda i, n: self.status(f"prefill {B} x {T} tokens, chunk {i}/{n}"))
            last = np.asarray(sample(logits, sampling, 0, seeds))
            first = time.perf_counter()
            record(last, 1, first)
            self.status(f"decoding {B} x up to {max(limits)} tokens")
            kv_start = prefill_step.kv_start
            for i in range(1, max(limits)):
                if all(r is not None for r in results):
                    break
                step = Step(positions=(lengths + i - 1)[:, None].astype(np.int32),
                            write_index=np.int32(T + i - 1), kv_start=kv_start)
                logits, caches = self.executor.run("decode", last[:, None], step, caches)
                last = np.asarray(sample(logits, sampling, i, seeds))
                record(last, i + 1, time.perf_counter())
        finally:
            self.executor.release_cache()
        return results
