"""The step as data: a plan's phase at a workload's shapes compiled into instructions.

One ``Schedule`` describes one executor step (docs/architecture.md, "The Schedule"): which weights are staged when, what
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

and, before the launch of a layer's streamed experts (``Segment.routes``: placed one by one,
``hx.plan.ExpertHomes``), per micro-batch:

  ``route``       D2H: the layer's routing weights, once its router has run (the executor
                  blocks on them)
  ``experts in``  H2D: the part's experts it routes to, into a buffer of the most it can
                  route to (``routed_slots``), freed once the launch is done

-- unless the step routes ``WHOLE_PART_ROUTINGS`` times the part's experts or more (a prefill
chunk: ``whole_part``): then the part crosses whole (``stage``) without waiting for the
routing, as soon as the launch of the part ``WHOLE_PART_BUFFERS`` such parts back is done
(``wait``: one buffer, so the copy overlaps the ops between);

and, for plans with a disk tier, ``read`` (a segment's disk-homed weights into host memory,
just before its stage; ``hx.disk``) and ``kv read`` (a micro-batch's disk-homed KV caches,
before its launch: planned and simulated, not yet executed). A segment attending a
``streamed`` KV cache (host memory, SCORE on the accelerator; ``hx.streamed_kv``) issues, per
micro-batch (KVPR, Jiang et al. 2024, with r = ``plan.recompute``):

  ``act load``   H2D: the layer's input activations ``h`` of positions [0, r)
  ``kv load``    H2D: the K, V of positions [r, S) (the executor copies those written so far,
                 ``copy_end``; at r = 0 it assembles the cache at once)
  ``recompute``  accelerator: the K and V ops (RoPE included) on the r positions, after
                 ``act load`` and the segment's weights and while ``kv load`` crosses; then
                 the cache is assembled (recomputed head, copied tail)
  ``kv store``   D2H: the new positions' K, V (and with r > 0 their ``h``) back into the host
                 cache, after the launch; frees the copied cache

The loads of the next such (segment, micro-batch) are issued before this one's launch, behind
the store of the one before it (prefetch depth 1): at most two copied caches are in
accelerator memory at once (owner ``kv``), double-buffered as staged weights are. The
assembly holds a pair's copied ``h`` and tail, its recomputed head and the assembled cache at
once (``act_copy_key``, ``copy_key``, ``head_key``, ``cache_key``) and releases all but the
cache (``Instruction.releases``), which the store frees; the recompute's temporaries are
counted as its K and V products in float32 (``recompute_temp_key``).

Every instruction lists the earlier instructions it depends on (``Instruction.deps``):
data-flow edges are recorded here, once.

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
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple

from hx.devices import ACCELERATOR, HOST
from hx.models.spec import EMBED, EXPERT_OPS, EXPERTS_STREAMED, ModelSpec
from hx.models.tensors import (ACTIVATIONS, OPS, activation_bytes, cache_bytes, kv_bytes,
                               layer_slots, step_bytes)
from hx.plan import DISK, STREAMED, ExecutionPlan
from hx.segments import (Segment, crossings, first_streaming, next_streaming, routed_slots,
                         split_segments)

WAIT, STAGE, STEP, MOVE, LAUNCH, FREE = "wait", "stage", "step", "move", "launch", "free"
READ, KV_READ = "read", "kv read"  # disk -> host memory: disk-homed weights, KV caches
ACT_LOAD, KV_LOAD, RECOMPUTE, KV_STORE = "act load", "kv load", "recompute", "kv store"
ROUTE, EXPERTS_IN = "route", "experts in"  # a layer's streamed experts, copied as routed
DISK_READ = "disk"  # the resource both occupy
H2D, D2H, SYNC = "H2D", "D2H", "sync"
INPUT_KEY, TEMP_KEY = ("input",), ("temp",)
COPY_QUANTUM = 128  # cache slots: a streamed cache's kv load copies whole quanta of its slots


def step_key(micro: int = 0) -> tuple:
    """Accountant key of micro-batch ``micro``'s step inputs on the accelerator."""
    return ("step", micro)


def experts_key(segment: int, micro: int = 0) -> tuple:
    """Accountant key of the routed experts copied in for segment ``segment``, micro-batch
    ``micro`` (a layer's streamed experts, ``Segment.routes``)."""
    return ("experts", segment, micro)


def routed_expert_bytes(spec: ModelSpec) -> int:
    """Bytes of one routed expert as the accelerator holds it (its matrices in the model's
    dtype or format, and its id, int32): a slot of ``experts in``'s buffer."""
    return spec.expert_part(EXPERTS_STREAMED, 1).op_weight_bytes(EXPERTS_STREAMED)


# routings a step makes per expert of a streamed part past which the part crosses whole
WHOLE_PART_ROUTINGS = 4
# buffers of streamed parts crossing whole. With 2 a layer's copy would start once the part two
# layers back is done, overlapping the previous layer's experts too: Qwen3-30B-A3B:12L with 64
# experts a layer streamed, on the gpu_like test profile, TTFT 186 -> 151 ms (64-token prompt)
# and 226 -> 201 (512) for one more part's bytes (170 MB), but CP-SAT's placement at a quarter
# of the weights' bytes, given room for two parts, streams nothing and computes 1,408 experts
# on the host (TTFT 334 -> 1,410 ms): the count stays 1 until plans choose it
# (docs/measurements/log.md, session 29)
WHOLE_PART_BUFFERS = 1


def whole_part(experts: int, rows: int, top_k: int) -> bool:
    """Whether a layer's ``experts`` streamed experts cross whole at a step of ``rows`` rows
    routed to ``top_k`` each: rows·k >= ``WHOLE_PART_ROUTINGS`` x experts (under a uniform
    router each expert is then left out with chance (1 - k/X)^rows, below e^-4 = 1.8 %), so
    the copy need not wait for the routing and goes ahead of the layer's other ops (a
    prefill chunk's)."""
    return rows * top_k >= WHOLE_PART_ROUTINGS * experts


def routing_bytes(spec: ModelSpec, batch: int, tokens: int) -> int:
    """Bytes of the routing weights a ``route`` reads back: (B, T, X) of the router's output
    ``a`` in the model's dtype."""
    return batch * tokens * spec.moe.routed * spec.dtype_bytes


def staging_key(segment: int) -> tuple:
    """Accountant key of the staged weights of segment ``segment``."""
    return ("staging", segment)


def act_key(name: str, micro: int = 0) -> tuple:
    """Accountant key of a held activation of micro-batch ``micro``."""
    return ("act", name, micro)


def copy_key(segment: int, micro: int = 0) -> tuple:
    """Accountant key of the K, V copied in for segment ``segment``, micro-batch ``micro``
    (a ``streamed`` cache's [r, S))."""
    return ("kv copy", segment, micro)


def act_copy_key(segment: int, micro: int = 0) -> tuple:
    """Accountant key of the activations copied in to recompute K, V from."""
    return ("kv act", segment, micro)


def head_key(segment: int, micro: int = 0) -> tuple:
    """Accountant key of the recomputed K, V of [0, r)."""
    return ("kv head", segment, micro)


def recompute_temp_key(segment: int, micro: int = 0) -> tuple:
    """Accountant key of the recompute's temporaries (its float32 products)."""
    return ("kv recompute", segment, micro)


def cache_key(segment: int, micro: int = 0) -> tuple:
    """Accountant key of the assembled (B, S) cache the launch attends and appends to."""
    return ("kv cache", segment, micro)


def streamed_layers(plan: ExecutionPlan, segment: Segment) -> tuple[tuple[int, int], ...]:
    """(layer, r) of each layer whose ``streamed`` KV cache ``segment`` attends."""
    if STREAMED not in plan.kv:
        return ()
    return tuple((layer, plan.recompute(layer)) for layer in segment.cache_layers
                 if plan.kv[layer] == STREAMED)


def kv_link_bytes(spec: ModelSpec, rows: int, positions: int, recompute: int) -> tuple[int, int]:
    """(activation bytes, K/V bytes) a ``streamed`` layer copies H2D for ``positions`` cache
    positions of ``rows`` rows with r = ``recompute`` (clipped to ``positions``): the ``h`` of
    [0, r), r·B·d_model·itemsize (``models.tensors.activation_bytes``), and the K, V of
    [r, positions) (``models.tensors.kv_bytes``)."""
    r = min(recompute, positions)
    return activation_bytes(spec, "h", rows, r), kv_bytes(spec, rows, positions - r)


def copy_end(slots: int, recompute: int, written: int) -> int:
    """End of the slots a ``kv load`` copies, [r, end): the ``written`` slots (the step's
    write index) rounded up to ``COPY_QUANTUM``, at least r, at most S (``hx.streamed_kv``).
    Slots from ``written`` on hold no key a query of this step reads before the step writes
    it."""
    return min(slots, max(recompute, math.ceil(written / COPY_QUANTUM) * COPY_QUANTUM))


@functools.lru_cache(maxsize=256)
def weight_sizes(spec: ModelSpec) -> dict[str, int]:
    """Bytes of each op's weights (``ModelSpec.op_weight_bytes``; kept: the schedules and the
    simulator ask for every segment; the dict is not to be changed)."""
    return {op: spec.op_weight_bytes(op) for op in OPS if op not in EXPERT_OPS}


def op_bytes(spec: ModelSpec, segment: Segment, index: int) -> int:
    """Bytes of the weights op ``index`` of ``segment`` holds (``weight_sizes`` of its layer's
    spec, ``Segment.op_spec``: a dense first layer's MLP, a part of an MoE layer's
    experts)."""
    op, held = segment.ops[index][1], segment.op_spec(spec, index)
    if segment.parts and segment.parts[index] >= 0:
        return held.op_weight_bytes(op)
    return weight_sizes(held)[op]


def staged_bytes(spec: ModelSpec, segment: Segment) -> int:
    """Bytes of the weights a segment copies into accelerator memory before it runs."""
    return sum(op_bytes(spec, segment, i) for i, staged in enumerate(segment.staged) if staged)


def disk_bytes(plan: ExecutionPlan, spec: ModelSpec, segment: Segment) -> int:
    """Bytes of the segment's weights kept on disk (read into host memory each step)."""
    return sum(op_bytes(spec, segment, i) for i, (layer, op) in enumerate(segment.ops)
               if plan.weight_home(layer, op) == DISK)


def read_buffer_bytes(plan: ExecutionPlan, spec: ModelSpec) -> int:
    """Host bytes of the disk tier's read buffers at their peak: the largest sum of two
    consecutive disk-reading segments' ``disk_bytes`` in the order the executor reads them
    (``hx.disk``: at most two segments' reads are held at once; each phase's segments in turn,
    the last of a step followed by the first of the next, and prefill's last by decode's
    first). A single disk-reading segment is its own neighbour: two steps of it overlap. 0
    without disk-homed weights."""
    reads = {phase: [b for b in (disk_bytes(plan, spec, seg)
                                 for seg in split_segments(plan, phase)) if b]
             for phase in ("prefill", "decode")}
    pairs = [0]
    for order in reads.values():
        pairs += [a + b for a, b in zip(order, order[1:] + order[:1])]
    if reads["prefill"] and reads["decode"]:
        pairs.append(reads["prefill"][-1] + reads["decode"][0])
    return max(pairs)


class Instruction(NamedTuple):
    """One thing the executor does in a step (a named tuple: a schedule builds thousands of
    them while the planner prices its patterns, at a third of a frozen dataclass's cost).

    Attributes:
      kind: ``wait``, ``stage``, ``step``, ``move``, ``launch``, ``free``, ``read`` (the
        segment's disk-homed weights read into host memory) or ``kv read`` (a micro-batch's
        KV caches of the segment's disk-homed layers read into host memory); reads occupy
        the ``disk`` resource (the executor runs ``read``, not yet ``kv read``).
      segment: index of the segment it concerns (None for ``free``).
      micro: the micro-batch a ``step``, ``move`` or ``launch`` is for (0 for the others).
      resource: what it occupies: ``H2D``/``D2H`` (copies), ``accelerator``/``host``
        (compute), ``sync`` (the executor blocked on a device), or None when it costs nothing
        the simulator models (step inputs; tokens already in host memory).
      names: ``move``: activations copied; ``launch``: activations written.
      nbytes: bytes copied (``stage``, ``move``).
      frees: accountant keys released first.
      allocs: (key, owner, bytes) allocated on the accelerator after the frees.
      releases: keys freed once it is done, after its allocations (what it consumed: the
        copies a streamed cache is assembled from).
      deps: indices of the earlier instructions it must follow: the launches that produced
        what it moves or reads, its segment's stage, disk reads and input copy, and the
        stream's last wait (the step's data-flow edges; the executor's timeline and the
        simulator both take them from here).
      tokens: ``act load``, ``recompute``: the positions r whose K, V are recomputed (summed
        over the segment's streamed layers; 0 for the others).
    """

    kind: str
    segment: int | None
    micro: int = 0
    resource: str | None = None
    names: tuple[str, ...] = ()
    nbytes: int = 0
    frees: tuple[Hashable, ...] = ()
    allocs: tuple[tuple[Hashable, str, int], ...] = ()
    releases: tuple[Hashable, ...] = ()
    deps: tuple[int, ...] = ()
    tokens: int = 0


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


@functools.lru_cache(maxsize=256)
def activation_sizes(spec: ModelSpec, batch: int, tokens: int) -> dict[str, int]:
    """Bytes of every activation of one micro-batch at (B, T) (``activation_bytes``; kept:
    every schedule of a model at a shape asks; the dict is not to be changed)."""
    return {name: activation_bytes(spec, name, batch, tokens) for name in ACTIVATIONS}


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
    """``build_schedule``, cached (all arguments are immutable): the simulator prices the same
    step once per prefill chunk and per candidate plan."""
    return build_schedule(plan, spec, phase, batch, tokens, slots, temp_bytes, micro_batches)


def build_schedule(plan: ExecutionPlan, spec: ModelSpec, phase: str, batch: int, tokens: int,
                   slots: int, temp_bytes: TempBytes | None = None, micro_batches: int = 1
                   ) -> Schedule:
    """Compile one step of ``plan``'s ``phase`` into instructions (uncached: for a plan priced
    once, as the planner's layer patterns are; ``compile_schedule`` keeps them).

    Args:
      batch, tokens, slots: B rows per micro-batch, T new tokens per row (a prefill chunk, or
        1 in decode), S KV-cache slots.
      micro_batches: N micro-batches run through each segment in turn (the zig-zag block
        schedule; 1: an ordinary step).
      temp_bytes: XLA temporary bytes of an accelerator segment at (B, T, S)
        (``hx.programs.Programs.temp_bytes``); None sizes them 0 (the simulator needs no
        sizes; the executor measures its own).
    """
    build = _Builder(plan, spec, split_segments(plan, phase), batch, tokens, slots,
                     temp_bytes, micro_batches)
    for i in range(len(build.segments)):
        build.segment(i)
    build.finish()
    return Schedule(phase, build.segments, tuple(build.out), batch, tokens, slots,
                    micro_batches)


class _Builder:
    """The instruction list of one step as ``build_schedule`` issues it, with each
    instruction's dependencies: the one record of who produced what in a step."""

    def __init__(self, plan: ExecutionPlan, spec: ModelSpec, segments: tuple[Segment, ...],
                 batch: int, tokens: int, slots: int, temp_bytes: TempBytes | None,
                 micro_batches: int):
        self.plan, self.spec, self.segments = plan, spec, segments
        self.B, self.T, self.S, self.N, self.temp_bytes = (batch, tokens, slots,
                                                           micro_batches, temp_bytes)
        self.moves_of, self.next_stream = crossings(segments), next_streaming(segments)
        # a layer's streamed experts whose step routes past ``WHOLE_PART_ROUTINGS`` an expert
        # cross whole, with no ``route``, into ``WHOLE_PART_BUFFERS`` buffers: each waited for
        # at the start of the segment after it (its buffer freed) and the part that buffer
        # takes next staged there, the first parts at the step's start; {segment: [(the part
        # to wait for or None, the part to stage or None)]}
        self.whole = [seg.routes and whole_part(seg.parts[0], batch * tokens, spec.moe.top_k)
                      for seg in segments]
        parts = [j for j, whole in enumerate(self.whole) if whole]
        self.whole_stage: dict[int, list[tuple[int | None, int | None]]] = {}
        ahead = [None] * WHOLE_PART_BUFFERS + parts
        for previous, j in zip(ahead, parts + [None] * WHOLE_PART_BUFFERS):
            self.whole_stage.setdefault(0 if previous is None else previous + 1, []).append(
                (previous, j))
        self.out: list[Instruction] = []
        self.producer: dict[tuple[str, int], int] = {}  # (activation, micro) -> its launch
        self.last: dict[tuple[str, int], int] = {}  # (kind, segment) -> latest such
        self.synced: int | None = None  # the latest wait
        self.previous_stream: int | None = None
        self.stepped: set[tuple[str, int]] = set()
        self.held: set[tuple[str, int]] = set()
        # per segment: (layer, r) of its streamed caches; how many of its caches are on disk
        self.streamed = [streamed_layers(plan, seg) for seg in segments]
        self.disk_caches = [tuple(layer for layer in seg.cache_layers if plan.kv[layer] == DISK)
                            for seg in segments]
        # per segment: the bytes of the activations it reads and of those it writes
        self.read_sizes = [activation_sizes(seg.spec_at(spec, end=False), batch, tokens)
                           for seg in segments]
        self.write_sizes = [activation_sizes(seg.spec_at(spec, end=True), batch, tokens)
                            for seg in segments]
        weights = plan.weights
        self.reads_disk = DISK in (weights.embed, weights.head) or any(
            DISK in row for row in weights.layers)  # some weights are homed on disk
        # (segment, micro) pairs attending a streamed cache, in launch order; their loads
        self.kv_pairs = [(i, m) for i, layers in enumerate(self.streamed) if layers
                         for m in range(micro_batches)]
        self.kv_order = {pair: k for k, pair in enumerate(self.kv_pairs)}
        self.loads: dict[tuple[int, int], list[int]] = {}
        self.last_store: dict[tuple[int, int], int] = {}
        first = first_streaming(segments)
        if first is not None:
            self.stage(first)

    def add(self, deps: list[int | None], kind: str, segment: int | None, micro: int = 0,
            resource: str | None = None, names: tuple[str, ...] = (), nbytes: int = 0,
            frees: tuple[Hashable, ...] = (),
            allocs: tuple[tuple[Hashable, str, int], ...] = (),
            releases: tuple[Hashable, ...] = (), tokens: int = 0) -> int:
        """Append the ``Instruction`` of these fields with the dependencies of ``deps`` that
        exist (its fields spelled out: the planner builds millions); returns its index."""
        index = len(self.out)
        kept: list[int] = []
        for d in deps:
            if d is not None and d not in kept:
                kept.append(d)
        self.out.append(Instruction(kind, segment, micro, resource, names, nbytes, frees,
                                    allocs, releases, tuple(kept), tokens))
        self.last[(kind, segment)] = index
        return index

    def read(self, j: int) -> None:
        """Segment ``j``'s disk-homed weights into host memory, if it has any."""
        nbytes = disk_bytes(self.plan, self.spec, self.segments[j]) if self.reads_disk else 0
        if nbytes:
            self.add([self.synced], READ, j, resource=DISK_READ, nbytes=nbytes)

    def stage(self, j: int) -> None:
        self.read(j)
        nbytes = (self.segments[j].parts[0] * routed_expert_bytes(self.spec) if self.whole[j]
                  else staged_bytes(self.spec, self.segments[j]))
        self.add([self.synced, self.last.get((READ, j))], STAGE, j, resource=H2D,
                 nbytes=nbytes, allocs=((staging_key(j), "staging", nbytes),))

    def wait(self, i: int) -> None:
        """Block until streaming segment ``i`` is done; its staged buffer is reused."""
        self.synced = self.add([self.last[(LAUNCH, i)]], WAIT, i, resource=SYNC,
                               frees=(staging_key(i),))

    def segment(self, i: int) -> None:
        """Everything segment ``i`` issues: the stream's wait and next stage, then per
        micro-batch its step inputs, input copies and launch."""
        seg, late = self.segments[i], None  # late: the next weights, after i's input copies
        for previous, j in self.whole_stage.pop(i, ()):  # a whole part done, the next in
            if previous is not None:
                self.wait(previous)
            if j is not None:
                self.stage(j)
        if seg.streams:
            if self.previous_stream is not None:
                self.wait(self.previous_stream)
            j = self.next_stream[i]
            if j is not None:
                if self.moves_of[i] and inputs_ready(self.segments, i, self.moves_of[i]):
                    late = j  # on the H2D link behind inputs ready at once
                else:  # ahead of inputs the executor would block on while the link idles
                    self.stage(j)
        for m in range(self.N):
            self.step_inputs(i, m)
            self.move(i, m)
            if late is not None and m == self.N - 1:
                self.stage(late)
            self.launch(i, m)
        if seg.streams:
            self.previous_stream = i

    def step_inputs(self, i: int, m: int) -> None:
        device = self.segments[i].device
        if (device, m) in self.stepped:
            return
        self.stepped.add((device, m))
        nbytes = step_bytes(self.B, self.T)
        self.add([], STEP, i, m, None, nbytes=nbytes, allocs=(
            ((step_key(m), "activations", nbytes),) if device == ACCELERATOR else ()))

    def move(self, i: int, m: int) -> None:
        moves = self.moves_of[i]
        if not moves:
            return
        on_acc = self.segments[i].device == ACCELERATOR
        nbytes, producers = 0, []
        for n in moves:
            nbytes += self.read_sizes[i][n]
            producers.append(self.producer.get((n, m)))
        resource = None if moves == ("tokens",) and not on_acc else (H2D if on_acc else D2H)
        self.add(producers, MOVE, i, m, resource, moves, nbytes,
                 allocs=((INPUT_KEY, "activations", nbytes),) if on_acc else ())

    def kv_read(self, i: int, m: int) -> int | None:
        """Micro-batch ``m``'s KV caches of segment ``i``'s disk-homed layers into host
        memory (all S slots; the simulator prices the positions written before the step)."""
        layers = self.disk_caches[i]
        if not layers:
            return None
        nbytes = cache_bytes(self.spec, self.B, self.S, layers)
        return self.add([self.synced], KV_READ, i, m, DISK_READ, ("kv",), nbytes)

    def routed(self, i: int, m: int) -> int:
        """A layer's streamed experts, before launch (i, m): ``route`` reads the routing
        weights back once the router has run (D2H; the executor blocks on it), then
        ``experts in`` copies the experts of the part it routes to (H2D) into a buffer of
        ``routed_slots`` experts, the most it can route to -- the size it allocates, the
        bytes it is priced at before the routing is known; returns ``experts in``."""
        seg = self.segments[i]
        route = self.add([self.producer.get(("a", m))], ROUTE, i, m, D2H, ("a",),
                         routing_bytes(self.spec, self.B, self.T))
        slots = routed_slots(seg.parts[0], self.B * self.T, self.spec.moe.top_k)
        nbytes = slots * routed_expert_bytes(self.spec)
        return self.add([route, self.synced], EXPERTS_IN, i, m, H2D, ("experts",), nbytes,
                        allocs=((experts_key(i, m), "staging", nbytes),))

    def launch(self, i: int, m: int) -> None:
        seg, last, producer = self.segments[i], self.last, self.producer
        deps = [last.get((STAGE, i)), last.get((READ, i)),
                last.get((MOVE, i)) if self.moves_of[i] else None,
                self.synced if seg.streams else None,
                self.kv_read(i, m) if self.disk_caches[i] else None]
        for n in seg.reads:
            deps.append(producer.get((n, m)))
        if self.streamed[i]:
            deps += self.streamed_cache(i, m)
        routed = seg.routes and not self.whole[i]  # copied as routed, not staged whole
        if routed:
            deps.append(self.routed(i, m))
        if seg.device == ACCELERATOR:
            temp = self.temp_bytes(seg, self.B, self.T, self.S) if self.temp_bytes else 0
            allocs = [(TEMP_KEY, "activations", temp)]
            for n in seg.writes:
                allocs.append((act_key(n, m), "activations", self.write_sizes[i][n]))
                self.held.add((n, m))
            index = self.add(deps, LAUNCH, i, m, ACCELERATOR, seg.writes,
                             allocs=tuple(allocs),
                             releases=(experts_key(i, m),) if routed else ())
        else:  # the host's outputs replace any held on the accelerator
            dropped = []
            for n in seg.writes:
                if (n, m) in self.held:
                    self.held.remove((n, m))
                    dropped.append(act_key(n, m))
            index = self.add(deps, LAUNCH, i, m, HOST, seg.writes, frees=tuple(dropped))
        for n in seg.writes:
            producer[(n, m)] = index
        if self.streamed[i]:
            self.store(i, m, index)

    def streamed_cache(self, i: int, m: int) -> list[int]:
        """Before launch (i, m) of a segment attending streamed caches: its loads (unless
        prefetched), its recompute, then the next pair's loads; returns what the launch
        waits for (the K/V load and the recompute)."""
        k = self.kv_order.get((i, m))
        if k is None:
            return []
        self.load(k)
        deps = self.loads[(i, m)][-1:]
        layers = self.streamed[i]
        r = sum(r for _, r in layers)
        if r:
            # each layer's recomputed slots, at most what it holds
            heads = [min(r, layer_slots(self.spec, layer, self.S)) for layer, r in layers]
            head = sum(kv_bytes(self.spec, self.B, n) for n in heads)
            held = cache_bytes(self.spec, self.B, self.S, [layer for layer, _ in layers])
            after = [self.last.get((STAGE, i)), self.synced if self.segments[i].streams
                     else None]
            # the K and V products in float32 before their cast: the recompute's temporaries
            temp = sum(self.B * n * self.spec.n_kv_heads * 4 * (
                self.spec.kv_width("k") + self.spec.kv_width("v")) for n in heads)
            deps.append(self.add(
                self.loads[(i, m)][:1] + after, RECOMPUTE, i, m, ACCELERATOR, ("k", "v"),
                tokens=r,
                allocs=((head_key(i, m), "kv", head), (cache_key(i, m), "kv", held),
                        (recompute_temp_key(i, m), "activations", temp)),
                releases=(act_copy_key(i, m), copy_key(i, m), head_key(i, m),
                          recompute_temp_key(i, m))))
        if k + 1 < len(self.kv_pairs):
            self.load(k + 1)
        return deps

    def load(self, k: int) -> None:
        """H2D loads of pair ``k`` (once): activations of [0, r), then K, V of [r, S) (at
        r = 0 the assembled cache itself), behind the store of pair k - 2, whose buffer they
        reuse."""
        pair = self.kv_pairs[k]
        if pair in self.loads:
            return
        i, m = pair
        after = [self.last_store.get(self.kv_pairs[k - 2])] if k >= 2 else []
        layers = self.streamed[i]
        acts, kvs = map(sum, zip(*(kv_link_bytes(self.spec, self.B,
                                                 layer_slots(self.spec, layer, self.S), r)
                                   for layer, r in layers)))
        r = sum(r for _, r in layers)
        self.loads[pair] = []
        allocs = [(copy_key(i, m), "kv", kvs)]
        if r:
            self.loads[pair].append(self.add(
                after, ACT_LOAD, i, m, H2D, ("h",), acts,
                allocs=((act_copy_key(i, m), "kv", acts),), tokens=r))
        else:  # the copy, padded to S slots, is the cache
            allocs.append((cache_key(i, m), "kv", cache_bytes(self.spec, self.B, self.S,
                                                              [layer for layer, _ in layers])))
        self.loads[pair].append(self.add(
            after, KV_LOAD, i, m, H2D, ("k", "v"), kvs, allocs=tuple(allocs),
            releases=() if r else (copy_key(i, m),)))

    def store(self, i: int, m: int, launch: int) -> None:
        """D2H of the new positions' K, V (and with r > 0 their ``h``) after the launch;
        frees the assembled cache."""
        layers = self.streamed[i]
        if not layers:
            return
        nbytes = len(layers) * kv_bytes(self.spec, self.B, self.T)
        nbytes += sum(self.read_sizes[i]["h"] for _, r in layers if r)
        self.last_store[(i, m)] = self.add(
            [launch], KV_STORE, i, m, D2H, ("k", "v"), nbytes, frees=(cache_key(i, m),))

    def finish(self) -> None:
        """The last stream's wait (and the last whole part's of streamed experts, where it is
        the last segment), then the end of the step: free what the step allocated."""
        if self.previous_stream is not None:
            self.wait(self.previous_stream)
        for previous, _ in (p for pairs in self.whole_stage.values() for p in pairs):
            if previous is not None:  # not waited for at a segment after it
                self.wait(previous)
        frees: list[Hashable] = [TEMP_KEY, INPUT_KEY] + [step_key(m) for m in range(self.N)]
        frees += [act_key(n, m) for n, m in sorted(self.held)]
        self.add([], FREE, None, frees=tuple(frees))


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
    """Replay ``schedule``'s frees, allocations and releases in order; the peak is what the
    step needs on top of resident weights and KV caches."""
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
        for key in ins.releases:
            total -= live.pop(key, (None, 0))[1]
    return result
