"""Throughput planning: the block (N micro-batches of B rows), join group and placement with
the most predicted tokens/s for a batch run under the memory budgets (docs/architecture.md,
"Planner").

A batch run with iteration-level scheduling (``hx.continuous``) keeps R = B·N sequences
decoding in the zig-zag block schedule; as rows end, waiting prompts are prefilled k at a time
(``ContinuousBatcher``'s ``join_min``: k free rows awaited, k a power of two <= the largest
join group, B or ``JOIN_ROWS``) and join. Per generated token the run spends a
share of a decode step and a share of a join prefill (FlexGen's throughput objective, Sheng et
al. 2023 §4, with the prefill of the prompts that join counted):

    seconds per token = t_step(B, N) / (R - (k - 1)/2) + t_prefill(k, P) / (k · G)

with G the mean new tokens per prompt, P the mean prompt length, and (k - 1)/2 the mean rows
idle while a join group gathers (rows ending one at a time). Both times are predicted by
``planner.simulator`` from a ``HardwareProfile`` for the plan the placement policy builds at
that block's workload (its KV caches -- every row's, plus the spare rows a join group is
prefilled into -- and the group's prefill activations counted against the budget). Larger
blocks amortise each streamed weight over more rows until the KV cache pushes weights or
attention off the accelerator; larger join groups amortise a prefill's pass over the
streamed weights over more prompts. The search keeps the best.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hx.errors import HxError
from hx.plan import ExecutionPlan
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict, predict_prefill
from hx.models.spec import ModelSpec
from hx.workload import Workload, round_up

MAX_ROWS = 256  # most rows a block holds (B·N)
MICRO_BATCHES = (2, 4)  # N tried beside 1 at the best number of rows
# Largest join group tried beside B (prompts prefilled together, the spare cache rows held):
# the prefill activations of B rows can push a block of many rows out of the budget, while
# 32 prompts in 32-token chunks already make 1,024-token prefill steps, past the rows where an
# H100's bf16 products reach their peak rate (482 TFLOP/s at 256 rows, 617 at 512 and above:
# docs/measurements/h100-2026-11-23/profile-numpy-attention-llama2-7b-2L.json).
JOIN_ROWS = 32


@dataclass(frozen=True)
class BlockChoice:
    """A block and the plan it runs under, with what the simulator predicts.

    Attributes:
      plan: the placement (fitted at ``workload``).
      workload: (B, join chunk, S, N) with spare rows for the largest join group (its
        prefill cache).
      join_min: k, the free rows a join waits for while rows decode (prefilled together).
      tokens_per_s: predicted generated tokens per second over the run.
      step_s: predicted seconds of one decode step of the whole block.
      prefill_s: predicted seconds to prefill a join group of k prompts of the mean length.
    """

    plan: ExecutionPlan
    workload: Workload
    tokens_per_s: float
    step_s: float
    prefill_s: float
    join_min: int

    def describe(self) -> str:
        """``4 micro-batches x 16 rows, joins of 8, plan cpsat: 812.3 tokens/s predicted
        (decode step 78.8 ms, prefill ...)``"""
        w = self.workload
        return (f"{w.micro_batches} micro-batch{'es' * (w.micro_batches > 1)} x {w.batch} rows, "
                f"joins of {self.join_min}, plan {self.plan.name}: {self.tokens_per_s:.1f} "
                f"tokens/s predicted (decode step {self.step_s * 1e3:.1f} ms, prefill "
                f"{self.prefill_s * 1e3:.1f} ms per join)")


def choose_block(spec: ModelSpec, profile: HardwareProfile, prompts: int, prompt_tokens: float,
                 new_tokens: float, cache_slots: int, chunk: int,
                 place: Callable[[Workload], ExecutionPlan], max_rows: int = MAX_ROWS,
                 micro_batches: Sequence[int] = MICRO_BATCHES) -> BlockChoice:
    """The block with the most predicted tokens/s.

    The search tries every R = B·N rows in powers of two up to ``max_rows`` and the number of
    prompts, as one micro-batch (the rate is not unimodal in R: it rises while a step
    amortises its weights over more rows, drops when R's KV cache moves to the host, and may
    rise again), then N micro-batches of R/N rows at the best R.
    At each block the largest join group (the spare rows, prefill's rows) is B and, for
    B > ``JOIN_ROWS``, also ``JOIN_ROWS``, halved while the block does not fit; the plan is
    placed for each (a CP-SAT solve for ``cpsat``/``auto``), and every join group k (powers
    of two up to that cap) is priced.

    Args:
      prompts: prompts in the run (a block has at most this many rows).
      prompt_tokens, new_tokens: mean prompt length and mean tokens generated per prompt.
      cache_slots: S of the run.
      chunk: tokens per prefill step of a joining prompt.
      place: the placement policy: the plan for a workload, fitted to the budgets (raises
        ``HxError`` when none fits).
    Returns:
      the best ``BlockChoice``.
    Raises:
      HxError: no block fits the budgets (the refusal at one row).
    """
    padded = round_up(max(1, round(prompt_tokens)), chunk)
    context = min(cache_slots, round(prompt_tokens + new_tokens / 2))

    def rate_capped(b: int, n: int, cap: int) -> BlockChoice:
        workload = Workload(b, chunk, cache_slots, n, spare_rows=cap)
        plan = place(workload)
        step = predict(plan, spec, profile, "decode", b, 1, cache_slots, context, n).seconds
        joins = plan if plan.prefill_chunk else plan.with_prefill_chunk(chunk)
        best_k: BlockChoice | None = None
        for k in (1 << i for i in range(cap.bit_length())):
            prefill = predict_prefill(joins, spec, profile, k, padded, cache_slots)
            per_token = step / (b * n - (k - 1) / 2) + prefill / (k * new_tokens)
            choice = BlockChoice(plan, workload, 1 / per_token, step, prefill, k)
            if best_k is None or choice.tokens_per_s > best_k.tokens_per_s:
                best_k = choice
        return best_k

    def rate(b: int, n: int) -> BlockChoice:
        # largest join groups: B, then JOIN_ROWS and below, halving while nothing fits
        caps = [b] + [1 << i for i in reversed(range(JOIN_ROWS.bit_length())) if 1 << i < b]
        choices: list[BlockChoice] = []
        for cap in caps:
            try:
                choices.append(rate_capped(b, n, cap))
            except HxError as error:
                failure = error
                continue
            if cap <= JOIN_ROWS:
                break
        if not choices:
            raise failure
        return max(choices, key=lambda c: c.tokens_per_s)

    best = rate(1, 1)  # raises when nothing fits
    for i in range(1, max(1, min(max_rows, prompts)).bit_length()):
        try:
            choice = rate(1 << i, 1)
        except HxError:
            break  # more rows need more memory: none larger fits either
        if choice.tokens_per_s > best.tokens_per_s:
            best = choice
    total = best.workload.batch
    for n in micro_batches:
        if total % n == 0 and total // n >= 1:
            try:
                choice = rate(total // n, n)
            except HxError:
                continue
            if choice.tokens_per_s > best.tokens_per_s:
                best = choice
    return best
