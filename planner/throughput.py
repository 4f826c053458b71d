"""Throughput planning: the block (N micro-batches of B rows) and placement with the most
predicted tokens/s for a batch run under the memory budgets (DESIGN §6).

A batch run with iteration-level scheduling (``hx.continuous``) keeps B·N sequences decoding
in the zig-zag block schedule and prefills each waiting prompt into a row as one ends. Over a
run of prompts of mean length P generating G tokens each, a block of R = B·N rows spends per R
prompts G decode steps of the block and R prefills of one prompt, so (FlexGen's throughput
objective, Sheng et al. 2023 §4, with the prefill of the prompts that join counted):

    tokens/s = R·G / (G · t_step(B, N) + R · t_prefill(P))

with both times predicted by ``planner.simulator`` from a ``HardwareProfile`` for the plan the
placement policy builds at that block's workload (its KV caches -- every row's, plus the spare
rows a joining prompt is prefilled into -- counted against the budget). Larger blocks amortise
each streamed weight over more rows until the KV cache pushes weights or attention off the
accelerator; the search keeps the best block that fits.
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

MAX_ROWS = 64  # most rows a block holds (B·N)
MICRO_BATCHES = (2, 4)  # N tried beside 1 at the best number of rows


@dataclass(frozen=True)
class BlockChoice:
    """A block and the plan it runs under, with what the simulator predicts.

    Attributes:
      plan: the placement (fitted at ``workload``).
      workload: (B, join chunk, S, N) with B spare rows.
      tokens_per_s: predicted generated tokens per second over the run.
      step_s: predicted seconds of one decode step of the whole block.
      prefill_s: predicted seconds to prefill one prompt of the mean length.
    """

    plan: ExecutionPlan
    workload: Workload
    tokens_per_s: float
    step_s: float
    prefill_s: float

    def describe(self) -> str:
        """``4 x 16 rows, plan cpsat: 812.3 tokens/s predicted (step 78.8 ms, prefill ...)``"""
        w = self.workload
        return (f"{w.micro_batches} micro-batch{'es' * (w.micro_batches > 1)} x {w.batch} rows, "
                f"plan {self.plan.name}: {self.tokens_per_s:.1f} tokens/s predicted (decode "
                f"step {self.step_s * 1e3:.1f} ms, prefill {self.prefill_s * 1e3:.1f} ms per "
                f"prompt)")


def choose_block(spec: ModelSpec, profile: HardwareProfile, prompts: int, prompt_tokens: float,
                 new_tokens: float, cache_slots: int, chunk: int,
                 place: Callable[[Workload], ExecutionPlan], max_rows: int = MAX_ROWS,
                 micro_batches: Sequence[int] = MICRO_BATCHES) -> BlockChoice:
    """The block with the most predicted tokens/s.

    The search tries R = B·N rows in powers of two from the largest (at most ``max_rows`` and
    the number of prompts) down, as one micro-batch, until the predicted rate falls (it rises
    with R while a step amortises its weights over more rows, and falls once R's KV cache
    pushes work off the accelerator); at the best R it then tries N micro-batches of R/N rows.
    Each candidate costs one placement (a CP-SAT solve for ``cpsat``/``auto``).

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

    def rate(b: int, n: int) -> BlockChoice:
        workload = Workload(b, chunk, cache_slots, n, spare_rows=b)
        plan = place(workload)
        step = predict(plan, spec, profile, "decode", b, 1, cache_slots, context, n).seconds
        joins = plan if plan.prefill_chunk else plan.with_prefill_chunk(chunk)
        prefill = predict_prefill(joins, spec, profile, 1, padded, cache_slots)
        tokens_per_s = b * n * new_tokens / (new_tokens * step + b * n * prefill)
        return BlockChoice(plan, workload, tokens_per_s, step, prefill)

    best: BlockChoice | None = None
    rows = 1 << (max(1, min(max_rows, prompts)).bit_length() - 1)
    while rows >= 1:
        try:
            choice = rate(rows, 1)
        except HxError:
            if rows == 1:
                raise
            rows //= 2
            continue
        if best is not None and choice.tokens_per_s < best.tokens_per_s:
            break
        best, rows = choice, rows // 2
    assert best is not None
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
