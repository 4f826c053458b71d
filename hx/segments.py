"""Split a phase plan into segments: maximal runs of consecutive ops on one device (DESIGN §5).

A segment is the unit the executor jits and launches. Its signature (op names, the activations it
reads from earlier segments and writes for later ones) does not mention layer indices, so the
segments of identical layers share one compiled function.
"""

from __future__ import annotations

from dataclasses import dataclass

from hx.models.llama import OPS
from hx.plan import PhasePlan


@dataclass(frozen=True)
class Segment:
    """Consecutive ops that run on one device as one jitted function.

    Attributes:
      device: device name (``accelerator`` or ``host``).
      ops: ((layer or None, op id), ...) in execution order.
      reads: activations produced before the segment that it reads.
      writes: activations it produces that a later segment reads.
    """

    device: str
    ops: tuple[tuple[int | None, str], ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    @property
    def signature(self) -> tuple:
        """What the compiled function depends on (layer indices excluded)."""
        return tuple(op for _, op in self.ops), self.reads, self.writes

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """Layers whose KV cache the segment reads and updates, in op order."""
        return tuple(layer for layer, op in self.ops if OPS[op].uses_cache)


def split_segments(phase: PhasePlan) -> list[Segment]:
    """Group the phase's (layer, op, device) sequence into segments and compute liveness.

    ``reads`` of a segment: names read by one of its ops before any op of the segment writes
    them. ``writes``: names the segment writes (last write wins) that some later op reads before
    a later op overwrites them. The final ``logits`` are always written.
    """
    runs: list[tuple[str, list[tuple[int | None, str]]]] = []
    for layer, op, device in phase.sequence():
        if runs and runs[-1][0] == device:
            runs[-1][1].append((layer, op))
        else:
            runs.append((device, [(layer, op)]))

    def reads_of(ops) -> tuple[str, ...]:
        written: set[str] = set()
        needed: list[str] = []
        for _, op in ops:
            for name in OPS[op].reads:
                if name not in written and name not in needed:
                    needed.append(name)
            written.update(OPS[op].writes)
        return tuple(needed)

    segments = []
    for i, (device, ops) in enumerate(runs):
        produced = []
        for _, op in ops:
            produced += [n for n in OPS[op].writes if n not in produced]
        later_reads: set[str] = set()
        overwritten: set[str] = set()
        for _, later_ops in runs[i + 1:]:
            for _, op in later_ops:
                later_reads.update(n for n in OPS[op].reads if n not in overwritten)
                overwritten.update(OPS[op].writes)
        writes = tuple(n for n in produced if n in later_reads or n == "logits")
        segments.append(Segment(device, tuple(ops), reads_of(ops), writes))
    return segments
