"""Layer placement patterns, priced: what one more layer of each pattern costs in time and
bytes, for the CP-SAT model (``planner.cpsat_model``) to count.

A layer's pattern fixes where its KV cache (and so SCORE) lives and, for each of its six
weighted ops, whether the op runs on the host (weights at home there), on the accelerator with
resident weights, or on the accelerator with weights streamed in: 2 x 3^6 = 1458 patterns (with
the disk tier, twins streaming from disk and, where asked for, twins keeping the KV cache
there). All layers of a model have the same shapes, so a plan is a count per pattern, plus a
state for EMBED and for HEAD (``end_states``: host, resident, streamed, or read from disk).
Each pattern is priced by the simulator -- the marginal time of one more layer of it in a
decode step and, for the whole-run objective, in a prefill step at the chunk the model is
solved for -- and by its memory (``models.tensors`` sizes); patterns that another beats on
every count are dropped. EMBED and HEAD are priced as a pair (``end_costs``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import numpy as np

from hx.devices import ACCELERATOR, HOST
from hx.memory import held_weight_bytes
from hx.models.spec import EMBED, HEAD, LAYER_OPS, SCORE, ModelSpec
from hx.models.tensors import activation_bytes, layer_cache_bytes, weight_dtype
from hx.plan import (DISK, RESIDENT, STREAMED, WEIGHTED_OPS, ExecutionPlan, Placement,
                     WeightHomes, score_device)
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import predict, prefill_groups
from hx.schedule import disk_bytes, staged_bytes
from hx.segments import split_segments
from hx.workload import Workload, prefill_chunks

OP_STATES = (HOST, RESIDENT, STREAMED)  # per weighted op: runs on host / accelerator


@dataclass(frozen=True)
class Pattern:
    """Placement of one layer: KV home, the state of each weighted op and, for a
    ``streamed`` KV cache, the positions r whose K, V it recomputes (KVPR)."""

    kv: str
    ops: tuple[str, ...]  # per WEIGHTED_OPS: host, resident or streamed
    recompute: int = 0

    def devices(self) -> tuple[str, ...]:
        """Device of each op of ``LAYER_OPS``."""
        return self._devices

    @functools.cached_property
    def _devices(self) -> tuple[str, ...]:  # kept: every plan of the pattern asks
        state = dict(zip(WEIGHTED_OPS, self.ops))
        return tuple(score_device(self.kv) if op == SCORE else
                     (HOST if state[op] == HOST else ACCELERATOR) for op in LAYER_OPS)

    def homes(self) -> tuple[str, ...]:
        """Weight home of each op of ``WEIGHTED_OPS``."""
        return self.ops


@dataclass(frozen=True)
class PatternCost:
    """What one layer of a pattern costs: seconds per decode step, its prefill over a run per
    decode step (``whole_run_costs``; 0 where not priced), and bytes."""

    pattern: Pattern
    seconds: float
    resident: int  # accelerator bytes: resident weights + KV
    first_staged: int  # the layer's first staged segment, bytes (0: it stages nothing)
    last_staged: int  # its last staged segment, bytes
    host: int  # host bytes: host and streamed weights + KV
    uses_accelerator: bool
    switches: int  # device changes along the layer's ops, into the next layer included
    disk_segment: int = 0  # largest segment's disk-homed weights, bytes (read double-buffered)
    prefill: float = 0.0  # the run's prefill steps per decode step x the marginal prefill step
    staged_pair: int = 0  # largest two consecutive staged segments in a stack of it, bytes


def layer_plan(spec: ModelSpec, patterns: list[Pattern], head: str, name: str,
               embed: str = HOST) -> ExecutionPlan:
    """The plan of layers laid out with ``patterns`` (one per layer), HEAD's and EMBED's
    states (``end_states``: on the host with its weights there, else on the accelerator with
    them resident, streamed or read from disk)."""
    def device(state: str) -> str:
        return HOST if state == HOST else ACCELERATOR

    placement = Placement(device(embed), tuple(p.devices() for p in patterns), device(head))
    weights = WeightHomes(embed, tuple(p.homes() for p in patterns), head)
    plan = ExecutionPlan(placement, placement, weights, tuple(p.kv for p in patterns), name)
    if any(p.recompute for p in patterns):
        return plan.with_recompute([p.recompute for p in patterns])
    return plan


def layer_patterns(disk: bool = False, kv_disk: bool = False, kv_streamed: bool = False
                   ) -> list[Pattern]:
    """Every layer pattern: KV on the accelerator or the host, each weighted op host, resident
    or streamed. With ``disk``, every pattern that streams weights has a twin streaming them
    from disk instead of host memory (FlexGen's weights on disk: read into host memory, then
    copied on); with ``kv_disk`` too, every host-KV pattern has a twin with its KV cache on
    disk (FlexGen's OPT-175B setting: simulated, the executor does not run it). With
    ``kv_streamed``, every pattern whose weighted ops all run on the accelerator (2^6) has a
    twin with its KV cache ``streamed`` (host memory, attended on the accelerator; its r is
    set by ``price_patterns``; simulated, the executor does not run it): a layer with host
    ops attends there at no copy of its cache, so only all-accelerator layers gain."""
    patterns = [Pattern(kv, ops) for kv in (ACCELERATOR, HOST)
                for ops in itertools.product(OP_STATES, repeat=len(WEIGHTED_OPS))]
    if disk:
        patterns += [Pattern(p.kv, tuple(DISK if s == STREAMED else s for s in p.ops))
                     for p in patterns if STREAMED in p.ops]
        if kv_disk:
            patterns += [Pattern(DISK, p.ops) for p in patterns if p.kv == HOST]
    if kv_streamed:
        patterns += [Pattern(STREAMED, p.ops) for p in patterns
                     if p.kv == ACCELERATOR and HOST not in p.ops]
    return patterns


def marginal_seconds(spec: ModelSpec, profile: HardwareProfile, pattern: Pattern, phase: str,
                     batch: int, tokens: int, slots: int, context: int, micro_batches: int
                     ) -> float:
    """Seconds one more layer of ``pattern`` adds to a step of ``phase`` in a stack of such
    layers: the simulated step of three minus that of two, at least 0. HEAD is resident on
    the accelerator, so that a host HEAD's work for one micro-batch cannot hide the layers'
    work for the next (with HEAD on the host, a resident OPT-30B layer priced at 5.6 ms of
    decode at 4 x 16 rows on the H100 preset where a 48-layer stack takes 22.9 ms per layer).
    Three minus two, not two minus one: the first layer's copy and the last layer's work
    overlap the step's ends, so a one-layer step is no steady state (OPT-30B, 4 x 16 rows, A10G
    preset: a layer with its KV cache on the accelerator and MLP2 on the host priced at
    122 ms by two minus one, 165 ms by three minus two and per layer of an eight-layer stack;
    over every seventh pattern, on five rows of the standard grid, two minus one was more
    than 2 % off the eight-layer stack's per-layer time for 2-24 % of them, by up to 81 %;
    three minus two for at most 3 %). Arguments as ``simulator.predict``'s."""
    def step(n: int) -> float:
        return predict(stack_plan(spec, pattern, n), stack_shapes(spec, n), profile, phase,
                       batch, tokens, slots, context, micro_batches, keep=False).seconds

    return max(step(3) - step(2), 0.0)


@functools.lru_cache(maxsize=64)
def stack_shapes(spec: ModelSpec, n: int) -> ModelSpec:
    """``spec`` with ``n`` layers (one object per (spec, n): the simulator's caches of op
    seconds and schedules then find it by identity, not by comparing every field)."""
    return spec.replace(n_layers=n)


@functools.lru_cache(maxsize=16)
def stack_plan(spec: ModelSpec, pattern: Pattern, n: int) -> ExecutionPlan:
    """A stack of ``n`` layers of ``pattern``, HEAD resident (``marginal_seconds``; kept a
    while: ``price_pattern`` sizes the pattern on the two-layer stack it has just priced)."""
    return layer_plan(stack_shapes(spec, n), [pattern] * n, RESIDENT, "p")


def offloaded_prefill(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with every weighted op of prefill on the accelerator (host-homed weights
    staged in) and HEAD there too; SCORE stays where its KV cache lives, EMBED where it is in
    decode."""
    rows = tuple(tuple(score_device(kv) if op == SCORE else ACCELERATOR for op in LAYER_OPS)
                 for kv in plan.kv)
    return ExecutionPlan(Placement(plan.decode.embed, rows, ACCELERATOR), plan.decode,
                         plan.weights, plan.kv, plan.name, kv_recompute=plan.kv_recompute)


def with_recompute(spec: ModelSpec, profile: HardwareProfile, pattern: Pattern,
                   workload: Workload, context: int) -> Pattern:
    """A ``streamed``-KV ``pattern`` with the r ``recompute.choose_recompute`` picks for a
    stack of three such layers at the workload's decode shape (other patterns as they are)."""
    from hx.planner.recompute import choose_recompute

    if pattern.kv != STREAMED:
        return pattern
    three = stack_shapes(spec, 3)
    plan = choose_recompute(stack_plan(spec, pattern, 3), three, profile,
                            workload.batch, workload.cache_slots, context,
                            workload.micro_batches)
    return dataclasses.replace(pattern, recompute=plan.recompute(0))


def copied_cache_bytes(spec: ModelSpec, pattern: Pattern, workload: Workload) -> int:
    """Accelerator bytes one ``streamed`` cache copy of a layer of ``pattern`` holds at most
    (``hx.schedule``: a micro-batch's copied K, V and the assembled cache, each up to all S
    slots, and the activations of its r positions; 0 for other KV homes); two are held at
    once (the double buffer)."""
    if pattern.kv != STREAMED:
        return 0
    return (2 * layer_cache_bytes(spec, workload.batch, workload.cache_slots)
            + activation_bytes(spec, "h", workload.batch, pattern.recompute))


@functools.lru_cache(maxsize=16)
def price_patterns(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                   context: int, disk: bool = False, kv_disk: bool = False,
                   kv_streamed: bool = False) -> tuple[PatternCost, ...]:
    """Simulated marginal decode time and bytes of one layer of every pattern of
    ``layer_patterns(disk, kv_disk, kv_streamed)`` (``price_pattern``; cached: the budget
    does not enter, so planning at many budgets prices once)."""
    return tuple(price_pattern(spec, profile, p, workload, context)
                 for p in layer_patterns(disk, kv_disk, kv_streamed))


def price_pattern(spec: ModelSpec, profile: HardwareProfile, pattern: Pattern,
                  workload: Workload, context: int) -> PatternCost:
    """One layer of ``pattern``: its marginal decode step (``marginal_seconds``) and bytes.
    A ``streamed`` cache is priced at its r (``with_recompute``); its host bytes are the
    cache and, with r > 0, the kept activations of every slot (``hx.streamed_kv``), its copies count as staged bytes
    (``copied_cache_bytes``: in the double buffer, like weights)."""
    p = with_recompute(spec, profile, pattern, workload, context)
    seconds = marginal_seconds(spec, profile, p, "decode", workload.batch, 1,
                               workload.cache_slots, context, workload.micro_batches)
    kv_layer = layer_cache_bytes(spec, workload.rows, workload.cache_slots)
    resident = sum(spec.op_weight_bytes(op) for op, s in zip(WEIGHTED_OPS, p.ops)
                   if s == RESIDENT)
    host = sum(spec.op_weight_bytes(op, weight_dtype(spec, HOST)) if s == HOST  # host dtype
               else spec.op_weight_bytes(op)
               for op, s in zip(WEIGHTED_OPS, p.ops) if s not in (RESIDENT, DISK))
    pair = stack_plan(spec, p, 2)  # HEAD's segment stages and reads nothing
    segments = split_segments(pair, "decode")
    copy = copied_cache_bytes(spec, p, workload)
    staged = [b for b in (staged_bytes(spec, s) + (copy if s.cache_layers else 0)
                          for s in segments) if b]
    on_disk = [disk_bytes(pair, spec, s) for s in segments] if DISK in p.ops else [0]
    kept = activation_bytes(spec, "h", workload.rows, workload.cache_slots) if p.recompute else 0
    return PatternCost(
        p, seconds, resident + (kv_layer if p.kv == ACCELERATOR else 0),
        staged[0] if staged else 0, staged[-1] if staged else 0,
        host + (kv_layer if p.kv in (HOST, STREAMED) else 0) + kept,
        ACCELERATOR in p.devices(), _switches(p.devices()),
        max(on_disk) + (layer_cache_bytes(spec, workload.batch, workload.cache_slots)
                        if p.kv == DISK else 0),
        staged_pair=max(map(sum, zip(staged, staged[1:])), default=sum(staged)))


def prefill_point(workload: Workload, chunk: int) -> tuple[float, int, int]:
    """Where the whole-run objective prices prefill in chunks of ``chunk`` tokens: (prefill
    steps of the run over its decode steps (``Workload.decode_steps``), tokens of a step,
    cache slots in use at a typical step). Steps: ceil(P / chunk) per group of prefill rows
    (``simulator.prefill_groups``); slots: the prompt half done, the chunk included."""
    P = workload.prompt_tokens
    steps = prefill_groups(workload) * len(prefill_chunks(P, chunk))
    return (steps / max(workload.decode_steps, 1), min(chunk, P),
            min(P, (P + chunk + 1) // 2))


@functools.lru_cache(maxsize=16)
def decode_front(spec: ModelSpec, profile: HardwareProfile, workload: Workload, disk: bool,
                 kv_disk: bool = False, kv_streamed: bool = False) -> tuple[PatternCost, ...]:
    """The patterns no other beats in decode time and every byte count (``prune`` of
    ``price_patterns`` at the decode context; cached)."""
    return tuple(prune(price_patterns(spec, profile, workload, workload.decode_context, disk,
                                      kv_disk, kv_streamed)))


@functools.lru_cache(maxsize=64)
def whole_run_costs(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                    chunk: int, disk: bool = False, kv_disk: bool = False,
                    kv_streamed: bool = False) -> tuple[PatternCost, ...]:
    """The patterns of ``decode_front``, each with its prefill over a run per decode step
    (``prefill``, seconds): its marginal prefill step at ``chunk`` tokens and mid-prompt
    context, placed as in decode, times the run's prefill steps per decode step
    (``prefill_point``).
    A pattern another beats in decode time and every byte count is priced no further:
    prefill makes it better only where it runs more on the accelerator, which costs bytes.
    Cached: planning at many budgets prices once."""
    share, tokens, context = prefill_point(workload, chunk)
    return tuple(dataclasses.replace(c, prefill=share * marginal_seconds(
        spec, profile, c.pattern, "prefill", workload.prefill_rows, tokens,
        workload.cache_slots, context, workload.prefill_micro_batches))
        for c in decode_front(spec, profile, workload, disk, kv_disk, kv_streamed))


def _switches(devices: tuple[str, ...]) -> int:
    return sum(a != b for a, b in zip(devices, devices[1:] + devices[:1]))


def prune(costs: tuple[PatternCost, ...]) -> list[PatternCost]:
    """Drop patterns that another is at least as good as on every count (and better on one):
    time (decode step plus any priced prefill) and bytes."""
    m = np.array([[c.seconds + c.prefill, c.resident, c.first_staged, c.last_staged,
                   c.staged_pair, c.host, c.uses_accelerator, c.switches, c.disk_segment]
                  for c in costs], dtype=float)
    keep = []
    for i in range(len(costs)):
        no_worse = (m <= m[i]).all(axis=1)
        better = (m < m[i]).any(axis=1)
        if not (no_worse & better).any():
            keep.append(costs[i])
    return keep


@dataclass(frozen=True)
class EndCost:
    """What EMBED and HEAD in a pair of ``end_states`` cost: seconds (``end_costs``) and
    bytes (held as ``memory.held_weight_bytes`` counts them: in the dtype each device holds,
    a tied embedding held alike by both once).

    Attributes:
      embed / head: their states.
      seconds: a one-host-layer step with them (decode, plus the run's prefill per decode step
        where priced), so that pairs compare.
      resident: accelerator bytes of resident weights.
      host: host bytes: weights at home on the host and streamed ones (pinned host memory).
      staged_embed / staged_head: bytes each copies into accelerator memory before it runs.
      read: bytes the larger of the two reads from disk each step (read buffers, twice).
    """

    embed: str
    head: str
    seconds: float
    resident: int
    host: int
    staged_embed: int
    staged_head: int
    read: int

    @property
    def uses_accelerator(self) -> bool:
        """Whether EMBED or HEAD runs on the accelerator."""
        return self.embed != HOST or self.head != HOST


def end_states(disk: bool) -> tuple[str, ...]:
    """The states EMBED and HEAD may take: host, resident, streamed, and with ``disk`` read
    from disk each step (then staged like a streamed one)."""
    return OP_STATES + ((DISK,) if disk else ())


@functools.lru_cache(maxsize=64)
def end_costs(spec: ModelSpec, profile: HardwareProfile, workload: Workload, disk: bool,
              chunk: int | None = None) -> tuple[EndCost, ...]:
    """Every pair of EMBED and HEAD states (``end_states(disk)``), priced: seconds of a decode
    step of one host layer with them (a simulated run, the same layer whatever the states, so
    pairs compare; the layers' own cost is the patterns'); with ``chunk``, over a whole run per
    decode step as ``whole_run_costs`` prices a layer: plus the run's prefill steps at
    ``chunk`` tokens per decode step (``prefill_point``). Cached."""
    one, none = spec.replace(n_layers=1), spec.replace(n_layers=0)
    host_layer = Pattern(HOST, (HOST,) * len(WEIGHTED_OPS))

    def run(embed: str, head: str, phase: str, rows: int, tokens: int, context: int,
            micro: int) -> float:
        return predict(layer_plan(one, [host_layer], head, "ends", embed), one, profile,
                       phase, rows, tokens, workload.cache_slots, context, micro).seconds

    share, tokens, context = prefill_point(workload, chunk) if chunk else (0.0, 0, 0)
    costs = []
    for embed, head in itertools.product(end_states(disk), repeat=2):
        seconds = run(embed, head, "decode", workload.batch, 1, workload.decode_context,
                      workload.micro_batches)
        if chunk:
            seconds += share * run(embed, head, "prefill", workload.prefill_rows, tokens,
                                   context, workload.prefill_micro_batches)
        resident, host = held_weight_bytes(layer_plan(none, [], head, "ends", embed), none)
        staged = {op: spec.op_weight_bytes(op) if state in (STREAMED, DISK) else 0
                  for op, state in ((EMBED, embed), (HEAD, head))}
        read = max(spec.op_weight_bytes(op) if state == DISK else 0
                   for op, state in ((EMBED, embed), (HEAD, head)))
        costs.append(EndCost(embed, head, seconds, resident, host, staged[EMBED], staged[HEAD],
                             read))
    return tuple(costs)
