"""Placement policies as plan builders (docs/architecture.md, "Planner"): each returns an
``ExecutionPlan``.

Fixed policies live here; ``baselines`` adds the cost-model-driven ones (min-max,
flexgen-lp) and ``cpsat`` the planner. ``POLICIES`` is the one table of named policies (the
CLI's help, the ablations and the profiler read it); ``build`` makes a named policy's plan and
``plan_on`` one for a named machine. Every plan is sized by ``fitting``, which the solvers
import too. EMBED (a row lookup in a table as large as the LM head) always stays on the host,
as in llama.cpp; copying the whole table to the accelerator to gather B rows would never pay.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hx.devices import ACCELERATOR, HOST, Devices, discover
from hx.errors import HxError
from hx.memory import PROXY, MemoryEstimate, check_fits, estimate
from hx.models.spec import EMBED, LAYER_OPS, SCORE, ModelSpec
from hx.plan import DISK, RESIDENT, STREAMED, ExecutionPlan, ExpertHomes, Placement
from hx.planner.fitting import fit_prefill_chunk, fits
from hx.planner.hardware import memory_sizing
from hx.planner.simulator import predict_run
from hx.workload import MIN_CHUNK, Workload

MLP2 = "MLP2"  # an MoE layer's routed experts (``models.moe``)

if TYPE_CHECKING:
    from hx.planner.experts import ExpertActivity
    from hx.planner.profile import HardwareProfile


def all_accelerator(n_layers: int) -> ExecutionPlan:
    """No offload: every op on the accelerator, every weight resident."""
    return ExecutionPlan.all_accelerator(n_layers)


def all_host(n_layers: int) -> ExecutionPlan:
    """Every op on the host CPU."""
    return ExecutionPlan.all_host(n_layers)


def stream_all(n_layers: int) -> ExecutionPlan:
    """FlexGen-style offload (Sheng et al. 2023): every op on the accelerator with its weights
    streamed in from host memory layer by layer, except SCORE, which runs on the host over a
    host-resident KV cache (so only q, the new k/v and the attention output cross)."""
    placement = Placement.uniform(
        n_layers, lambda op: HOST if op in (SCORE, EMBED) else ACCELERATOR)
    return ExecutionPlan.from_placement(placement, name="stream-all", streamed=True)


def kv_streamed(n_layers: int, recompute: int = 0, weights_streamed: bool = True,
                layers: tuple[int, ...] | None = None) -> ExecutionPlan:
    """Every op but EMBED on the accelerator (weights streamed, or resident), the KV caches of
    ``layers`` (default: all) in host memory and copied in every step (``streamed``: FlexGen's
    KV on the CPU with attention on the GPU), the first ``recompute`` positions recomputed
    from their activations instead (KVPR, Jiang et al. 2024); the other layers' caches on the
    accelerator."""
    placement = Placement.uniform(n_layers, lambda op: HOST if op == EMBED else ACCELERATOR)
    base = ExecutionPlan.from_placement(placement, streamed=weights_streamed,
                                        name=f"kv-streamed-r{recompute}")
    kv = tuple(STREAMED if layers is None or i in layers else ACCELERATOR
               for i in range(n_layers))
    return dataclasses.replace(base, kv=kv).with_recompute(recompute)


def layer_split(n_layers: int, gpu_layers: int) -> ExecutionPlan:
    """llama.cpp ``-ngl N``: the last N layers wholly on the accelerator (weights resident, KV
    there), the others wholly on the host. As in llama.cpp, the output layer (HEAD) counts as
    one more layer: it is offloaded when N > n_layers.

    Raises:
      HxError: N outside [0, n_layers + 1].
    """
    if not 0 <= gpu_layers <= n_layers + 1:
        raise HxError(f"--gpu-layers must be between 0 and {n_layers + 1}, got {gpu_layers}")
    first = n_layers - min(gpu_layers, n_layers)
    layers = tuple((ACCELERATOR if i >= first else HOST,) * 7 for i in range(n_layers))
    placement = Placement(HOST, layers, ACCELERATOR if gpu_layers > n_layers else HOST)
    return ExecutionPlan.from_placement(placement, name=f"layer-split:{gpu_layers}")


def cpu_moe(spec: ModelSpec, layers: int | None = None) -> ExecutionPlan:
    """llama.cpp's ``--cpu-moe`` (``--n-cpu-moe N``: the first N layers'): every op on the
    accelerator with its weights resident, but EMBED and the routed experts of the first
    ``layers`` layers (default all), which stay on the host and run there on the rows routed
    to them (MLP2 of an MoE layer, ``models.moe``; a dense first layer has none: its MLP
    stays, as llama.cpp moves only the ``*_exps`` tensors). A shared expert goes with them
    (llama.cpp keeps it on the GPU: hx places MLP2 whole). Named ``cpu-moe``,
    ``n-cpu-moe:N``.

    Raises:
      HxError: the model has no experts, or N outside [0, n_layers].
    """
    n = spec.n_layers
    if spec.moe is None:
        raise HxError(f"{spec.name} has no experts for --cpu-moe or --n-cpu-moe to place")
    if not 0 <= (n if layers is None else layers) <= n:
        raise HxError(f"--n-cpu-moe must be between 0 and {n}, got {layers}")
    on_host = set(range(n if layers is None else layers)) & set(spec.expert_layers)
    rows = tuple(tuple(HOST if op == MLP2 and i in on_host else ACCELERATOR
                       for op in LAYER_OPS) for i in range(n))
    return ExecutionPlan.from_placement(
        Placement(HOST, rows, ACCELERATOR),
        name="cpu-moe" if layers is None else f"n-cpu-moe:{layers}")


def resident_experts(spec: ModelSpec, resident: int, rest: str = STREAMED) -> ExecutionPlan:
    """Every op on the accelerator with its weights resident, but EMBED on the host, and each
    MoE layer's routed experts placed one by one (``hx.plan.ExpertHomes``): experts 0 to N-1
    resident, the others ``streamed`` (copied in as routed before their layer's experts run),
    on ``disk`` (the same copies read from a mapped file) or on the ``host`` (computed there
    on the rows routed to them: Fiddler's split, Kamahori et al. 2024). Named
    ``resident-experts:N[:streamed|disk|host]``.

    Raises:
      HxError: the model has no experts, N outside [0, X], or another home for the rest.
    """
    if spec.moe is None:
        raise HxError(f"{spec.name} has no experts for resident-experts to place")
    X = spec.moe.routed
    if not 0 <= resident <= X:
        raise HxError(f"resident-experts:N takes N between 0 and {X}, got {resident}")
    if rest not in (STREAMED, DISK, HOST):
        raise HxError(f"resident-experts:N:HOME puts the other experts at a home of "
                      f"streamed, disk or host, got {rest!r}")
    homes = tuple(RESIDENT if e < resident else rest for e in range(X))
    placement = Placement.uniform(spec.n_layers,
                                  lambda op: HOST if op == EMBED else ACCELERATOR)
    plan = ExecutionPlan.from_placement(placement, name=f"resident-experts:{resident}:{rest}")
    experts = set(spec.expert_layers)  # a dense first layer has none to place
    return dataclasses.replace(plan, experts=ExpertHomes(tuple(
        homes if i in experts else () for i in range(spec.n_layers))))


def fewest_cpu_moe(spec: ModelSpec, devices: Devices, workload: Workload) -> ExecutionPlan:
    """``cpu_moe`` with the smallest N whose plan fits the budgets with prefill in chunks of
    ``MIN_CHUNK`` (what a llama.cpp user sets ``--n-cpu-moe`` to), by bisection (memory
    falls as N grows); N = all layers where none fits, which ``build`` then refuses with
    the budget it needs. Named ``n-cpu-moe``."""
    def fit(n: int) -> bool:
        return fits(cpu_moe(spec, n).with_prefill_chunk(MIN_CHUNK), spec, devices, workload)

    return cpu_moe(spec, _boundary(fit, spec.n_layers, -1))


def _boundary(fit: Callable[[int], bool], fitting: int, failing: int) -> int:
    """The N that fits next to the first that does not, by bisection between ``fitting``
    (taken to fit) and ``failing`` (taken not to), ``fit`` monotone between them."""
    while abs(failing - fitting) > 1:
        middle = (fitting + failing) // 2
        if fit(middle):
            fitting = middle
        else:
            failing = middle
    return fitting


def largest_layer_split(spec: ModelSpec, devices: Devices, workload: Workload
                        ) -> ExecutionPlan:
    """``layer_split`` with the largest N whose plan fits the budgets with prefill in chunks
    of ``MIN_CHUNK``, by bisection (memory grows with N; N = 0 always fits the
    accelerator)."""
    def split_fits(n: int) -> bool:
        plan = layer_split(spec.n_layers, n).with_prefill_chunk(MIN_CHUNK)
        return fits(plan, spec, devices, workload)

    return layer_split(spec.n_layers, _boundary(split_fits, 0, spec.n_layers + 2))


@functools.lru_cache(maxsize=64)
def _cpsat_plan(spec: ModelSpec, profile: "HardwareProfile", devices: Devices,
                workload: Workload, time_limit_s: float, kv_disk: bool) -> ExecutionPlan:
    """``cpsat.plan_cpsat``'s plan (cached: ``auto`` asks for the one ``cpsat`` found; the
    solver is deterministic for its default seed)."""
    from hx.planner import cpsat

    return cpsat.plan_cpsat(spec, profile, devices, workload, time_limit_s,
                            kv_disk=kv_disk).plan


@dataclass(frozen=True)
class Request:
    """What ``build`` is asked for: the model's spec, the budgets and the workload, and the
    options a policy reads (``build``'s arguments)."""

    spec: ModelSpec
    devices: Devices
    workload: Workload
    gpu_layers: int | None = None
    profile: "HardwareProfile | None" = None
    time_limit_s: float = 5.0
    kv_disk: bool = False
    activity: "ExpertActivity | None" = None

    def expert_activity(self) -> "ExpertActivity":
        """The experts' activity profile given, else a random router's (uniform)."""
        return self.activity or _experts().ExpertActivity.uniform(self.spec)


@dataclass(frozen=True)
class Policy:
    """A named policy of ``POLICIES``.

    Attributes:
      plan: its plan for a ``Request`` (``build`` then fits the prefill chunk).
      needs_profile: it prices ops with a hardware profile (``hx profile``).
      baseline: the ablations compare CP-SAT with it (``hx ablate``, the simulated grid).
    """

    plan: Callable[[Request], ExecutionPlan]
    needs_profile: bool = False
    baseline: bool = False


def _layer_split(r: Request) -> ExecutionPlan:
    """``layer_split`` at ``r.gpu_layers``, or the largest that fits when it is None."""
    if r.gpu_layers is None:
        return largest_layer_split(r.spec, r.devices, r.workload)
    return layer_split(r.spec.n_layers, r.gpu_layers)


def _baselines():
    """The module ``baselines``, imported when a policy of it is first asked for: it loads
    OR-Tools."""
    from hx.planner import baselines

    return baselines


def _experts():
    """The module ``experts``, imported when an MoE placement is first asked for (it loads
    OR-Tools)."""
    from hx.planner import experts

    return experts


def _cpsat(r: Request) -> ExecutionPlan:
    """CP-SAT's plan: for a Mixture of Experts whose other ops fit the accelerator beside the
    buffers of streamed experts, its routed experts placed one by one (``moe_cpsat``); else
    the op-level plan (``_cpsat_plan``)."""
    if r.spec.moe is not None:
        try:
            return moe_cpsat(r)
        except HxError:  # the other ops do not fit beside the experts: place ops
            pass
    return _cpsat_plan(r.spec, r.profile, r.devices, r.workload, r.time_limit_s, r.kv_disk)


def moe_cpsat(r: Request) -> ExecutionPlan:
    """Every op but the routed experts resident on the accelerator (EMBED on the host), each
    routed expert resident, streamed or on the host as ``experts.cpsat_experts`` places them
    in the bytes the rest leaves (``experts.expert_budget``), priced on ``r.profile`` for
    ``r.expert_activity()``; re-solved with the accelerator's share lowered by what a plan
    overshoots (``_fitting``). That placement, the whole-layer one it starts from
    (``experts.whole_layers``), every expert on the host (the shared experts kept on the
    accelerator) or ``--cpu-moe``'s plan (MLP2 whole on the host, its shared experts with
    it: the expert placements keep them on the accelerator, which may be the busier side),
    each with the largest prefill chunk under which it fits, whichever
    ``simulator.predict_run`` predicts the shorter run:
    the solver's price of an expert is linear, the executor's steps are not quite (as the
    op-level CP-SAT's candidates, ``cpsat.solve``).

    Raises:
      HxError: the other ops do not fit, or no placement of the experts fits.
    """
    ex, activity = _experts(), r.expert_activity()

    def place(accelerator: int, host: int | None):
        return ex.cpsat_experts(r.spec, r.profile, r.workload, activity, accelerator, host,
                                r.time_limit_s)

    def whole(accelerator: int, host: int | None):
        return ex.whole_layers(r.spec, r.profile, r.workload, activity, accelerator)

    def on_host(accelerator: int, host: int | None):
        return whole(0, host)

    candidates = [_fitting(r, place, "cpsat")]
    for other in (whole, on_host):
        try:
            candidates.append(_fitting(r, other, "cpsat"))
        except HxError:  # it overshoots the host's budget: the others alone
            pass
    if fits(cpu_moe(r.spec).with_prefill_chunk(MIN_CHUNK), r.spec, r.devices, r.workload):
        candidates.append(dataclasses.replace(cpu_moe(r.spec), name="cpsat"))
    chunked = [fit_prefill_chunk(p, r.spec, r.devices, r.workload) for p in candidates]
    return min(chunked,
               key=lambda p: predict_run(p, r.spec, r.profile, r.workload, activity).total_s)


def _fitting(r: Request, place: Callable, name: str) -> ExecutionPlan:
    """``experts.expert_plan`` of the homes ``place(accelerator bytes, host bytes)`` gives in
    what the other ops leave (``experts.expert_budget``), all of the accelerator's share if
    that fits, else the least of it held back, 1 % to ``MAX_MARGIN`` %, under which the plan
    fits (proxy-sized, the resident experts' XLA temporaries are not known before): the first
    of 1, 2, 4, ... % that fits, then by bisection below it. Whether a placement fits is not
    monotone in the margin over the whole range (a smaller budget may put experts on the
    host, whose layers hold a staged part longer), so the search climbs from the smallest.

    Raises:
      HxError: the other ops do not fit, or no placement does.
    """
    ex = _experts()
    if r.spec.moe is None:
        raise HxError(f"{r.spec.name} has no experts for {name} to place")
    plans: dict[int, ExecutionPlan] = {}

    def fit(margin: int) -> bool:  # percent of the accelerator's share held back
        budget = ex.expert_budget(r.spec, r.devices, r.workload, margin / 100)
        plans[margin] = ex.expert_plan(r.spec, place(*budget), name)
        return fits(plans[margin].with_prefill_chunk(MIN_CHUNK), r.spec, r.devices, r.workload)

    failing = 0
    for margin in (0, 1, 2, 4, 8, 16, 32, MAX_MARGIN):
        if fit(margin):
            return plans[_boundary(fit, margin, failing) if margin else 0]
        failing = margin
    raise HxError(f"no {name} placement of {r.spec.name}'s routed experts fits the budgets")


MAX_MARGIN = 40  # percent of the experts' accelerator share ``_fitting`` may hold back


def _hot_experts(per_layer: bool, name: str) -> Callable[[Request], ExecutionPlan]:
    """The policy placing the hottest experts resident (``experts.hot_experts``) in the
    bytes the other ops leave, the rest on the host (``_fitting``)."""
    def plan(r: Request) -> ExecutionPlan:
        return _fitting(r, lambda accelerator, _: _experts().hot_experts(
            r.spec, r.expert_activity(), accelerator, per_layer), name)

    return plan


def _all_accelerator_fits(spec: ModelSpec, devices: Devices, workload: Workload) -> bool:
    """Whether all-accelerator fits the budgets (prefill in chunks of ``MIN_CHUNK``)."""
    plan = all_accelerator(spec.n_layers).with_prefill_chunk(MIN_CHUNK)
    return fits(plan, spec, devices, workload)


@functools.lru_cache(maxsize=16)
def _host_holds_a_layer_split(spec: ModelSpec, devices: Devices, workload: Workload) -> bool:
    """Whether the largest layer split fits the budgets (prefill in chunks of ``MIN_CHUNK``):
    it always fits the accelerator, so where it does not, the host memory budget is short
    (cached: ``needs_profile`` asks before ``build`` plans)."""
    plan = largest_layer_split(spec, devices, workload).with_prefill_chunk(MIN_CHUNK)
    return fits(plan, spec, devices, workload)


def needs_profile(policy: str | None, spec: ModelSpec, devices: Devices,
                  workload: Workload) -> bool:
    """Whether ``build(policy, spec, devices, workload)`` needs a hardware profile: a policy
    that prices ops (``Policy.needs_profile``) always; ``auto`` where all-accelerator does not
    fit and its stand-in without a profile, the largest layer split, overflows the host memory
    budget (only CP-SAT keeps weights on disk, priced by the profile's disk read rate); None
    (a plan not chosen by a policy) never."""
    if policy in NEEDS_PROFILE:
        return True
    return policy == "auto" and not _all_accelerator_fits(spec, devices, workload) and \
        not _host_holds_a_layer_split(spec, devices, workload)


def _auto(r: Request) -> ExecutionPlan:
    """``auto`` (``build``'s docstring): all-accelerator where it fits, else the shorter run
    of CP-SAT's plan and stream-all, or without a profile the largest layer split."""
    spec, devices, workload = r.spec, r.devices, r.workload
    n = spec.n_layers
    if _all_accelerator_fits(spec, devices, workload):
        return fit_prefill_chunk(all_accelerator(n), spec, devices, workload)
    if r.profile is None:
        split = largest_layer_split(spec, devices, workload)
        if _host_holds_a_layer_split(spec, devices, workload):
            return fit_prefill_chunk(split, spec, devices, workload)
        try:
            check_fits(split.with_prefill_chunk(MIN_CHUNK), spec, devices, workload,
                       sizing=PROXY)
        except HxError as e:  # the host budget, with the bytes over
            raise HxError(f"{e}. Only a CP-SAT plan keeps weights on disk, and it needs a "
                          "hardware profile with the disk's read rate: pass one (`hx "
                          "profile` measures a full one, hx.measure.profiler.load_or_measure "
                          "a quick one, as hx's commands and hx.Engine do here)") from e
    candidates = [fit_prefill_chunk(_cpsat(r), spec, devices, workload)]
    if fits(stream_all(n).with_prefill_chunk(MIN_CHUNK), spec, devices, workload):
        candidates.append(fit_prefill_chunk(stream_all(n), spec, devices, workload))
    return min(candidates,
               key=lambda p: predict_run(p, spec, r.profile, workload, r.activity).total_s)


# Every named policy, in the order the CLI's help lists them (``flexgen:G[:C][:kv-disk]``, a
# FlexGen setting as published, is parsed by ``build``).
POLICIES: dict[str, Policy] = {
    "all-accelerator": Policy(lambda r: all_accelerator(r.spec.n_layers), baseline=True),
    "all-host": Policy(lambda r: all_host(r.spec.n_layers)),
    "stream-all": Policy(lambda r: stream_all(r.spec.n_layers), baseline=True),
    "layer-split": Policy(_layer_split, baseline=True),
    "min-max": Policy(lambda r: _baselines().min_max(r.spec, r.profile, r.devices, r.workload),
                      needs_profile=True, baseline=True),
    "flexgen-lp": Policy(
        lambda r: _baselines().flexgen_lp(r.spec, r.profile, r.devices, r.workload),
        needs_profile=True, baseline=True),
    "cpsat": Policy(_cpsat, needs_profile=True),
    "auto": Policy(_auto),  # falls back without a profile
}
# the policies of Mixture-of-Experts models alone: kTransformers' and Fiddler's placements
# of the hottest experts (``experts.hot_experts``), and parsed by ``build``: ``cpu_moe`` and
# ``resident_experts``
MOE_TABLE: dict[str, Policy] = {
    "ktransformers": Policy(_hot_experts(False, "ktransformers"), baseline=True),
    "fiddler": Policy(_hot_experts(True, "fiddler"), baseline=True),
}
MOE_POLICIES = ("cpu-moe", "n-cpu-moe[:N]", "resident-experts:N[:streamed|disk|host]",
                *MOE_TABLE)
NEEDS_PROFILE = tuple(name for name, policy in POLICIES.items() if policy.needs_profile)
BASELINES = tuple(name for name, policy in POLICIES.items() if policy.baseline)
COMPARED = ("cpsat", *BASELINES)  # an ablation's policies (hx ablate, the simulated grid)


def build(policy: str, spec: ModelSpec, devices: Devices, workload: Workload,
          gpu_layers: int | None = None, profile: "HardwareProfile | None" = None,
          time_limit_s: float = 5.0, kv_disk: bool = False,
          activity: "ExpertActivity | None" = None) -> ExecutionPlan:
    """The plan of a named policy, checked against the budgets, with the largest prefill
    chunk under which it fits (``fit_prefill_chunk``).

    ``layer-split`` uses ``gpu_layers``, or the largest N that fits when it is None.
    ``cpu-moe`` keeps an MoE model's routed experts on the host, ``n-cpu-moe:N`` the first N
    layers' (``cpu_moe``; ``n-cpu-moe`` the smallest N that fits: ``fewest_cpu_moe``); ``resident-experts:N[:HOME]`` N of each layer's experts resident,
    the rest streamed, on disk or on the host (``resident_experts``); ``ktransformers`` and ``fiddler``
    the hottest experts resident by ``activity`` (default uniform), over the model or per
    layer (``experts.hot_experts``); ``cpsat`` places an MoE model's experts one by one
    (``moe_cpsat``).
    ``flexgen:G[:C][:kv-disk]`` is a FlexGen policy as published: G % of the weights on the
    GPU, C % in host memory (default the rest), the rest on disk, the KV cache on the host or
    on disk (``baselines.flexgen_published``). ``min-max``, ``flexgen-lp`` and ``cpsat`` price
    ops with ``profile`` (``Policy.needs_profile``); CP-SAT stops at ``time_limit_s`` seconds per
    solve with its best plan, and keeps KV caches off the disk, which the executor refuses,
    unless ``kv_disk`` (a plan only simulated: ``cpsat.solve``). ``auto`` is all-accelerator
    when that fits, else the CP-SAT plan or stream-all, whichever ``simulator.predict_run``
    predicts the shorter run (without a profile: the largest layer split): CP-SAT sets
    activations aside before it knows the plan, with the temporaries of SCORE on the
    accelerator counted, so at large batches it can miss streaming plans that attend on the
    host and fit when sized exactly
    (Llama-2-7B:8L bf16 at 64 rows under a 0.94 GB budget, this machine's compiler: its plan
    all-host, 261 ms per decode step predicted, stream-all 100 ms).
    Raises:
      HxError: an unknown policy, a policy needing a profile without one, or a plan that does
        not fit (naming the minimum feasible budget for it).
    """
    request = Request(spec, devices, workload, gpu_layers, profile, time_limit_s, kv_disk,
                      activity)
    if policy.startswith("flexgen:"):
        plan = _baselines().flexgen_published(spec, devices, workload, *_flexgen_shares(policy))
    elif (moe := _moe_plan(policy, request)) is not None:
        plan = moe
    elif policy in POLICIES:
        if POLICIES[policy].needs_profile and profile is None:
            raise HxError(f"policy {policy!r} needs a hardware profile (hx profile)")
        plan = POLICIES[policy].plan(request)
    else:
        raise HxError(f"unknown policy {policy!r}; policies are "
                      f"{', '.join((*POLICIES, *MOE_POLICIES))}")
    try:
        return fit_prefill_chunk(plan, spec, devices, workload)
    except HxError as e:
        need = estimate(plan.with_prefill_chunk(MIN_CHUNK), spec, workload)
        capacity = devices.accelerator.capacity
        if capacity is None or need.accelerator <= capacity:
            raise  # the host budget
        raise HxError(f"policy {policy!r} does not fit the accelerator memory budget of "
                      f"{capacity} bytes at batch {workload.batch}, {workload.cache_slots} KV "
                      f"slots: the minimum feasible budget for it is {need.accelerator} bytes "
                      f"({need.breakdown()}, prefill in chunks of {MIN_CHUNK} tokens), over by "
                      f"{need.accelerator - capacity}") from e


def _moe_plan(policy: str, r: Request) -> ExecutionPlan | None:
    """The plan of a Mixture-of-Experts policy (``MOE_POLICIES``: ``cpu-moe``,
    ``n-cpu-moe[:N]``, ``resident-experts:N[:HOME]``, ``MOE_TABLE``'s), None for another name.

    Raises:
      HxError: a malformed count, or what the policy raises.
    """
    if policy == "cpu-moe":
        return cpu_moe(r.spec)
    if policy == "n-cpu-moe":
        return fewest_cpu_moe(r.spec, r.devices, r.workload)
    if policy.startswith("n-cpu-moe:"):
        count = policy.split(":", 1)[1]
        if not count.isdigit():
            raise HxError(f"policy {policy!r}: n-cpu-moe:N takes a layer count N")
        return cpu_moe(r.spec, int(count))
    if policy.startswith("resident-experts:"):
        count, *rest = policy.split(":")[1:]
        if not count.isdigit() or len(rest) > 1:
            raise HxError(f"policy {policy!r}: write resident-experts:N[:streamed|disk|host], N "
                          "experts of each layer resident")
        return resident_experts(r.spec, int(count), *rest)
    if policy in MOE_TABLE:
        return MOE_TABLE[policy].plan(r)
    return None


def plan_on(policy: str, spec: ModelSpec, machine: str, profile: "HardwareProfile",
            budget: int, workload: Workload, time_limit_s: float = 2.0,
            activity: "ExpertActivity | None" = None) -> tuple[ExecutionPlan, MemoryEstimate]:
    """``policy``'s plan for ``spec`` on hardware ``machine`` (a preset or ``local``; its
    ``profile``) with ``budget`` bytes of accelerator memory and the profile's host memory, and
    its memory estimate, both sized for that machine (``hardware.memory_sizing``). The plan is
    simulated, not run: CP-SAT may keep KV caches on disk (``build``'s ``kv_disk``). An MoE
    model's experts are placed for ``activity`` (``build``'s).

    Raises:
      HxError: no plan of the policy fits (``build``).
    """
    devices = discover(accelerator_memory=budget, host_memory=profile.host_memory)
    with memory_sizing(machine):
        plan = build(policy, spec, devices, workload, profile=profile,
                     time_limit_s=time_limit_s, kv_disk=True, activity=activity)
        return plan, estimate(plan, spec, workload)


def _flexgen_shares(policy: str) -> tuple[float, float | None, str]:
    """(GPU share, CPU share or None, KV home) of ``flexgen:GPU[:CPU][:kv-disk]``.

    Raises:
      HxError: a malformed policy name.
    """
    shares = policy.split(":")[1:]
    kv = DISK if shares[-1:] == ["kv-disk"] else HOST
    shares = shares[:-1] if kv == DISK else shares
    if not 1 <= len(shares) <= 2 or not all(s.isdigit() for s in shares):
        raise HxError(f"bad policy {policy!r}: write flexgen:GPU[:CPU][:kv-disk], the "
                      f"percent of weights FlexGen keeps on the GPU (and in CPU memory; "
                      f"the rest on disk), e.g. flexgen:20 or flexgen:0:50:kv-disk")
    return int(shares[0]) / 100, int(shares[1]) / 100 if len(shares) == 2 else None, kv
