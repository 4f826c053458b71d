"""Discrete-event replay of one executor step of a plan on a ``HardwareProfile``
(docs/architecture.md, "Planner").

The replay prices the instructions of the step's ``hx.schedule.Schedule`` -- the list
``hx.executor.Executor.run`` carries out: the first streaming segment's weights are staged at
once, the next one's when the previous streaming segment has finished; the activations a
segment reads from the other side cross in one transfer (link latency + bytes / bandwidth);
each segment costs its device's launch overhead
(the executor's Python dispatch, taken as serial: on a 2-core host it competes with compute)
plus its ops; after waiting for a streaming segment the executor needs ``sync_overhead`` before
the next copy and launch go out (the ``sync`` resource). Every piece of work is a task on one
resource -- ``accelerator`` and ``host`` compute, ``H2D`` and ``D2H`` copies, ``sync``, and
``disk`` reads of disk-homed weights into host memory (bytes / the profile's disk read
bandwidth, issued with the segment's weight copy and before it) -- and
each resource runs its tasks one at a time in issue order, once their inputs are ready. When
copies and computation run at the same moment they share the machine: both progress at
1 / (1 + ``contention``) of their speed (contention 0: independent engines, as a GPU's DMA and
SMs nearly are; 1: serialised); when both devices compute at the same moment, each progresses
at 1 / (1 + ``compute_contention``) (0 for a GPU beside a CPU; near 1 where the accelerator
shares the host's cores, as an emulated one does).

Durations come from ``planner.cost`` (FLOPs and bytes) and the profile's rates: a matmul op at
M rows takes flops / matmul_rate(M), plus its compressed weights' decompression
(``DeviceProfile.dequantize_seconds``); SCORE reads its KV cache at the device's attention rate
(all S slots on the accelerator, at its S; the used prefix on the host, as ``host_compute``
does, at the rate of the profiler's probe that reads as many bytes, since the host picks its
kernel by the bytes of a call) or is compute-bound, whichever is slower; EMBED moves its rows
at memory bandwidth. A ``streamed`` KV cache (host memory, attended on the accelerator) crosses
the link each step for the positions in the cache before the step (``context`` - ``tokens``):
the ``h`` of [0, r) and the K, V of [r, ·), each copy latency + bytes / H2D bandwidth
(``kv_load_seconds``); the recompute is the K and V ops at r new tokens per row on the
accelerator plus a launch (``recompute_seconds``); the cache is then assembled on the
accelerator at its memory bandwidth, before the launch (``assemble_seconds``); the new
positions' K, V (and ``h``) go back as one D2H transfer (KVPR, Jiang et al. 2024: the
recompute overlaps the K/V copy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

from hx.devices import ACCELERATOR, HOST
from hx.models.spec import EMBED, SCORE, ModelSpec
from hx.models.formats import REPACK_ROWS, blocks_layout
from hx.models.holding import ggml_matrices
from hx.models.tensors import int4_matrices, kv_bytes, layer_slots, weight_dtype
from hx.plan import DISK, ExecutionPlan
from hx.planner.cost import op_cost, routed_chance, routed_experts
from hx.planner.mesh import collective_seconds
from hx.planner.profile import DeviceProfile, HardwareProfile
from hx.errors import HxError
from hx.schedule import (ACT_LOAD, D2H, EXPERTS_IN, H2D, KV_READ, KV_STORE, LAUNCH, MOVE,
                         READ, RECOMPUTE, ROUTE, STAGE, WAIT, build_schedule, compile_schedule,
                         copy_end, kv_link_bytes, routed_expert_bytes, streamed_layers)
from hx.segments import Segment
from hx.timeline import ACC_COMPUTE, HOST_COMPUTE, Event, Timeline
from hx.workload import Workload, prefill_chunks, round_up

if TYPE_CHECKING:
    from hx.planner.experts import ExpertActivity

COPY_RESOURCES, COMPUTE_RESOURCES = (H2D, D2H), (ACCELERATOR, HOST)
Picks = Mapping[tuple[int, str], tuple[float, ...]]  # (layer, op) -> its experts' p_e
HOST_ATTENTION_BLOCK = 64  # slots per block of xla_attention (numpy reads at most 63 fewer)


@dataclass
class Task:
    """One piece of work on one resource. Times in seconds from the start of the step;
    ``nbytes``: bytes a copy moves (0 for compute)."""

    resource: str
    name: str
    duration: float
    deps: tuple[int, ...] = ()
    start: float = 0.0
    end: float = 0.0
    nbytes: int = 0


@dataclass
class Prediction:
    """Predicted step time and how busy each resource was (seconds)."""

    seconds: float
    busy: dict[str, float] = field(default_factory=dict)
    tasks: list[Task] = field(default_factory=list)


def op_seconds(spec: ModelSpec, profile: HardwareProfile, device: str, op: str, batch: int,
               tokens: int, slots: int, context: int) -> float:
    """Seconds of one op on ``device``: ``tokens`` new tokens per row, ``slots`` cache slots,
    ``context`` of them in use (the host SCORE kernel reads only those); on the accelerator
    under tensor parallelism, with the collective that ends it (``mesh.collective_seconds``:
    ``spec`` is then the shard)."""
    rates = profile.device(device)
    seconds = rates.scale(batch) * _op_seconds(spec, rates, device, op, batch, tokens, slots,
                                               context)
    if device == ACCELERATOR:  # its all-reduce under tensor parallelism
        seconds += collective_seconds(spec, profile, op, batch, tokens)
    return seconds


def host_read_slots(slots: int, context: int) -> int:
    """Cache slots a host SCORE reads at ``context`` slots in use: the used prefix, rounded up
    to ``xla_attention``'s block (the numpy kernel reads at most 63 fewer), at most ``slots``."""
    return min(slots, round_up(context, HOST_ATTENTION_BLOCK))


def _op_seconds(spec, rates, device, op, batch, tokens, slots, context) -> float:
    dtype = weight_dtype(spec, device)  # what the op multiplies in
    if op == SCORE:
        read = slots if device == ACCELERATOR else host_read_slots(slots, context)
        c = op_cost(spec, op, batch, tokens, read)
        # the host's kernel is chosen by the bytes one call reads (numpy from 64 MiB:
        # ``host_compute.attention``), so a host SCORE is priced at the attention probe that
        # reads as many bytes; the accelerator's at its own S
        at = read if device == ACCELERATOR else rates.probe_slots(c.kv_read_bytes, spec.dtype)
        return max(rates.attention_seconds(c.kv_read_bytes, at, spec.dtype),
                   rates.matmul_seconds(c.flops, c.rows, dtype))
    c = op_cost(spec, op, batch, tokens, slots)
    if op == EMBED:
        return c.other_bytes / rates.memory_bandwidth
    if device == HOST and int4_matrices(spec, op):  # torch's int4 kernel: no decompression
        return rates.matmul_seconds(c.flops, c.rows, dtype, int4=True)
    if device == HOST and (ggml := ggml_seconds(spec, rates, op, c.rows)) is not None:
        return ggml
    return rates.matmul_seconds(c.flops, c.rows, dtype) + sum(
        rates.dequantize_seconds(fmt, n, dtype) for fmt, n in c.dequantized)


def ggml_seconds(spec: ModelSpec, rates: DeviceProfile, op: str, rows: int) -> float | None:
    """Seconds of ``op``'s products at M = ``rows`` by ggml's kernels, where the host holds its
    matrices in a GGUF's blocks (``models.holding.ggml_matrices``) and the profile measured
    each one's layout to ``rows`` (``DeviceProfile.ggml_seconds``: a curve ends at the rows its
    kernel takes; past them hx decompresses for XLA); a matrix whose rows only multiply is held
    repacked where the profile has that layout, as the loader holds it on the machine that
    measured it. An MoE layer's routed experts (stacked matrices, ggml's ``mul_mat_id``) are
    priced as the experts the rows run (``cost.routed_experts``), each a product over its
    rows (at most the curve's last M), not as X/k times the work. None otherwise (priced as
    a decompression and a dense product)."""
    matrices = ggml_matrices(spec, op)
    if not matrices:
        return None
    seconds, measured = 0.0, dict(rates.ggml_matmul)
    for fmt, n, k, stays, stacked in matrices:
        layout = blocks_layout(fmt, stays and n % REPACK_ROWS == 0
                               and blocks_layout(fmt, True) in measured)
        if stacked > 1:  # routed experts: each run expert over its rows (mul_mat_id, any M)
            run, m = routed_experts(spec.moe, rows)
            curve = measured.get(layout)
            at = min(max(1, round(m)), curve[-1][0]) if curve else 1
            each = rates.ggml_seconds(layout, 2.0 * m * (n // stacked) * k, at)
            each = None if each is None else run * each
        else:
            each = rates.ggml_seconds(layout, 2.0 * rows * n * k, rows)
        if each is None:
            return None
        seconds += each
    return seconds


def recompute_seconds(spec: ModelSpec, profile: HardwareProfile, batch: int,
                      positions: int) -> float:
    """Seconds to recompute the K and V of ``positions`` cache positions of ``batch`` rows on
    the accelerator from their activations ``h``: the accelerator's launch overhead plus the
    K and V ops (RoPE riding with K) at T = ``positions`` new tokens per row (``op_seconds``:
    flops / matmul_rate(B·positions)); 0 for no positions."""
    if positions <= 0:
        return 0.0
    acc = profile.device(ACCELERATOR)
    return acc.launch_seconds(batch) + sum(
        op_seconds(spec, profile, ACCELERATOR, op, batch, positions, positions, positions)
        for op in ("K", "V"))


def assemble_seconds(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                     segment: Segment, batch: int, slots: int, prior: int) -> float:
    """Accelerator seconds to assemble ``segment``'s ``streamed`` caches before its launch
    (``hx.streamed_kv.assemble``): a launch, and the copied and recomputed slots read and all
    S written at the accelerator's memory bandwidth; 0 for a cache copied whole (r = 0 and the
    written slots' quanta reach S: the copy is the cache)."""
    acc, seconds = profile.device(ACCELERATOR), 0.0
    for layer, r in streamed_layers(plan, segment):
        held = layer_slots(spec, layer, slots)
        end = copy_end(held, r, prior)
        if r or end < held:
            seconds += acc.launch_seconds(batch) + (
                kv_bytes(spec, batch, end) + kv_bytes(spec, batch, held)) / acc.memory_bandwidth
    return seconds


def kv_load_seconds(spec: ModelSpec, profile: HardwareProfile, batch: int, positions: int,
                    recompute: int) -> tuple[float, float]:
    """(activation copy, K/V copy) seconds of one ``streamed`` layer's cache of ``positions``
    positions with r = ``recompute`` (``schedule.kv_link_bytes``): each
    ``transfer_latency`` + bytes / ``h2d_bandwidth`` (the activation copy is 0 at r = 0)."""
    acts, kvs = kv_link_bytes(spec, batch, positions, recompute)
    link = profile.h2d_bandwidth
    return ((profile.transfer_latency + acts / link) if acts else 0.0,
            profile.transfer_latency + kvs / link)


def stage_seconds(profile: HardwareProfile, segment: Segment, nbytes: int) -> float:
    """Seconds of a ``stage``: one ``device_put`` per staged op (per expert of a layer's
    streamed experts staged whole), each ``h2d_latency``, plus the segment's staged bytes
    ``nbytes`` (``schedule.staged_bytes``) at ``h2d_bandwidth``."""
    copies = segment.parts[0] if segment.routes else sum(segment.staged)
    return copies * profile.h2d_latency + nbytes / profile.h2d_bandwidth


@functools.lru_cache(maxsize=256)
def step_memo(spec: ModelSpec, profile: HardwareProfile, batch: int, tokens: int, slots: int,
              context: int) -> dict[tuple[str, str], float]:
    """The ``segment_seconds`` memo of every step at these shapes (kept: pricing the layer
    patterns simulates thousands of plans of one model at one shape, and every layer's op
    has the same shapes)."""
    return {}


def segment_seconds(spec: ModelSpec, profile: HardwareProfile, segment: Segment, batch: int,
                    tokens: int, slots: int, context: int,
                    memo: dict[tuple, float], picks: Picks | None = None) -> float:
    """Compute seconds of a segment: the sum of its ops. ``memo`` keeps each (device, op)'s
    ``op_seconds`` at these shapes (``step_memo``); a SCORE's per layer window: a
    sliding-window layer's over its ring (``models.tensors.held_slots``), at most that many
    slots in use; an op holding part of an MoE layer's experts at its part's spec
    (``Segment.op_spec``), with its experts' chances a row is routed to them where ``picks``
    (``expert_picks``) has its layer and op."""
    total = 0.0
    for index, (layer, op) in enumerate(segment.ops):
        window = None if layer is None else spec.layer_spec(layer).sliding_window
        part = segment.parts[index] if segment.parts else -1
        routed = (picks or {}).get((layer, op), ())
        kind = "" if layer is None else spec.layer_type(layer)  # a dense first layer's MLP
        key = (segment.device, op, window if op == SCORE else None, part, routed, kind)
        if key not in memo:
            held = layer_slots(spec, layer, slots) if op == SCORE else slots
            op_spec = segment.op_spec(spec, index)
            if routed:
                op_spec = op_spec.replace(moe=dataclasses.replace(op_spec.moe, picks=routed))
            memo[key] = op_seconds(op_spec, profile, segment.device, op, batch, tokens, held,
                                   min(context, held))
        total += memo[key]
    return total


def expert_picks(plan: ExecutionPlan, spec: ModelSpec, activity: "ExpertActivity | None"
                 ) -> Picks:
    """Per (layer, op) that runs routed experts -- MLP2 of a layer whose experts have no
    homes, each ``EXPERT_OPS`` op of one whose have (``ExpertHomes.groups``) -- its experts'
    chances a row is routed to them, ``activity``'s shares at their ids; {} for no activity
    (a random router's, ``cost.routed_experts``) or a dense model."""
    if activity is None or spec.moe is None:
        return {}
    picks: dict[tuple[int, str], tuple[float, ...]] = {}
    for layer, shares in enumerate(activity.shares):
        if spec.layer_spec(layer).moe is None:  # a dense first layer routes nothing
            continue
        groups = plan.experts.groups(layer) if plan.experts.of(layer) else (
            ("MLP2", tuple(range(len(shares)))),)
        for op, ids in groups:
            picks[(layer, op)] = tuple(shares[e] for e in ids)
    return picks


def build_tasks(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile, phase: str,
                batch: int, tokens: int, slots: int, context: int, micro_batches: int = 1,
                keep: bool = True, activity: "ExpertActivity | None" = None) -> list[Task]:
    """One task per priced instruction of the step's ``hx.schedule.Schedule``, in issue order,
    after the tasks of the instructions it depends on (``Instruction.deps``): ``read`` and
    ``kv read`` bytes / the disk's read bandwidth (a KV read only the positions written
    before the step: the step computes its own, and the host kernel's padding of the prefix
    to 64-slot blocks, ``host_read_slots``, is read from host memory, not from disk),
    ``stage`` an H2D copy of the staged weights (the link's per-copy
    latency for each staged op plus bytes / bandwidth; disk-homed experts staged whole read
    from disk first), ``wait`` the sync overhead, ``move`` a
    transfer (latency + bytes / bandwidth), ``launch`` the device's launch overhead plus its
    ops (``segment_seconds``), ``route`` a D2H copy of the routing weights and a sync,
    ``experts in`` the copies of the streamed experts a step of B·T rows is expected to route
    to (``cost.routed_experts``; the schedule sizes the most it can). A
    block of ``micro_batches`` (zig-zag block schedule) has one
    move and launch per micro-batch of ``batch`` rows. ``keep``: the schedule from
    ``compile_schedule``'s cache, else built for this once (``build_schedule``).
    ``activity``: the routed experts' (``expert_picks``), else a random router's."""
    schedule = (compile_schedule if keep else build_schedule)(
        plan, spec, phase, batch, tokens, slots, micro_batches=micro_batches)
    tasks: list[Task] = []
    task_of: dict[int, int] = {}  # instruction index -> its task
    prior = min(max(context - tokens, 0), slots)  # cache positions written before the step
    op_memo = step_memo(spec, profile, batch, tokens, slots, context)
    compute: dict[int, tuple[float, str]] = {}  # segment -> seconds and name
    launch = {d: profile.device(d).launch_seconds(batch) for d in COMPUTE_RESOURCES}
    picks = expert_picks(plan, spec, activity)

    for index, ins in enumerate(schedule.instructions):
        if ins.resource is None:
            continue
        kind, i, nbytes = ins.kind, ins.segment, ins.nbytes
        if kind == LAUNCH:  # the same for every micro-batch
            if i not in compute:
                seg = schedule.segments[i]
                compute[i] = (
                    launch[seg.device]
                    + segment_seconds(spec, profile, seg, batch, tokens, slots, context, op_memo,
                                      picks)
                    + assemble_seconds(plan, spec, profile, seg, batch, slots, prior),
                    " ".join(op if layer is None else f"{op}{layer}" for layer, op in seg.ops))
            duration, name = compute[i]
            name = name if micro_batches == 1 else f"{name} [mb {ins.micro}]"
            nbytes = 0
        elif kind == MOVE:
            bandwidth = profile.h2d_bandwidth if ins.resource == H2D else profile.d2h_bandwidth
            name = " ".join(ins.names)
            duration = profile.transfer_latency + nbytes / bandwidth
        elif kind == STAGE:
            seg = schedule.segments[i]  # disk-homed experts staged whole: read, then copied
            read = sum(plan.experts.on_disk(seg.ops[0][0])) if seg.routes else 0
            name, duration = f"weights {i}", stage_seconds(profile, seg, nbytes) + (
                read * routed_expert_bytes(spec) / _disk(profile, plan) if read else 0.0)
        elif kind == WAIT:
            name, duration, nbytes = f"wait {i}", profile.sync_overhead, 0
        elif kind == READ:
            name, duration = f"read {i}", nbytes / _disk(profile, plan)
        elif kind == KV_READ:  # the prefix written before the step (a ring's, at most whole)
            nbytes = sum(kv_bytes(spec, batch, min(prior, layer_slots(spec, layer, slots)))
                         for layer in schedule.segments[i].cache_layers
                         if plan.kv[layer] == DISK)
            name, duration = f"read KV {i}", nbytes / _disk(profile, plan)
        elif kind == KV_STORE:
            name = f"kv store {i}"
            duration = profile.transfer_latency + nbytes / profile.d2h_bandwidth
        elif kind in (ROUTE, EXPERTS_IN):
            name, duration, nbytes = _routed(plan, spec, profile, kind, schedule.segments[i],
                                             nbytes, batch * tokens, picks)
            name = f"{name} {i}"
        else:  # ACT_LOAD, KV_LOAD, RECOMPUTE
            name, duration, nbytes = _streamed_cache(plan, spec, profile, kind,
                                                     schedule.segments[i], batch, slots, prior)
            name = f"{name} {i}"
        deps = []  # the tasks of the instructions it follows (those priced)
        for d in ins.deps:
            if d in task_of:
                deps.append(task_of[d])
        task_of[index] = len(tasks)
        tasks.append(Task(ins.resource, name, duration, tuple(deps), nbytes=nbytes))
    return tasks


def _routed(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile, kind: str,
            seg: Segment, nbytes: int, rows: int, picks: Picks) -> tuple[str, float, int]:
    """(name, seconds, bytes) of a streamed expert part's ``route`` (its routing weights, the
    schedule's ``nbytes``, back over D2H with the executor blocked on them) or ``experts in``
    (the part's experts a step of ``rows`` rows is expected to route to, one H2D copy each:
    ``cost.routed_experts`` at ``picks``' chances where it has the part, else a random
    router's; those homed on disk read first at the disk's read bandwidth)."""
    if kind == ROUTE:
        return "route", (profile.transfer_latency + nbytes / profile.d2h_bandwidth
                         + profile.sync_overhead), nbytes
    part = seg.op_spec(spec, 0).moe  # the segment runs the streamed part alone
    if seg.ops[0] in picks:
        part = dataclasses.replace(part, picks=picks[seg.ops[0]])
    p = np.asarray(part.picks) if part.picks else np.full(part.experts, part.top_k / part.routed)
    copies, each = routed_experts(part, rows)[0], routed_expert_bytes(spec)
    nbytes = round(copies * each)
    seconds = copies * profile.h2d_latency + nbytes / profile.h2d_bandwidth
    on_disk = np.asarray(plan.experts.on_disk(seg.ops[0][0]), bool)
    if on_disk.any():
        seconds += routed_chance(p[on_disk], rows).sum() * each / _disk(profile, plan)
    return "experts", seconds, nbytes


def _streamed_cache(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile, kind: str,
                    seg: Segment, batch: int, slots: int, prior: int) -> tuple[str, float, int]:
    """(name, seconds, bytes) of a streamed cache's ``act load``, ``kv load`` or
    ``recompute`` over the ``prior`` positions in the cache (summed over the segment's
    streamed layers). A copy of part of the host cache is sliced there first
    (``hx.streamed_kv.host_slice``: the ``h`` of [0, r) always, K and V unless the whole
    cache crosses): a host launch and the bytes read and written at its memory bandwidth."""
    layers = [(layer_slots(spec, layer, slots), r)
              for layer, r in streamed_layers(plan, seg)]  # a ring's slots, not S
    if kind == RECOMPUTE:
        return "recompute K V", sum(recompute_seconds(spec, profile, batch,
                                                      min(r, prior, held))
                                    for held, r in layers), 0
    part = 0 if kind == ACT_LOAD else 1
    host = profile.device(HOST)
    seconds = nbytes = 0
    for held, r in layers:
        written = min(prior, held)
        moved = kv_link_bytes(spec, batch, written, r)[part]
        seconds += kv_load_seconds(spec, profile, batch, written, r)[part]
        if kind == ACT_LOAD or r or copy_end(held, 0, written) < held:  # sliced on the host
            seconds += host.launch_seconds(batch) + 2 * moved / host.memory_bandwidth
        nbytes += moved
    return ("h" if kind == ACT_LOAD else "KV"), seconds, nbytes


def _disk(profile: HardwareProfile, plan: ExecutionPlan) -> float:
    """The profile's disk read bandwidth (bytes/s).

    Raises:
      HxError: the profile has no disk tier.
    """
    if not profile.disk_read_bandwidth:
        raise HxError(f"plan {plan.name!r} keeps data on disk, but the hardware profile "
                      f"{profile.name!r} has no disk tier")
    return profile.disk_read_bandwidth


def run_tasks(tasks: list[Task], contention: float, compute_contention: float = 0.0,
              links: dict[str, str] | None = None) -> float:
    """Replay ``tasks`` (fills their start and end); returns the makespan in seconds.

    While copies and computation run at once, every running task progresses at
    1 / (1 + ``contention``) of its speed; while both devices compute at once, each
    computation progresses at a further 1 / (1 + ``compute_contention``). ``links`` maps
    resources (in-order queues, e.g. CUDA streams) onto the link they copy over: while n of
    one link's resources run, each progresses at a further 1 / n (the link's bandwidth shared
    equally, as one DMA engine time-slices the streams' copies); resources not named share
    nothing."""
    queues: dict[str, list[int]] = {}
    pending = [len(t.deps) for t in tasks]  # unfinished dependencies
    dependents: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        queues.setdefault(t.resource, []).append(i)
        for d in t.deps:
            dependents[d].append(i)
    heads = dict.fromkeys(queues, 0)
    remaining = [t.duration for t in tasks]
    unfinished = len(tasks)
    running: dict[str, int] = {}
    slowed, both_slowed = 1.0 / (1.0 + contention), 1.0 / (1.0 + compute_contention)
    now = 0.0
    free = list(queues)  # resources that may start their next task now
    while True:
        for r in free:
            queue, head = queues[r], heads[r]
            if r not in running and head < len(queue) and not pending[queue[head]]:
                running[r] = i = queue[head]
                tasks[i].start = now
        if not running:
            break
        computing, copying = 0, False
        for r in running:
            if r in COMPUTE_RESOURCES:
                computing += 1
            elif r in COPY_RESOURCES:
                copying = True
        shared = slowed if computing and copying else 1.0
        compute_speed = shared * (both_slowed if computing == 2 else 1.0)
        speed = {}
        for r in running:
            speed[r] = compute_speed if r in COMPUTE_RESOURCES else shared
        if links:
            on_link: dict[str, int] = {}
            for r in running:
                if r in links:
                    on_link[links[r]] = on_link.get(links[r], 0) + 1
            speed = {r: v / on_link.get(links.get(r), 1) for r, v in speed.items()}

        dt = math.inf  # until the first running task ends
        for r, i in running.items():
            until = remaining[i] / speed[r]
            if until < dt:
                dt = until
        now += dt
        free = []  # the resources whose task ends now, then those of the tasks that may start
        for r, i in running.items():
            remaining[i] -= dt * speed[r]
            if remaining[i] <= 1e-12:
                free.append(r)
        for r in free[:]:
            i = running.pop(r)
            tasks[i].end = now
            unfinished -= 1
            heads[r] += 1
            for j in dependents[i]:
                pending[j] -= 1
                if not pending[j]:
                    free.append(tasks[j].resource)
    if unfinished:
        raise RuntimeError("simulated schedule deadlocked")  # a bug in build_tasks
    return now


def predict(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile, phase: str,
            batch: int, tokens: int, slots: int, context: int | None = None,
            micro_batches: int = 1, keep: bool = True,
            activity: "ExpertActivity | None" = None) -> Prediction:
    """Predicted wall time of one executor step of ``phase``.

    Args:
      batch, tokens: rows (per micro-batch) and new tokens per row (the prompt length in
        prefill, 1 in decode).
      slots: KV-cache slots S.
      context: slots in use (default: all of them).
      micro_batches: N micro-batches in the block (the step serves N·batch rows).
      keep: keep the step's schedule for later predictions (``compile_schedule``); False
        for a plan priced once (the planner's layer patterns: thousands of schedules kept
        would push out the others and keep the garbage collector busy).
      activity: an MoE model's routed experts' (``planner.experts.ExpertActivity``); default
        a random router's.
    """
    tasks = build_tasks(plan, spec, profile, phase, batch, tokens, slots,
                        slots if context is None else context, micro_batches, keep, activity)
    seconds = run_tasks(tasks, profile.contention, profile.compute_contention)
    busy: dict[str, float] = {}
    for t in tasks:
        busy[t.resource] = busy.get(t.resource, 0.0) + t.end - t.start
    return Prediction(seconds, busy, tasks)


def predict_prefill(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                    batch: int, prompt_tokens: int, slots: int, micro_batches: int = 1,
                    activity: "ExpertActivity | None" = None) -> float:
    """Predicted seconds of a whole prefill: one step per chunk of ``plan.prefill_chunk``
    (``hx.workload.prefill_chunks``), each attending over the prompt so far, of a block of
    ``micro_batches`` micro-batches of ``batch`` rows (``activity``: ``predict``'s)."""
    done, seconds = 0, 0.0
    for chunk in prefill_chunks(prompt_tokens, plan.prefill_chunk):
        done += chunk
        seconds += predict(plan, spec, profile, "prefill", batch, chunk, slots, done,
                           micro_batches, activity=activity).seconds
    return seconds


@dataclass(frozen=True)
class RunPrediction:
    """A simulated run of a workload: its prefill, then its decode steps.

    Attributes:
      tokens_per_s: generated tokens of every row over the run's seconds (FlexGen's
        generation throughput, Sheng et al. 2023 §6): B·N·G / (t_prefill + (G - 1)·t_decode).
      ttft_s: the prefill (every row's, in the plan's chunks), seconds.
      tpot_s: one decode step of the block at the mid-generation context, seconds.
      total_s: the run, seconds.
      utilisation: resource -> busy share of the decode step's makespan.
      decode: the decode step's prediction (its tasks).
    """

    tokens_per_s: float
    ttft_s: float
    tpot_s: float
    total_s: float
    utilisation: dict[str, float]
    decode: Prediction = field(repr=False)


def prefill_groups(workload: Workload) -> float:
    """Prefill row groups of a run (each takes every chunk in turn): its rows over those of
    one prefill step (1 without spare rows; with them, join groups of ``spare_rows``)."""
    return (workload.batch * workload.micro_batches
            / (workload.prefill_rows * workload.prefill_micro_batches))


def predict_run(plan: ExecutionPlan, spec: ModelSpec, profile: HardwareProfile,
                workload: Workload, activity: "ExpertActivity | None" = None) -> RunPrediction:
    """The run of ``workload`` under ``plan``: every row's prompt in the plan's chunks
    (``prefill_groups`` groups of ``Workload.prefill_rows`` rows), then
    ``Workload.decode_steps`` decode steps at ``Workload.decode_context``; an MoE model's
    experts routed by ``activity`` (``predict``'s). CP-SAT, the policies and the ablation
    grid all price a run here."""
    P, S = workload.prompt_tokens, workload.cache_slots
    prefill = prefill_groups(workload) * predict_prefill(
        plan, spec, profile, workload.prefill_rows, P, S, workload.prefill_micro_batches,
        activity)
    decode = predict(plan, spec, profile, "decode", workload.batch, 1, S,
                     workload.decode_context, workload.micro_batches, activity=activity)
    total = prefill + workload.decode_steps * decode.seconds
    rows = workload.batch * workload.micro_batches
    return RunPrediction(rows * workload.generated / total, prefill, decode.seconds, total,
                         {r: busy / decode.seconds for r, busy in decode.busy.items()}, decode)


TRACK = {ACCELERATOR: ACC_COMPUTE, HOST: HOST_COMPUTE, H2D: "H2D", D2H: "D2H"}


def as_timeline(prediction: Prediction, phase: str = "decode") -> Timeline:
    """The predicted step as a ``hx.timeline.Timeline`` of one step (its tasks on the tracks
    of a measured trace; the ``sync`` gaps are left out), so ``Timeline.to_chrome`` writes a
    simulated step in the format ``hx generate --trace`` writes a measured one."""
    tasks = [t for t in prediction.tasks if t.resource in TRACK]
    events = [Event(i, TRACK[t.resource], t.name, 0, t.start, (), {"simulated": True},
                    t.start, t.end) for i, t in enumerate(tasks)]
    return Timeline(events=events, step=0, step_names={0: phase})
