"""A plan's memory check against its real run: the check sizes the run's Schedule (a dry run
with XLA's temporaries of the executables the run uses); the run then peaks at exactly that.

``check_run`` plans a policy for one generation mode at one budget, runs it for real with the
check it makes recorded, and compares the accountant's peak with the check. The test suite runs
a sample of the (dtype x mode x policy x budget) matrix, ``scripts/bench_memory_matrix.py`` all
of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from hx.devices import discover
from hx.errors import HxError
from hx.memory import BudgetExceeded, MemoryEstimate
from hx.models.loader import Model
from hx.planner import policies
from hx.planner.profile import HardwareProfile
from hx.sampling import SamplingParams
from hx.workload import Workload

MODES = ("one prompt", "static batch", "throughput")
BATCH, MICRO_BATCHES = 2, 2  # rows of a static batch and of a micro-batch; a block's micro-batches


@dataclass(frozen=True)
class CheckedRun:
    """One cell of the matrix.

    Attributes:
      outcome: ``exact`` (the run peaked at the check), ``below`` (under it: the check's peak
        moment did not occur in this run), ``over`` (BudgetExceeded: a bug), ``refused``
        (the policy or the run's check found no fit; ``detail`` says which and why).
      checked: accelerator bytes the run's check found needed (0 when refused).
      peak: accelerator bytes the accountant saw at the run's peak.
      budget: the accelerator budget (bytes).
      phase: the step kind where the check peaks.
    """

    model: str
    dtype: str
    mode: str
    policy: str
    fraction: float
    budget: int
    outcome: str
    checked: int = 0
    peak: int = 0
    phase: str = ""
    detail: str = ""

    def row(self) -> dict:
        """JSON-able dict."""
        return asdict(self)


def prompts_for(mode: str, lengths: Sequence[int]) -> list[list[int]]:
    """Token-id prompts of ``lengths`` for ``mode``: one for ``one prompt``, a static batch
    of ``BATCH``, every one for ``throughput`` (more prompts than rows, so rows are reused)."""
    count = {"one prompt": 1, "static batch": BATCH, "throughput": len(lengths)}[mode]
    return [[1 + (7 * r + i) % 500 for i in range(L)] for r, L in enumerate(lengths[:count])]


def planned_workload(mode: str, prompts: Sequence[Sequence[int]], new_tokens: int,
                     model: Model) -> Workload:
    """The workload a policy plans ``mode`` for: the batch's, or the throughput block's."""
    from hx.continuous import JOIN_CHUNK, run_slots

    spec = model.spec
    if mode != "throughput":
        return Workload.for_prompts(len(prompts), max(map(len, prompts)), new_tokens, spec)
    slots = run_slots([len(p) for p in prompts], [new_tokens] * len(prompts), spec, JOIN_CHUNK)
    return Workload(BATCH, JOIN_CHUNK, slots, MICRO_BATCHES, spare_rows=BATCH)


def check_run(model: Model, mode: str, policy: str, fraction: float,
              lengths: Sequence[int], new_tokens: int,
              profile: HardwareProfile | None) -> CheckedRun:
    """Plan ``policy`` at ``fraction`` of the model's weight bytes for ``mode``, run it, and
    compare its peak with its check.

    Args:
      lengths: prompt lengths (tokens); ``prompts_for`` takes as many as the mode needs.
      new_tokens: tokens each prompt generates (greedy, no stop token: every row runs them).
      profile: the hardware profile ``min-max``, ``flexgen-lp``, ``cpsat`` and ``auto`` price
        with (those are refused without one).
    """
    from hx.continuous import ContinuousBatcher
    from hx.generate import Engine

    spec = model.spec
    budget = int(fraction * spec.weight_bytes)
    cell = dict(model=spec.name, dtype=spec.dtype, mode=mode, policy=policy, fraction=fraction,
                budget=budget)
    prompts = prompts_for(mode, lengths)
    devices = discover(accelerator_memory=budget)
    try:
        plan = policies.build(policy, spec, devices,
                              planned_workload(mode, prompts, new_tokens, model),
                              profile=profile)
    except HxError as e:
        return CheckedRun(**cell, outcome="refused", detail=f"policy: {e}")
    engine = Engine(model, plan, devices)
    checks: list[MemoryEstimate] = []
    check = engine.check
    engine.check = lambda workload: checks.append(check(workload)) or checks[-1]
    sampling = SamplingParams(max_new_tokens=new_tokens, stop_ids=())
    try:
        if mode == "throughput":
            ContinuousBatcher(engine, BATCH, MICRO_BATCHES).run(prompts, sampling)
        else:
            engine.generate_ids(prompts, sampling)
    except BudgetExceeded as e:
        checked = max((c.accelerator for c in checks), default=0)
        return CheckedRun(**cell, outcome="over", checked=checked, peak=engine.accountant.peak,
                          detail=str(e))
    except HxError as e:
        return CheckedRun(**cell, outcome="refused", detail=f"run check: {e}")
    finally:  # the wrapper refers to the engine: leave no cycle keeping its weights alive
        del engine.check
    need = max(checks, key=lambda c: c.accelerator)
    peak = engine.accountant.peak
    return CheckedRun(**cell, outcome="exact" if peak == need.accelerator else (
        "below" if peak < need.accelerator else "over"), checked=need.accelerator, peak=peak,
        phase=need.phase)
