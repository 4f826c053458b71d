"""Accelerator memory: the accountant that owns every allocation, and the plan-time estimate.

Every buffer the executor places on the accelerator -- resident weights, KV caches, staged
(streamed-in) weights, activations and the XLA temporaries of a running segment -- is allocated
through one ``Accountant``, which knows the bytes in use per owner and the peak. The executor
applies the allocations of the step's ``hx.schedule.Schedule``; ``estimate`` replays the same
schedule without running it, with XLA's temporary sizes of the same compiled segments, so
plan-time and run-time memory come from one description. Exceeding the capacity raises
``BudgetExceeded``: that is a bug, because ``check_fits`` rejects a plan whose ``estimate``
does not fit before anything runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

from hx.devices import ACCELERATOR, HOST, Devices, format_bytes
from hx.errors import HxError
from hx.models.spec import EXPERT_OPS, HEAD, ModelSpec, numpy_dtype
from hx.plan import DISK, PHASES, RESIDENT, STREAMED, ExecutionPlan, home_device
from hx.models.tensors import (ACTIVATIONS, activation_bytes, cache_bytes, held_weights,
                               kv_bytes, layer_slots, step_bytes, step_limit,
                               widest_activation_bytes, widest_slots)
from hx.schedule import DryRun, Instruction, compile_schedule, dry_run, read_buffer_bytes
from hx.segments import split_segments
from hx.workload import Workload, prefill_chunks

if TYPE_CHECKING:
    from hx.programs import Programs

OWNERS = ("weights", "kv", "staging", "activations")

# How ``estimate`` sizes XLA's temporaries (``hx.programs.Programs.temp_bytes``):
EXACT = "exact"  # from the executables a run uses: the check before running
PROXY = "proxy"  # from cut-down segments, extrapolated: planners sizing candidate plans
UNSIZED = "unsized"  # as 0 bytes, compiling nothing: a lower bound to discard candidates
SIZINGS = (EXACT, PROXY, UNSIZED)


class BudgetExceeded(RuntimeError):
    """An allocation took the accelerator past its budget (a bug: plans are checked first)."""


@dataclass
class Accountant:
    """Bytes allocated on the accelerator, by owner, with the peak.

    Attributes:
      capacity: budget in bytes (None = unlimited).
      peak: highest total seen; ``peak_by_owner`` is the breakdown at that moment.
    """

    capacity: int | None = None
    peak: int = 0
    peak_by_owner: dict[str, int] = field(default_factory=dict)
    _live: dict[Hashable, tuple[str, int]] = field(default_factory=dict)
    _by_owner: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OWNERS, 0))

    @property
    def in_use(self) -> int:
        """Bytes allocated now."""
        return sum(self._by_owner.values())

    def by_owner(self) -> dict[str, int]:
        """Bytes allocated now, per owner."""
        return dict(self._by_owner)

    def allocate(self, owner: str, key: Hashable, nbytes: int) -> None:
        """Record ``nbytes`` for ``key`` (replacing what ``key`` held before).

        Raises:
          BudgetExceeded: the total would pass ``capacity``.
        """
        if owner not in OWNERS:
            raise ValueError(f"unknown owner {owner!r}")
        self.free(key)
        total = self.in_use + nbytes
        if self.capacity is not None and total > self.capacity:
            raise BudgetExceeded(
                f"allocating {nbytes} bytes of {owner} ({key!r}) takes the accelerator to "
                f"{total} bytes, over its budget of {self.capacity} by "
                f"{total - self.capacity}; in use: {self.by_owner()}")
        self._live[key] = (owner, nbytes)
        self._by_owner[owner] += nbytes
        if total > self.peak:
            self.peak, self.peak_by_owner = total, self.by_owner()

    def free(self, key: Hashable) -> None:
        """Release what ``key`` holds (nothing if it holds nothing)."""
        if key in self._live:
            owner, nbytes = self._live.pop(key)
            self._by_owner[owner] -= nbytes

    def apply(self, instruction: Instruction, sizes: dict[Hashable, int] | None = None) -> None:
        """Carry out a schedule instruction's frees, then its allocations, then its releases;
        ``sizes`` gives the real bytes of keys whose arrays exist (they replace the schedule's
        sizes).

        Raises:
          BudgetExceeded: as ``allocate``.
        """
        for key in instruction.frees:
            self.free(key)
        for key, owner, nbytes in instruction.allocs:
            self.allocate(owner, key, (sizes or {}).get(key, nbytes))
        for key in instruction.releases:
            self.free(key)

    def report(self) -> dict:
        """JSON-able summary: capacity, in use, peak and its breakdown (bytes)."""
        return {"capacity": self.capacity, "in_use": self.in_use, "peak": self.peak,
                "peak_by_owner": self.peak_by_owner}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a plan needs at a workload: the peak of a dry run of its schedules.

    Attributes:
      weights: resident weights on the accelerator.
      kv: KV caches on the accelerator: those at home there, plus the ``streamed`` caches
        copied in (and the activations their recompute reads) live at the peak moment.
      staging: staged (streamed-in) weights live at the peak moment.
      activations: activations, step inputs and XLA temporaries live at the peak moment.
      host: host memory: host-home and streamed weights, host and ``streamed`` KV caches,
        the activations ``h`` each recomputing layer keeps (every slot's), the disk
        read buffers (``schedule.read_buffer_bytes``: two consecutive disk-reading segments)
        and two of a disk layer's KV cache.
      phase: the phase whose step peaks (``prefill`` or ``decode``).
      disk: weights and KV caches kept on the disk tier (not checked against a capacity).
    """

    weights: int
    kv: int
    staging: int
    activations: int
    host: int
    phase: str = "decode"
    disk: int = 0

    @property
    def accelerator(self) -> int:
        """Total accelerator bytes at the peak."""
        return self.weights + self.kv + self.staging + self.activations

    def breakdown(self) -> str:
        """``weights …, KV …, staging …, activations …`` in bytes."""
        return (f"weights {self.weights}, KV {self.kv}, staging {self.staging}, "
                f"activations {self.activations} (peak in {self.phase})")


def held_weight_bytes(plan: ExecutionPlan, spec: ModelSpec) -> tuple[int, int]:
    """(accelerator, host) bytes of the weight buffers the executor places for ``plan``: one
    buffer per distinct (array, home, dtype) -- each op's arrays as the devices whose
    segments use it hold them (``models.tensors.held_weights``: dense tensors in the model's
    dtype, and for a float16 model's host ops in float32 besides; compressed
    matrices as their codes, scales and offsets either way); a tied embedding is one array
    for EMBED and HEAD. Disk-homed weights are in neither (``disk_weight_bytes``)."""
    held: dict[tuple, int] = {}  # (array, home, dtype) -> bytes
    for layer, op, home in plan.held_ops():
        devices = ({home_device(home)} if op in EXPERT_OPS else
                   {plan.phase(p).get(layer, op) for p in PHASES})
        for device in devices:
            for path, (shape, dtype) in held_weights(plan.held_spec(spec, layer, op, home),
                                                     op, device).items():
                tied = path.split("/")[0] == "embedding" and spec.tie_embeddings
                array = path if tied else (layer, op, path)
                held[(array, home, dtype)] = math.prod(shape) * numpy_dtype(dtype).itemsize
    resident = sum(b for (_, home, _), b in held.items() if home == RESIDENT)
    return resident, sum(b for (_, home, _), b in held.items() if home not in (RESIDENT, DISK))


def disk_weight_bytes(plan: ExecutionPlan, spec: ModelSpec) -> int:
    """Bytes of the weights ``plan`` keeps on disk (in the model's dtype)."""
    return sum(plan.held_spec(spec, layer, op, home).op_weight_bytes(op)
               for layer, op, home in plan.held_ops() if home == DISK)


def step_shapes(plan: ExecutionPlan, spec: ModelSpec, workload: Workload,
                every_chunk: bool = True) -> list[tuple[str, int, int, int]]:
    """(phase, B rows, T new tokens, N micro-batches) of every step shape a run of
    ``workload`` under ``plan`` takes: prefill at each chunk size (``plan.prefill_chunk``;
    the largest only unless ``every_chunk``) and decode at T = 1, at each row count of
    ``Workload.step_rows``; chunks bounded by ``models.tensors.step_limit``. XLA's temporaries need not fall with the rows (on XLA:CPU a
    float16 matrix-vector product holds a float32 copy of its weight). A prefill chunk is a
    multiple of 16 tokens (``PREFILL_BUCKET``), never a matrix-vector product, and its bytes
    grow with its tokens: planners size the largest."""
    chunks = sorted(set(prefill_chunks(workload.prompt_tokens, plan.prefill_chunk,
                                       step_limit(spec))))
    chunks = chunks if every_chunk else chunks[-1:]
    return ([("prefill", B, T, workload.prefill_micro_batches)
             for B in workload.step_rows("prefill") for T in chunks]
            + [("decode", B, 1, workload.micro_batches) for B in workload.step_rows("decode")])


@functools.lru_cache(maxsize=4096)
def estimate(plan: ExecutionPlan, spec: ModelSpec, workload: Workload,
             programs: "Programs | None" = None, sizing: str = PROXY) -> MemoryEstimate:
    """Accelerator and host bytes ``plan`` needs to run ``workload``.

    Weights as ``held_weight_bytes`` counts them, KV caches on the accelerator
    ``models.tensors.cache_bytes`` (each layer as held: a sliding window's ring) at
    ``workload.rows`` rows (B·N rows of a block
    plus spare rows). On top, the highest peak of a dry run (``hx.schedule.dry_run``) of the
    schedule of every step shape the run takes (``step_shapes``): staged weights, step
    inputs, copied-in and held activations, and each accelerator segment's XLA temporaries
    (``programs``, default: the process's compiler for the accelerator ``hx.discover``
    finds). Decode runs the block of ``workload.micro_batches``, prefill too unless the
    workload has spare rows (iteration-level scheduling: prefill then runs on one join group
    of at most ``spare_rows`` rows, and the peak is at least ``reframe_bytes`` beyond the
    caches).

    Args:
      sizing: how XLA's temporaries are sized: ``EXACT`` from the executables the run will use
        (a run's check: the executor then peaks at exactly this estimate), ``PROXY`` from
        cut-down segments (planners), ``UNSIZED`` as 0 bytes, compiling nothing (a lower bound,
        cheap enough to discard candidates in a planner's search).

    Estimates are cached (all arguments are immutable): planners probe the same plan more
    than once.
    Raises:
      ValueError: an unknown ``sizing``.
    """
    if sizing not in SIZINGS:
        raise ValueError(f"sizing={sizing!r}; one of {', '.join(SIZINGS)}")
    from hx.programs import programs_for

    resident, host = held_weight_bytes(plan, spec)
    disk = disk_weight_bytes(plan, spec)
    host += read_buffer_bytes(plan, spec)  # disk weights read into host memory each step
    S = workload.cache_slots

    def caches(*homes: str, rows: int = workload.rows) -> int:
        return cache_bytes(spec, rows, S, [i for i, home in enumerate(plan.kv) if home in homes])

    kv_acc = caches(ACCELERATOR)
    host += caches(HOST, STREAMED) + kept_activation_bytes(plan, spec, workload)
    if DISK in plan.kv:  # a layer's cache read into host memory for one micro-batch, twice
        disk += caches(DISK)
        host += 2 * max(cache_bytes(spec, workload.batch, S, [i])
                        for i, home in enumerate(plan.kv) if home == DISK)

    steps = step_shapes(plan, spec, workload, every_chunk=sizing == EXACT)
    temp_bytes = None
    if sizing != UNSIZED:
        programs = programs or programs_for(spec)
        exact = sizing == EXACT
        programs.prepare([(sized, B, T, S) for phase, B, T, _ in steps
                          for seg in split_segments(plan, phase) if seg.device == ACCELERATOR
                          for sized in programs.sizing_segments(seg, exact)])
        temp_bytes = functools.partial(programs.temp_bytes, exact=exact)
    worst = DryRun()
    worst_phase = "decode"
    for phase, B, T, N in steps:
        run = dry_run(compile_schedule(plan, spec, phase, B, T, S, temp_bytes, N))
        if run.peak > worst.peak:
            worst, worst_phase = run, phase
    if workload.spare_rows and kv_acc and reframe_bytes(spec, workload) > worst.peak:
        return MemoryEstimate(resident, kv_acc, 0, reframe_bytes(spec, workload), host,
                              "KV re-framing", disk)
    return MemoryEstimate(resident, kv_acc + worst.peak_by_owner.get("kv", 0),
                          worst.peak_by_owner.get("staging", 0),
                          worst.peak_by_owner.get("activations", 0), host, worst_phase, disk)


def kept_activation_bytes(plan: ExecutionPlan, spec: ModelSpec, workload: Workload) -> int:
    """Host bytes of the activations ``h`` the recomputing layers keep: every one of the
    layer's slots (``models.tensors.held_slots``) of ``workload.rows`` rows per layer with
    r > 0, d_model values each in the model's dtype (``models.tensors.activation_bytes``;
    KVPR's stored activations, kept for every slot so that r may change:
    ``hx.streamed_kv``)."""
    return sum(activation_bytes(spec, "h", workload.rows,
                                layer_slots(spec, layer, workload.cache_slots))
               for layer in range(plan.n_layers) if plan.recompute(layer))


def reframe_bytes(spec: ModelSpec, workload: Workload) -> int:
    """Accelerator bytes of one micro-batch's K (or V) cache of one layer, (B, S, K, E) as
    held (``models.tensors.kv_bytes``; compressed: its codes, scales and offsets, at least
    its largest array): the temporary of shifting a cache along its slots (iteration-level
    scheduling re-frames a micro-batch's caches one array at a time, between steps)."""
    return kv_bytes(spec, workload.batch, widest_slots(spec, workload.cache_slots)) // 2


def describe_batch(workload: Workload) -> str:
    """``16`` or ``4 x 16`` (micro-batches x rows), with ``+ 1 spare row`` when held."""
    text = str(workload.batch) if workload.micro_batches == 1 else (
        f"{workload.micro_batches} x {workload.batch}")
    return text + (f" + {workload.spare_rows} spare row{'s' * (workload.spare_rows > 1)}"
                   if workload.spare_rows else "")


def check_fits(plan: ExecutionPlan, spec: ModelSpec, devices: Devices,
               workload: Workload, programs: "Programs | None" = None,
               sizing: str = EXACT) -> MemoryEstimate:
    """Reject a plan that does not fit the accelerator (or host) budget, before it runs.

    Args:
      sizing: as ``estimate``; ``EXACT`` (the default) before a run, ``PROXY`` in planners.
    Returns:
      the estimate, when it fits.
    Raises:
      HxError: naming the limit, the bytes needed with their breakdown, and the bytes over.
    """
    est = estimate(plan, spec, workload, programs, sizing)
    limits = [("accelerator", devices.accelerator.capacity, est.accelerator, est.breakdown()),
              ("host", devices.host.capacity, est.host, "weights and KV kept on the host")]
    for name, capacity, need, detail in limits:
        if capacity is not None and need > capacity:
            raise HxError(
                f"plan {plan.name!r} does not fit the {name} memory budget at batch "
                f"{describe_batch(workload)}, {workload.cache_slots} KV slots: it needs {need} bytes "
                f"({detail}) but the budget is {capacity} bytes, over by {need - capacity} "
                f"bytes ({format_bytes(need - capacity)})")
    return est


def activation_reserve(spec: ModelSpec, workload: Workload, prefill_tokens: int,
                       programs: "Programs | None" = None) -> int:
    """Accelerator bytes a planner sets aside for a step's activations and XLA temporaries
    before it knows the plan: every named activation held and copied in at once (2x their
    bytes at (B, T), per micro-batch of a block), the step inputs, and the XLA temporaries of
    the whole model as one accelerator segment cut to ``hx.programs.proxy`` (not extrapolated:
    where temporaries grow with depth -- half precision on XLA:CPU -- the growth belongs to
    the plan's own segments), for a prefill step of T = ``prefill_tokens``
    (``Workload.prefill_rows`` rows) and a decode step of T = 1. Planners size plans with it;
    ``check_fits`` then sizes the chosen plan (``cpsat.plan_cpsat`` re-plans with a smaller
    budget, and the baselines back off, in the case the plan's size is larger).
    """
    from hx.programs import programs_for, proxy

    programs = programs or programs_for(spec)
    S = workload.cache_slots
    whole = proxy(split_segments(ExecutionPlan.all_accelerator(spec.n_layers), "prefill")[0])
    # (rows, micro-batches, tokens) of a prefill and a decode step; a block holds each
    # micro-batch's activations
    steps = {(workload.prefill_rows, workload.prefill_micro_batches, prefill_tokens),
             (workload.batch, workload.micro_batches, 1)}
    return max(N * (2 * sum(widest_activation_bytes(spec, n, B, T) for n in ACTIVATIONS)
                    + step_bytes(B, T))
               + programs.temp_bytes(whole, B, T, S) for B, N, T in steps)


def head_reserve(spec: ModelSpec, workload: Workload, prefill_tokens: int) -> int:
    """Bytes of ``activation_reserve`` (at ``prefill_tokens``) that are HEAD's: the largest
    difference, over the reserve's step shapes, between the XLA temporaries of the whole model
    as one accelerator segment and of the same segment without HEAD (each cut to
    ``hx.programs.proxy``). The CP-SAT model (``planner.cpsat``) counts them only where HEAD
    runs on the accelerator: XLA:CPU widens a one-row bfloat16 LM head to a float32 temporary
    (768 MiB of a 774 MiB reserve at Llama-2-7B's layer shapes with a 49,152-token vocabulary,
    one row), which a plan with HEAD on the host never allocates."""
    from hx.programs import programs_for, proxy

    programs, S = programs_for(spec), workload.cache_slots
    whole, headless = (proxy(split_segments(plan, "prefill")[0]) for plan in (
        ExecutionPlan.all_accelerator(spec.n_layers),
        ExecutionPlan.uniform(spec.n_layers, (HEAD,))))
    steps = {(workload.prefill_rows, prefill_tokens), (workload.batch, 1)}
    return max(0, *(programs.temp_bytes(whole, B, T, S) - programs.temp_bytes(headless, B, T, S)
                    for B, T in steps))
