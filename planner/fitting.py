"""Whether a plan fits the memory budgets, and the largest prefill chunk under which it does:
how every policy's plan is sized (``policies``, ``baselines``, ``cpsat``)."""

from __future__ import annotations

from hx.devices import Devices
from hx.errors import HxError
from hx.memory import PROXY, UNSIZED, check_fits, estimate
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.workload import MIN_CHUNK, Workload

# Prefill chunk sizes a policy tries, largest first (None: the whole prompt in one step).
CHUNKS = (None, 512, 128, MIN_CHUNK)


def fits(plan: ExecutionPlan, spec: ModelSpec, devices: Devices, workload: Workload) -> bool:
    """Whether ``check_fits`` accepts ``plan`` with proxy-sized temporaries (a plan whose
    unsized estimate -- XLA temporaries left out, nothing compiled -- already exceeds the
    accelerator budget is refused without compiling its segments, and without an accelerator
    budget only the host's is checked, which no temporary changes)."""
    capacity = devices.accelerator.capacity
    unsized = estimate(plan, spec, workload, sizing=UNSIZED)
    if capacity is None:
        return devices.host.capacity is None or unsized.host <= devices.host.capacity
    if unsized.accelerator > capacity:
        return False
    try:
        check_fits(plan, spec, devices, workload, sizing=PROXY)
        return True
    except HxError:
        return False


def fit_prefill_chunk(plan: ExecutionPlan, spec: ModelSpec, devices: Devices,
                      workload: Workload) -> ExecutionPlan:
    """``plan`` with the largest prefill chunk of ``CHUNKS`` (fewest prefill steps) under
    which it fits the budgets, found by bisection (a larger chunk never needs less memory);
    a chunk the plan already names is kept if it fits.

    Raises:
      HxError: it does not fit even at ``MIN_CHUNK``: the bytes it needs there and by how many
        the budget falls short (the minimum feasible budget for this plan).
    """
    if plan.prefill_chunk is not None and fits(plan, spec, devices, workload):
        return plan
    chunks = [c for c in CHUNKS if c is None or c < workload.prompt_tokens]
    if fits(plan.with_prefill_chunk(chunks[0]), spec, devices, workload):
        return plan.with_prefill_chunk(chunks[0])  # the common case: one size, one compile
    check_fits(plan.with_prefill_chunk(chunks[-1]), spec, devices, workload, sizing=PROXY)  # raises
    fitting, failing = len(chunks) - 1, 0  # indices into chunks (largest first)
    while fitting - failing > 1:
        middle = (fitting + failing) // 2
        if fits(plan.with_prefill_chunk(chunks[middle]), spec, devices, workload):
            fitting = middle
        else:
            failing = middle
    return plan.with_prefill_chunk(chunks[fitting])
