"""Split a phase of a plan into segments: runs of consecutive ops on one device
(docs/architecture.md, "Segments").

A segment is the unit the executor compiles, launches, streams weights for and records in the
timeline. Segments end where the device changes. An accelerator segment whose weights are
copied in before use (``streamed`` or ``host`` homes) also ends at a layer boundary, so the
double buffer of staged weights holds at most two segments of at most one layer each; so does
an accelerator segment attending a ``streamed`` KV cache (copied in before the segment runs,
double-buffered the same way). A layer's streamed experts (``EXPERTS:streamed``) run alone, in
a segment of their own: their copy waits for the layer's routing (``Segment.routes``).

A segment's signature (device, op names, which weights are staged, the activations it reads and
writes) has no layer index, so identical layers share one compiled function.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from hx.devices import ACCELERATOR
from hx.models.spec import EXPERT_OPS, EXPERTS_STREAMED, ModelSpec
from hx.models.tensors import OPS
from hx.plan import (EXPERT_HOME_OF, RESIDENT, STREAMED, ExecutionPlan, ExpertHomes, Placement,
                     WeightHomes)


@dataclass(frozen=True)
class Segment:
    """Consecutive ops that run on one device as one compiled function.

    Attributes:
      device: ``accelerator`` or ``host``.
      ops: ((layer or None, op id), ...) in execution order.
      staged: per op, whether its weights are copied into accelerator memory before the
        segment runs (accelerator op whose weights are not resident).
      reads: activations produced before the segment that it reads.
      writes: activations it produces that a later segment reads.
      parts: per op, how many routed experts it holds where its layer's experts have homes
        (MLP2: 0; ``hx.plan.ExpertHomes``, ``ModelSpec.expert_part``), else -1.
      streams: whether some of its weights are staged before it runs (derived): not a
        layer's streamed experts (``EXPERTS:streamed``), which run alone in a segment of their
        own and are copied as routed (``routes``).
      cache_layers: layers whose KV cache it reads and updates, in op order (derived).
    """

    device: str
    ops: tuple[tuple[int | None, str], ...]
    staged: tuple[bool, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    parts: tuple[int, ...] = ()
    # derived from ops and staged, once: the schedule and the simulator ask for every
    # instruction
    streams: bool = field(init=False, repr=False, compare=False)
    cache_layers: tuple[int, ...] = field(init=False, repr=False, compare=False)

    @property
    def routes(self) -> bool:
        """Whether it runs a layer's streamed experts (``EXPERTS:streamed``, alone): their
        weights cross as the layer's routing asks, after its router has run
        (``hx.schedule``: ``route``, ``experts in``)."""
        return self.ops[0][1] == EXPERTS_STREAMED

    def at_rows(self, rows: int, top_k: int) -> "Segment":
        """The segment as it runs a step of ``rows`` rows (B·T): a layer's streamed experts
        (``routes``) held in ``routed_slots`` of them, the most a step can route to."""
        if not self.routes:
            return self
        return dataclasses.replace(self, parts=(routed_slots(self.parts[0], rows, top_k),))

    def __post_init__(self) -> None:
        object.__setattr__(self, "streams", any(self.staged))
        object.__setattr__(self, "cache_layers", tuple(
            layer for layer, op in self.ops if OPS[op].uses_cache))

    @property
    def signature(self) -> tuple:
        """What the compiled function depends on (layer indices excluded)."""
        return (self.device, tuple(op for _, op in self.ops), self.staged, self.reads,
                self.writes, self.parts)

    def spec_at(self, spec: ModelSpec, end: bool) -> ModelSpec:
        """The spec of the activations live at the segment's start (its reads) or ``end`` (its
        writes): that of its first (last) op's layer (``ModelSpec.layer_spec``; ``spec`` at
        EMBED or HEAD). Layers differ there only in ``a``: a dense first layer's is d_ff
        wide, an MoE layer's D + X."""
        layer = self.ops[-1 if end else 0][0]
        return spec if layer is None else spec.layer_spec(layer)

    def op_spec(self, spec: ModelSpec, index: int) -> ModelSpec:
        """The spec op ``index`` is held and computed with: its layer's
        (``ModelSpec.layer_spec`` of the model's ``spec``; a layer type's spec is its own),
        or the part of an MoE layer it holds (``parts``)."""
        layer, op = self.ops[index]
        held = spec if layer is None else spec.layer_spec(layer)
        n = self.parts[index] if self.parts else -1
        return held if n < 0 else held.expert_part(op, n)


def routed_slots(experts: int, rows: int, top_k: int) -> int:
    """Slots of the buffer a layer's ``experts`` streamed experts are copied into at a step of
    ``rows`` rows, each routed to ``top_k`` experts: the most the step can route to,
    min(experts, rows·k)."""
    return min(experts, rows * top_k)


def split_segments(plan: ExecutionPlan, phase: str) -> tuple[Segment, ...]:
    """Group the phase's (layer, op, device) sequence into segments and compute liveness
    (``segments_of`` the phase's placement: a phase placed as the other shares its
    segments).

    ``reads`` of a segment: names read by one of its ops before any op of the segment writes
    them. ``writes``: names the segment writes that some later op reads before a later op
    overwrites them, plus the final ``logits``.
    """
    return segments_of(plan.phase(phase), plan.weights, plan.kv, plan.experts)


@functools.lru_cache(maxsize=4096)
def segments_of(placement: Placement, weights: WeightHomes, kv: tuple[str, ...],
                experts: ExpertHomes = ExpertHomes()) -> tuple[Segment, ...]:
    """``split_segments`` of a phase placed as ``placement`` (cached: tables are frozen)."""
    def copies_in(layer: int | None) -> bool:  # a layer whose KV cache is copied in
        return layer is not None and kv[layer] == STREAMED

    def home(layer: int | None, op: str) -> str | None:
        return EXPERT_HOME_OF[op] if op in EXPERT_OPS else weights.get(layer, op)

    runs: list[tuple[str, list[tuple[int | None, str]], list[bool]]] = []  # device, ops, staged
    previous, streams = None, False  # the last op's layer; whether the last run stages
    routed = False  # whether the last run is a layer's streamed experts (copied as routed)
    for layer, op, device in experts.woven(placement.sequence()):
        alone = op == EXPERTS_STREAMED  # its copy waits for its layer's routing
        staged = (device == ACCELERATOR and not alone
                  and home(layer, op) not in (None, RESIDENT))
        if runs and runs[-1][0] == device and not (alone or routed) and (
                layer == previous or not (staged or streams or (
                    device == ACCELERATOR and (copies_in(layer) or copies_in(previous))))):
            runs[-1][1].append((layer, op))
            runs[-1][2].append(staged)
            streams = streams or staged
        else:
            runs.append((device, [(layer, op)], [staged]))
            streams = staged
        previous, routed = layer, alone

    live_after: list[set[str]] = [set()] * len(runs)  # read later before being overwritten
    live: set[str] = set()
    for i in range(len(runs) - 1, -1, -1):  # backward liveness
        live_after[i] = set(live)
        for _, op in reversed(runs[i][1]):
            live.difference_update(OPS[op].writes)
            live.update(OPS[op].reads)

    segments = []
    for (device, ops, staged), later_reads in zip(runs, live_after):
        reads: list[str] = []  # read before the segment writes them
        writes: list[str] = []  # written, and read later (or the logits)
        produced: set[str] = set()
        for _, op in ops:
            for n in OPS[op].reads:
                if n not in produced and n not in reads:
                    reads.append(n)
            for n in OPS[op].writes:
                if n not in produced:
                    produced.add(n)
                    if n in later_reads or n == "logits":
                        writes.append(n)
        parts = tuple(experts.part(layer, op) for layer, op in ops)
        segments.append(Segment(device, tuple(ops), tuple(staged), tuple(reads),
                                tuple(writes), parts if any(n >= 0 for n in parts) else ()))
    return tuple(segments)


def crossings(segments: tuple[Segment, ...]) -> list[tuple[str, ...]]:
    """Per segment, the activations it reads from the other device, in ``reads`` order (the
    input ``tokens`` start in host memory, on neither device, so they always cross)."""
    where: dict[str, str | None] = {"tokens": None}
    moves = []
    for seg in segments:
        moves.append(tuple([n for n in seg.reads if where[n] != seg.device]))
        for n in seg.writes:
            where[n] = seg.device
    return moves


def first_streaming(segments: tuple[Segment, ...]) -> int | None:
    """Index of the first segment that streams weights (staged before the phase starts)."""
    return next((i for i, seg in enumerate(segments) if seg.streams), None)


def next_streaming(segments: tuple[Segment, ...]) -> list[int | None]:
    """Per segment, the index of the next streaming segment after it (None: there is none);
    the executor stages that segment's weights when this one is launched."""
    after: list[int | None] = []
    following = None  # the first streaming segment after the one reached
    for i in range(len(segments) - 1, -1, -1):
        after.append(following)
        if segments[i].streams:
            following = i
    return after[::-1]
