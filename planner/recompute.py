"""Partial KV recompute (KVPR): how many cache positions a ``streamed`` layer recomputes.

A ``streamed`` KV cache lives in host memory and is attended on the accelerator, so every
step copies the layer's cache in (``hx.schedule``: ``act load``, ``kv load``, ``recompute``,
``kv store``). KVPR (Jiang et al. 2024, "KVPR: Efficient LLM Inference with I/O-Aware KV Cache
Partial Recomputation", arXiv:2411.17089) sends the layer's input activations ``h`` of
positions [0, r) instead of their K and V, and recomputes those on the accelerator while the
K, V of [r, S) cross the link; its scheduler picks r from profiled rates so that the
recompute and the transfer overlap.

Here the step is a pipeline of layers (the next layer's weights and cache are copied while
this layer computes, ``hx.schedule``'s prefetch), so a layer in steady state takes the larger
of its link time and its accelerator time:

  link(r) = stage + N·(2·lat + (r·a + (P - r)·k) / bw_h2d)
  acc(r)  = N·(launch + ops + recompute(r)),  recompute(r) = launch + t_K(B, r) + t_V(B, r)

with P the positions in the cache before the step, a = B·d_model·itemsize and k = the K, V
bytes of one position of B rows (``models.tensors``), stage the layer's staged weights' copy,
ops the layer's accelerator ops at the step's shape, t_K, t_V the K and V ops at T = r
(``simulator.op_seconds``: flops / matmul_rate(B·r)), N micro-batches. link falls with r
where a < k (not with grouped-query attention's few KV heads, a ≥ k: then r = 0); acc rises.
max(link, acc) is least where they cross: ``balance`` finds the crossing by bisection on
integers (exact for the profile's rate curves, which are not linear in r at small r), clipped
to [0, P]. ``choose_recompute`` then takes the least simulated step (``predict``) of r = 0,
r*, r = P and a golden-section search over [0, P] where recompute pays somewhere: on a link as
fast as a memory copy (an emulated accelerator) it does not, and r = 0.

KVPR's two orders: hx's block schedule (``hx.schedule``, FlexGen's zig-zag) already runs a
layer for every micro-batch before the next layer, its weights copied once -- KVPR's
column-by-column order (throughput); a block of one micro-batch is its row-by-row order
(latency). The balance takes N micro-batches' copies and work per layer either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from hx.devices import ACCELERATOR
from hx.models.spec import ModelSpec
from hx.models.tensors import activation_bytes, kv_bytes
from hx.plan import STREAMED, ExecutionPlan
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import (kv_load_seconds, predict, recompute_seconds,
                                  segment_seconds, stage_seconds)
from hx.schedule import staged_bytes
from hx.segments import split_segments

SEARCH = 12  # golden-section steps refining r on the simulated step (0.618^12 = 0.3 % of P)


@dataclass(frozen=True)
class LayerTimes:
    """One ``streamed`` layer's steady-state pieces at a decode shape (seconds).

    Attributes:
      stage: H2D copy of its staged weights (latency per op + bytes / bandwidth).
      compute: accelerator seconds of its segments per micro-batch (launches + ops).
      positions: P, cache positions written before the step.
      batch, micro_batches: B rows per micro-batch, N micro-batches.
    """

    stage: float
    compute: float
    positions: int
    batch: int
    micro_batches: int


def layer_times(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile, layer: int,
                batch: int, slots: int, context: int, micro_batches: int = 1) -> LayerTimes:
    """``LayerTimes`` of ``layer`` in ``plan``'s decode step at (B, S, context, N): its
    accelerator segments as ``simulator.build_tasks`` prices them."""
    segments = [s for s in split_segments(plan, "decode")
                if s.device == ACCELERATOR and any(l == layer for l, _ in s.ops)]
    acc = profile.device(ACCELERATOR)
    memo: dict[tuple[str, str], float] = {}
    compute = sum(acc.launch_seconds(batch)
                  + segment_seconds(spec, profile, s, batch, 1, slots, context, memo)
                  for s in segments)
    stage = sum(stage_seconds(profile, s, staged_bytes(spec, s)) for s in segments if s.streams)
    return LayerTimes(stage, compute, max(min(context - 1, slots), 0), batch, micro_batches)


def link_seconds(spec: ModelSpec, profile: HardwareProfile, t: LayerTimes, r: int) -> float:
    """link(r): the layer's weights, then per micro-batch ``h`` of [0, r) and K, V of
    [r, P) over H2D (``simulator.kv_load_seconds``)."""
    return t.stage + t.micro_batches * sum(kv_load_seconds(spec, profile, t.batch,
                                                           t.positions, r))


def accelerator_seconds(spec: ModelSpec, profile: HardwareProfile, t: LayerTimes,
                        r: int) -> float:
    """acc(r): per micro-batch the layer's accelerator work plus the recompute of r
    positions (``simulator.recompute_seconds``)."""
    return t.micro_batches * (t.compute + recompute_seconds(spec, profile, t.batch, r))


def recompute_pays_on_link(spec: ModelSpec, batch: int) -> bool:
    """Whether one position's ``h`` is fewer bytes than its K and V (d_model < 2·K·E in the
    KV format): otherwise sending activations never shortens the copy."""
    return activation_bytes(spec, "h", batch, 1) < kv_bytes(spec, batch, 1)


def balance(spec: ModelSpec, profile: HardwareProfile, t: LayerTimes) -> int:
    """The r in [0, P] where link(r) and acc(r) cross (the least r with acc ≥ link), by
    bisection; 0 when the link is hidden at r = 0 or ``h`` is no smaller than K, V; P when the
    link is longer even with every position recomputed."""
    P = t.positions
    if P == 0 or not recompute_pays_on_link(spec, t.batch):
        return 0

    def gap(r: int) -> float:
        return link_seconds(spec, profile, t, r) - accelerator_seconds(spec, profile, t, r)

    if gap(0) <= 0:
        return 0
    if gap(P) >= 0:
        return P
    lo, hi = 0, P  # gap(lo) > 0 >= gap(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    step = lambda r: max(link_seconds(spec, profile, t, r),  # noqa: E731
                         accelerator_seconds(spec, profile, t, r))
    return min((lo, hi), key=step)


def streamed_layer(plan: ExecutionPlan) -> int | None:
    """The first layer of ``plan`` with a ``streamed`` cache (None: none has one)."""
    return next((i for i, home in enumerate(plan.kv) if home == STREAMED), None)


def choose_recompute(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                     batch: int, slots: int, context: int, micro_batches: int = 1,
                     search: int = SEARCH) -> ExecutionPlan:
    """``plan`` with one r for its ``streamed`` layers (KVPR's per-layer r; hx's layers are
    alike), the least simulated decode step (``predict``) of: r = 0, ``balance``'s r*, the
    clip's other end r = P, and a golden-section search over [0, P] of ``search`` steps
    (``refine``). The balance is the steady state of a layer; the step also has the
    pipeline's ends (the first layer's copy, the last layer's work) and, with one pair of
    copies in flight (``hx.schedule``'s prefetch), gaps where a layer's weights and the next
    micro-batch's cache queue on one link -- Llama-2-7B, 4 x 32 rows, 512-token prompt,
    weights streamed, A10G preset with attention at its memory bandwidth: r* = 211, the
    sweep's best r = 340, 10 % apart in step time. Ties go to the smaller r, so r = 0 where
    recompute does not pay (or with no streamed layer)."""
    layer = streamed_layer(plan)
    if layer is None:
        return plan.with_recompute(0)
    t = layer_times(plan, spec, profile, layer, batch, slots, context, micro_batches)
    memo: dict[int, float] = {}

    def step(r: int) -> float:
        if r not in memo:
            memo[r] = predict(plan.with_recompute(r), spec, profile, "decode", batch, 1, slots,
                              context, micro_batches).seconds
        return memo[r]

    r = balance(spec, profile, t)
    for candidate in (0, r, t.positions):
        step(candidate)
    if r or step(t.positions) < step(0):  # recompute pays somewhere: search around
        refine(step, 0, t.positions, search)
    return plan.with_recompute(min(sorted(memo), key=memo.__getitem__))


def refine(step, lo: int, hi: int, iterations: int) -> None:
    """Golden-section search for the least ``step(r)`` over integers in [lo, hi] (``step``
    memoises what it evaluates; the caller takes the least)."""
    ratio = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(iterations):
        if b - a < 3:
            break
        c = round(b - ratio * (b - a))
        d = round(a + ratio * (b - a))
        if step(c) <= step(d):
            b = d
        else:
            a = c
    for r in range(a, b + 1):
        step(r)
