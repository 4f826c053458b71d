"""The shape of a generation job: batch, padded prompt length, KV-cache slots.

Prompts are left-padded to a multiple of ``PREFILL_BUCKET`` tokens and caches are rounded to a
multiple of ``CACHE_BUCKET`` slots, so a handful of compiled shapes serve many jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hx.models.spec import ModelSpec

PREFILL_BUCKET = 16  # tokens
CACHE_BUCKET = 64  # KV-cache slots
MIN_CHUNK = 32  # smallest prefill chunk a policy chooses; plans are sized at it (tokens)


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def padded_length(longest_prompt: int, spec: ModelSpec) -> int:
    """Prompt length T after left padding: a ``PREFILL_BUCKET`` multiple, at most the context."""
    return min(round_up(longest_prompt, PREFILL_BUCKET), spec.context_length)


def new_tokens(longest_prompt: int, max_new_tokens: int, spec: ModelSpec) -> int:
    """Tokens a batch can generate: ``max_new_tokens`` capped by the context end."""
    return min(max_new_tokens, spec.context_length - longest_prompt)


def cache_length(longest_prompt: int, max_new_tokens: int, spec: ModelSpec) -> int:
    """KV-cache slots for a batch whose longest prompt has ``longest_prompt`` tokens.

    Decode needs one slot per generated token but the last, after the padded prompt; the total
    is rounded up to ``CACHE_BUCKET`` slots.
    """
    new = new_tokens(longest_prompt, max_new_tokens, spec)
    return round_up(padded_length(longest_prompt, spec) + new, CACHE_BUCKET)


def powers_of_two(rows: int) -> list[int]:
    """1, 2, 4, ... up to ``rows``: the row counts iteration-level scheduling runs steps at (a
    joining group is prefilled at one, a micro-batch shrinks to one once no prompt waits), so
    few shapes compile."""
    return [1 << k for k in range(rows.bit_length()) if 1 << k <= rows]


def prefill_chunks(prompt_tokens: int, chunk: int | None, limit: int | None = None
                   ) -> list[int]:
    """Tokens per prefill step when a prompt of ``prompt_tokens`` (padded) tokens is prefilled
    in chunks of at most ``chunk`` tokens (None: one step), and of at most ``limit`` where
    one is given (a model with sliding windows: ``models.tensors.step_limit``). The first
    chunk takes the remainder, so the others share one compiled shape; every chunk attends
    over the cache the chunks before it wrote.

    Raises:
      ValueError: ``chunk`` < 1.
    """
    chunk = step_chunk(chunk, limit)
    if chunk is None or chunk >= prompt_tokens:
        return [prompt_tokens]
    if chunk < 1:
        raise ValueError(f"prefill chunk must be at least 1 token, got {chunk}")
    n = -(-prompt_tokens // chunk)
    return [prompt_tokens - (n - 1) * chunk] + [chunk] * (n - 1)


def step_chunk(chunk: int | None, limit: int | None) -> int | None:
    """A prefill chunk (None: the whole prompt) bounded by ``limit`` (None: no bound)."""
    return chunk if limit is None else min(chunk or limit, limit)


@dataclass(frozen=True)
class Workload:
    """Shapes one generation job runs at.

    Attributes:
      batch: B, rows per step (per micro-batch in a block).
      prompt_tokens: T, padded prompt length of prefill (the chunk a prompt joining a running
        block is prefilled in, with iteration-level scheduling).
      cache_slots: S, KV-cache length per row.
      micro_batches: N micro-batches of B rows in a block (zig-zag block schedule); every
        row's KV cache is held at once.
      spare_rows: KV-cache rows held beside the block's: iteration-level scheduling prefills
        a group of joining prompts, at most this many, into cache rows of their own before
        copying them into the block. With spare rows, prefill runs only on such a group.
      new_tokens: G, tokens each row generates (the first by prefill); None: until the cache
        is full, S - T. The planners weigh prefill against G - 1 decode steps at the
        mid-generation context: the cache is rounded up to ``CACHE_BUCKET`` slots, so S - T
        can be twice G (512 + 32 tokens: 64 slots past the prompt).
    """

    batch: int
    prompt_tokens: int
    cache_slots: int
    micro_batches: int = 1
    spare_rows: int = 0
    new_tokens: int | None = None

    @property
    def rows(self) -> int:
        """KV-cache rows held at once: B·N plus the spare rows."""
        return self.batch * self.micro_batches + self.spare_rows

    @property
    def prefill_rows(self) -> int:
        """Rows of a prefill step: the largest join group with spare rows, else B."""
        return self.spare_rows or self.batch

    @property
    def prefill_micro_batches(self) -> int:
        """Micro-batches of a prefill step: a join group is prefilled alone, else N."""
        return 1 if self.spare_rows else self.micro_batches

    def step_rows(self, phase: str) -> list[int]:
        """Row counts the steps of ``phase`` run at: ``prefill_rows`` or B; with spare rows
        (iteration-level scheduling) every power of two up to them (``powers_of_two``)."""
        rows = self.prefill_rows if phase == "prefill" else self.batch
        return powers_of_two(rows) if self.spare_rows else [rows]

    @property
    def generated(self) -> int:
        """G: tokens each row generates (``new_tokens``, else until the cache is full)."""
        return self.cache_slots - self.prompt_tokens if self.new_tokens is None \
            else self.new_tokens

    @property
    def decode_steps(self) -> int:
        """Decode steps of a run: G - 1 (prefill yields the first token), at least 0."""
        return max(self.generated - 1, 0)

    @property
    def decode_context(self) -> int:
        """Cache slots in use at a typical decode step: mid-way through generation,
        T + G/2 (what the planners price decode at)."""
        return self.prompt_tokens + self.generated // 2

    @classmethod
    def for_prompts(cls, batch: int, longest_prompt: int, max_new_tokens: int,
                    spec: ModelSpec) -> "Workload":
        """The workload of a batch of ``batch`` prompts, the longest ``longest_prompt``
        tokens, each generating up to ``max_new_tokens``."""
        return cls(batch, padded_length(longest_prompt, spec),
                   cache_length(longest_prompt, max_new_tokens, spec),
                   new_tokens=new_tokens(longest_prompt, max_new_tokens, spec))
