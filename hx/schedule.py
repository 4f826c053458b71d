"""The step as data: a plan's phase at a workload's shapes compiled into instructions.

One ``Schedule`` describes one executor step (DESIGN §5): which weights are staged when, what
is waited for, which activations cross devices, which segment is launched, what is freed -- each
instruction with the accelerator bytes it allocates and frees per owner and the resource it
occupies. Three readers interpret the same list, so they cannot disagree:

* ``hx.executor.Executor.run`` carries it out (the accountant applies its allocations with the
  real sizes of the arrays, the timeline records its copies and launches);
* ``hx.planner.simulator`` prices it on a ``HardwareProfile``;
* ``hx.memory.estimate`` replays its allocations (``dry_run``) and takes the peak.

Instruction kinds, in the order the executor issues them for each segment i:

  ``wait``    block until streaming segment j has finished; free its staged weights
  ``stage``   copy the staged weights of segment j into accelerator memory (H2D)
  ``step``    put the step inputs (positions, write index, row starts) on a device
  ``move``    copy the activations segment i reads from the other device (H2D or D2H)
  ``launch``  run segment i (its XLA temporaries live until the next accelerator launch)
  ``free``    end of step: release temporaries, inputs and held activations

The next streaming segment's weights are staged when a streaming segment i is reached, ahead
of i's input copies -- unless those inputs are ready at once (step inputs, embeddings gathered
on the host): then the stage follows the last micro-batch's ``move``, since one H2D link
carries both in issue order and a ready activation must not wait behind a layer's weights
(the first streamed layer after EMBED did: its input queued behind the second layer's
weights). An input that comes from host matmuls or attention goes behind the stage: the
executor blocks on it, and the link would idle meanwhile.

A **block** of N micro-batches (``micro_batches``) runs the zig-zag block schedule of FlexGen
(Sheng et al. 2023, §4.2): each segment's weights are staged once and every micro-batch passes
through the segment before the next segment starts, so one copy of a streamed layer serves N·B
rows. ``step``, ``move`` and ``launch`` are issued once per micro-batch (``Instruction.micro``);
``stage`` and ``wait`` once per segment. With host attention, the host works on one
micro-batch's SCORE while the accelerator runs the next segment of the micro-batch before it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Hashable

from hx.devices import ACCELERATOR, HOST
from hx.models.spec import EMBED, ModelSpec
from hx.plan import DISK, ExecutionPlan
from hx.models.tensors import activation_bytes, step_bytes
from hx.segments import Segment, crossings, first_streaming, next_streaming, split_segments

WAIT, STAGE, STEP, MOVE, LAUNCH, FREE = "wait", "stage", "step", "move", "launch", "free"
READ, DISK_READ = "read", "disk"  # a disk -> host memory read of disk-homed weights
H2D, D2H, SYNC = "H2D", "D2H", "sync"
INPUT_KEY, TEMP_KEY = ("input",), ("temp",)


def step_key(micro: int = 0) -> tuple:
    """Accountant key of micro-batch ``micro``'s step inputs on the accelerator."""
    return ("step", micro)


def staging_key(segment: int) -> tuple:
    """Accountant key of the staged weights of segment ``segment``."""
    return ("staging", segment)


def act_key(name: str, micro: int = 0) -> tuple:
    """Accountant key of a held activation of micro-batch ``micro``."""
    return ("act", name, micro)


def staged_bytes(spec: ModelSpec, segment: Segment) -> int:
    """Bytes of the weights a segment copies into accelerator memory before it runs."""
    return sum(spec.op_weight_bytes(op) for (_, op), staged in zip(segment.ops, segment.staged)
               if staged)


def disk_bytes(plan: ExecutionPlan, spec: ModelSpec, segment: Segment) -> int:
    """Bytes of the segment's weights kept on disk (read into host memory each step)."""
    return sum(spec.op_weight_bytes(op) for layer, op in segment.ops
               if plan.weights.get(layer, op) == DISK)


@dataclass(frozen=True)
class Instruction:
    """One thing the executor does in a step.

    Attributes:
      kind: ``wait``, ``stage``, ``step``, ``move``, ``launch``, ``free``, or ``read`` (the
        segment's disk-homed weights read into host memory; ``resource`` ``disk``: planned
        and simulated, never executed).
      segment: index of the segment it concerns (None for ``free``).
      micro: the micro-batch a ``step``, ``move`` or ``launch`` is for (0 for the others).
      resource: what it occupies: ``H2D``/``D2H`` (copies), ``accelerator``/``host``
        (compute), ``sync`` (the executor blocked on a device), or None when it costs nothing
        the simulator models (step inputs; tokens already in host memory).
      names: ``move``: activations copied; ``launch``: activations written.
      nbytes: bytes copied (``stage``, ``move``).
      frees: accountant keys released first.
      allocs: (key, owner, bytes) allocated on the accelerator after the frees.
    """

    kind: str
    segment: int | None
    micro: int = 0
    resource: str | None = None
    names: tuple[str, ...] = ()
    nbytes: int = 0
    frees: tuple[Hashable, ...] = ()
    allocs: tuple[tuple[Hashable, str, int], ...] = ()


@dataclass(frozen=True)
class Schedule:
    """The instructions of one step of ``phase`` at (batch, tokens, slots).

    Attributes:
      phase: ``prefill`` or ``decode``.
      segments: the phase's segments (``hx.segments.split_segments``).
      instructions: in issue order.
      batch, tokens, slots: B rows per micro-batch, T new tokens per row, S cache slots.
      micro_batches: N micro-batches in the block.
    """

    phase: str
    segments: tuple[Segment, ...]
    instructions: tuple[Instruction, ...]
    batch: int
    tokens: int
    slots: int
    micro_batches: int = 1


TempBytes = Callable[[Segment, int, int, int], int]


def inputs_ready(segments: tuple[Segment, ...], i: int, names: tuple[str, ...]) -> bool:
    """Whether segment ``i``'s inputs ``names`` are ready as soon as they are asked for: step
    inputs, or outputs of a host segment that only gathers embeddings (no matmul or
    attention to wait for)."""
    for name in names:
        producer = next((seg for seg in reversed(segments[:i]) if name in seg.writes), None)
        if producer is not None and (producer.device != HOST
                                     or any(op != EMBED for _, op in producer.ops)):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def compile_schedule(plan: ExecutionPlan, spec: ModelSpec, phase: str, batch: int,
                     tokens: int, slots: int, temp_bytes: TempBytes | None = None,
                     micro_batches: int = 1) -> Schedule:
    """Compile one step of ``plan``'s ``phase`` into instructions.

    Args:
      batch, tokens, slots: B rows per micro-batch, T new tokens per row (a prefill chunk, or
        1 in decode), S KV-cache slots.
      micro_batches: N micro-batches run through each segment in turn (the zig-zag block
        schedule; 1: an ordinary step).
      temp_bytes: XLA temporary bytes of an accelerator segment at (B, T, S)
        (``hx.programs.Programs.temp_bytes``); None sizes them 0 (the simulator needs no
        sizes; the executor measures its own).

    Schedules are cached (all arguments are immutable): the simulator prices the same step
    once per prefill chunk and per candidate plan.
    """
    segments = split_segments(plan, phase)
    moves_of, next_stream = crossings(segments), next_streaming(segments)
    first = first_streaming(segments)
    out: list[Instruction] = []

    def read(j: int) -> None:
        nbytes = disk_bytes(plan, spec, segments[j])
        if nbytes:
            out.append(Instruction(READ, j, resource=DISK_READ, nbytes=nbytes))

    def stage(j: int) -> None:
        read(j)
        nbytes = staged_bytes(spec, segments[j])
        out.append(Instruction(STAGE, j, resource=H2D, nbytes=nbytes,
                               allocs=((staging_key(j), "staging", nbytes),)))

    if first is not None:
        stage(first)
    previous_stream: int | None = None
    stepped: set[tuple[str, int]] = set()
    held: set[tuple[str, int]] = set()
    for i, seg in enumerate(segments):
        on_acc = seg.device == ACCELERATOR
        late = None  # the next weights, staged after this segment's input copies
        if seg.streams:
            if previous_stream is not None:  # its buffer is reused: wait for it to finish
                out.append(Instruction(WAIT, previous_stream, resource=SYNC,
                                       frees=(staging_key(previous_stream),)))
            if next_stream[i] is not None:
                if moves_of[i] and inputs_ready(segments, i, moves_of[i]):
                    late = next_stream[i]  # on the H2D link behind inputs ready at once
                else:  # ahead of inputs the executor would block on while the link idles
                    stage(next_stream[i])
        if not on_acc:
            read(i)
        moves = moves_of[i]
        move_bytes = sum(activation_bytes(spec, n, batch, tokens) for n in moves) if moves else 0
        for m in range(micro_batches):
            if (seg.device, m) not in stepped:
                stepped.add((seg.device, m))
                nbytes = step_bytes(batch, tokens)
                out.append(Instruction(STEP, i, m, None, nbytes=nbytes, allocs=(
                    ((step_key(m), "activations", nbytes),) if on_acc else ())))
            if moves:
                from_host_memory = moves == ("tokens",) and not on_acc
                out.append(Instruction(
                    MOVE, i, m, None if from_host_memory else (H2D if on_acc else D2H), moves,
                    move_bytes, allocs=((INPUT_KEY, "activations", move_bytes),) if on_acc else ()))
            if late is not None and m == micro_batches - 1:
                stage(late)
            if on_acc:
                temp = temp_bytes(seg, batch, tokens, slots) if temp_bytes else 0
                allocs = [(TEMP_KEY, "activations", temp)]
                allocs += [(act_key(n, m), "activations",
                            activation_bytes(spec, n, batch, tokens)) for n in seg.writes]
                held.update((n, m) for n in seg.writes)
                out.append(Instruction(LAUNCH, i, m, ACCELERATOR, seg.writes,
                                       allocs=tuple(allocs)))
            else:
                dropped = tuple(act_key(n, m) for n in seg.writes if (n, m) in held)
                held.difference_update((n, m) for n in seg.writes)
                out.append(Instruction(LAUNCH, i, m, HOST, seg.writes, frees=dropped))
        if seg.streams:
            previous_stream = i
    frees: list[Hashable] = []
    if previous_stream is not None:
        out.append(Instruction(WAIT, previous_stream, resource=SYNC,
                               frees=(staging_key(previous_stream),)))
    frees += [TEMP_KEY, INPUT_KEY] + [step_key(m) for m in range(micro_batches)]
    frees += [act_key(n, m) for n, m in sorted(held)]
    out.append(Instruction(FREE, None, frees=tuple(frees)))
    return Schedule(phase, segments, tuple(out), batch, tokens, slots, micro_batches)


@dataclass
class DryRun:
    """Accelerator bytes over a schedule replayed without running it.

    Attributes:
      peak: highest bytes live at once (beyond what was live before the step).
      peak_by_owner: the breakdown at that moment.
    """

    peak: int = 0
    peak_by_owner: dict[str, int] = field(default_factory=dict)


def dry_run(schedule: Schedule) -> DryRun:
    """Replay ``schedule``'s allocations and frees in order; the peak is what the step needs
    on top of resident weights and KV caches."""
    live: dict[Hashable, tuple[str, int]] = {}
    result = DryRun()
    total = 0  # bytes live
    for ins in schedule.instructions:
        for key in ins.frees:
            total -= live.pop(key, (None, 0))[1]
        for key, owner, nbytes in ins.allocs:
            total += nbytes - live.get(key, (None, 0))[1]
            live[key] = (owner, nbytes)
            if total > result.peak:
                by_owner: dict[str, int] = {}
                for o, b in live.values():
                    by_owner[o] = by_owner.get(o, 0) + b
                result.peak, result.peak_by_owner = total, by_owner
    return result
