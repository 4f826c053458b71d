"""Accelerator memory: the accountant that owns every allocation, and the plan-time estimate.

Every buffer the executor places on the accelerator -- resident weights, KV caches, staged
(streamed-in) weights, activations and the XLA temporaries of a running segment -- is allocated
through one ``Accountant``, which knows the bytes in use per owner and the peak. Exceeding the
capacity raises ``BudgetExceeded``: that is a bug, because ``check_fits`` rejects a plan whose
``estimate`` does not fit before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from hx.devices import ACCELERATOR, HOST, Devices, format_bytes
from hx.errors import HxError
from hx.models.spec import ModelSpec
from hx.plan import PHASES, RESIDENT, ExecutionPlan
from hx.segments import Segment, split_segments
from hx.workload import Workload

OWNERS = ("weights", "kv", "staging", "activations")


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

    def report(self) -> dict:
        """JSON-able summary: capacity, in use, peak and its breakdown (bytes)."""
        return {"capacity": self.capacity, "in_use": self.in_use, "peak": self.peak,
                "peak_by_owner": self.peak_by_owner}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a plan needs at a workload (upper bounds; see ``estimate``).

    Attributes:
      weights: resident weights on the accelerator.
      kv: KV caches on the accelerator.
      staging: double buffer of staged weights (largest two consecutive staged segments).
      activations: activations and XLA temporaries of accelerator segments.
      host: host memory: host-home and streamed weights, host KV caches.
    """

    weights: int
    kv: int
    staging: int
    activations: int
    host: int

    @property
    def accelerator(self) -> int:
        """Total accelerator bytes."""
        return self.weights + self.kv + self.staging + self.activations

    def breakdown(self) -> str:
        """``weights …, KV …, staging …, activations …`` in bytes."""
        return (f"weights {self.weights}, KV {self.kv}, staging {self.staging}, "
                f"activations {self.activations}")


def activation_bytes(spec: ModelSpec, batch: int, tokens: int, slots: int) -> int:
    """Upper bound on accelerator bytes of activations and XLA temporaries of one step.

    Counts, at 4 bytes each: per token the live values of a layer (x and h: D, q and o: H E,
    k and v: K E, the FFN gate/up/product: F) with a 3x margin for copies and temporaries,
    attention scores and probabilities (B x H x T x S, 2x), and last-position logits (B x V,
    2x). The tests check it against the accountant's measured peak for every plan they run
    (measured on SmolLM2 at batch 8: 0.3 to 4.2 MB against this bound's 8.2 MB).
    """
    s = spec
    per_token = 3 * (s.d_model + s.n_heads * s.head_dim + s.n_kv_heads * s.head_dim + s.d_ff)
    return 4 * (batch * tokens * per_token + 2 * batch * s.n_heads * tokens * slots
                + 2 * batch * s.vocab_size)


def staged_bytes(spec: ModelSpec, segment: Segment) -> int:
    """Bytes of the weights a segment copies into accelerator memory before it runs."""
    return sum(spec.op_weight_bytes(op) for (_, op), staged in zip(segment.ops, segment.staged)
               if staged)


def estimate(plan: ExecutionPlan, spec: ModelSpec, workload: Workload) -> MemoryEstimate:
    """Accelerator and host bytes ``plan`` needs to run ``workload``.

    Resident weights count each distinct array once (a tied embedding resident for both EMBED
    and HEAD is one buffer). Staging is the largest sum of two consecutive staged segments of a
    phase (prefetch depth 1: the running segment's weights plus the next one's). Activations
    use ``activation_bytes`` with T = prompt tokens (prefill) or 1 (decode), for phases that
    run anything on the accelerator.
    """
    tied = spec.vocab_size * spec.d_model * spec.dtype_bytes if spec.tie_embeddings else 0
    homes = plan.weights
    resident = host = 0
    for layer, op, home in homes.sequence():
        nbytes = spec.op_weight_bytes(op)
        if home == RESIDENT:
            resident += nbytes
        else:  # streamed weights live in (pinned) host memory
            host += nbytes
    if homes.embed == homes.head:  # one array serves both
        if homes.embed == RESIDENT:
            resident -= tied
        else:
            host -= tied
    kv_layer = spec.kv_bytes_per_token() * workload.batch * workload.cache_slots
    kv_acc = sum(kv_layer for home in plan.kv if home == ACCELERATOR)
    host += sum(kv_layer for home in plan.kv if home == HOST)

    staging = activations = 0
    for phase in PHASES:
        segments = split_segments(plan, phase)
        staged = [staged_bytes(spec, s) for s in segments if s.streams]
        pairs = [a + b for a, b in zip(staged, staged[1:])] or staged or [0]
        staging = max(staging, max(pairs))
        if any(s.device == ACCELERATOR for s in segments):
            tokens = workload.prompt_tokens if phase == "prefill" else 1
            activations = max(activations, activation_bytes(spec, workload.batch, tokens,
                                                            workload.cache_slots))
    return MemoryEstimate(resident, kv_acc, staging, activations, host)


def check_fits(plan: ExecutionPlan, spec: ModelSpec, devices: Devices,
               workload: Workload) -> MemoryEstimate:
    """Reject a plan that does not fit the accelerator (or host) budget, before it runs.

    Returns:
      the estimate, when it fits.
    Raises:
      HxError: naming the limit, the bytes needed with their breakdown, and the bytes over.
    """
    est = estimate(plan, spec, workload)
    limits = [("accelerator", devices.accelerator.capacity, est.accelerator, est.breakdown()),
              ("host", devices.host.capacity, est.host, "weights and KV kept on the host")]
    for name, capacity, need, detail in limits:
        if capacity is not None and need > capacity:
            raise HxError(
                f"plan {plan.name!r} does not fit the {name} memory budget at batch "
                f"{workload.batch}, {workload.cache_slots} KV slots: it needs {need} bytes "
                f"({detail}) but the budget is {capacity} bytes, over by {need - capacity} "
                f"bytes ({format_bytes(need - capacity)})")
    return est
