"""Split a phase of a plan into segments: runs of consecutive ops on one device
(docs/architecture.md, "Segments").

A segment is the unit the executor compiles, launches, streams weights for and records in the
timeline. Segments end where the device changes. An accelerator segment whose weights are copied
in before use (``streamed`` or ``host`` homes) also ends at a layer boundary, so the double
buffer of staged weights holds at most two segments of at most one layer each; so does an
accelerator segment attending a ``streamed`` KV cache (copied in before the segment runs,
double-buffered the same way).

A segment's signature (device, op names, which weights are staged, the activations it reads and
writes) has no layer index, so identical layers share one compiled function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hx.devices import ACCELERATOR
from hx.models.tensors import OPS
from hx.plan import RESIDENT, STREAMED, ExecutionPlan


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
    """

    device: str
    ops: tuple[tuple[int | None, str], ...]
    staged: tuple[bool, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    @property
    def signature(self) -> tuple:
        """What the compiled function depends on (layer indices excluded)."""
        return (self.device, tuple(op for _, op in self.ops), self.staged, self.reads,
                self.writes)

    @property
    def streams(self) -> bool:
        """True when some of the segment's weights are staged before it runs."""
        return any(self.staged)

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """Layers whose KV cache the segment reads and updates, in op order."""
        return tuple(layer for layer, op in self.ops if OPS[op].uses_cache)


@functools.lru_cache(maxsize=4096)
def split_segments(plan: ExecutionPlan, phase: str) -> tuple[Segment, ...]:
    """Group the phase's (layer, op, device) sequence into segments and compute liveness
    (cached per plan and phase: plans are frozen).

    ``reads`` of a segment: names read by one of its ops before any op of the segment writes
    them. ``writes``: names the segment writes that some later op reads before a later op
    overwrites them, plus the final ``logits``.
    """
    def copies_in(layer: int | None) -> bool:  # a layer whose KV cache is copied in
        return layer is not None and plan.kv[layer] == STREAMED

    runs: list[dict] = []
    for layer, op, device in plan.phase(phase).sequence():
        staged = device == ACCELERATOR and plan.weights.get(layer, op) not in (None, RESIDENT)
        run = runs[-1] if runs else None
        previous = run["ops"][-1][0] if run else None
        same = run is not None and run["device"] == device and not (
            layer != previous and (staged or any(run["staged"]) or (
                device == ACCELERATOR and (copies_in(layer) or copies_in(previous)))))
        if same:
            run["ops"].append((layer, op))
            run["staged"].append(staged)
        else:
            runs.append({"device": device, "ops": [(layer, op)], "staged": [staged]})

    def reads_of(ops) -> tuple[str, ...]:
        written: set[str] = set()
        needed: list[str] = []
        for _, op in ops:
            needed += [n for n in OPS[op].reads if n not in written and n not in needed]
            written.update(OPS[op].writes)
        return tuple(needed)

    live_after: list[set[str]] = [set()] * len(runs)  # read later before being overwritten
    live: set[str] = set()
    for i in range(len(runs) - 1, -1, -1):  # backward liveness
        live_after[i] = set(live)
        for _, op in reversed(runs[i]["ops"]):
            live.difference_update(OPS[op].writes)
            live.update(OPS[op].reads)

    segments = []
    for run, later_reads in zip(runs, live_after):
        produced: list[str] = []
        for _, op in run["ops"]:
            produced += [n for n in OPS[op].writes if n not in produced]
        writes = tuple(n for n in produced if n in later_reads or n == "logits")
        segments.append(Segment(run["device"], tuple(run["ops"]), tuple(run["staged"]),
                                reads_of(run["ops"]), writes))
    return tuple(segments)


def crossings(segments: tuple[Segment, ...]) -> list[tuple[str, ...]]:
    """Per segment, the activations it reads from the other device, in ``reads`` order (the
    input ``tokens`` start in host memory, on neither device, so they always cross)."""
    where: dict[str, str | None] = {"tokens": None}
    moves = []
    for seg in segments:
        moves.append(tuple(n for n in seg.reads if where[n] != seg.device))
        where.update({n: seg.device for n in seg.writes})
    return moves


def first_streaming(segments: tuple[Segment, ...]) -> int | None:
    """Index of the first segment that streams weights (staged before the phase starts)."""
    return next((i for i, seg in enumerate(segments) if seg.streams), None)


def next_streaming(segments: tuple[Segment, ...]) -> list[int | None]:
    """Per segment, the index of the next streaming segment after it (None: there is none);
    the executor stages that segment's weights when this one is launched."""
    streaming = [i for i, seg in enumerate(segments) if seg.streams]
    return [next((j for j in streaming if j > i), None) for i in range(len(segments))]
