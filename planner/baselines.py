"""Cost-model-driven baselines: TwinPilots-style min-max and FlexGen's LP policy.

Both price ops with the simulator's ``op_seconds`` on a ``HardwareProfile`` at the decode shapes
of a workload, and both return plans that ``hx.memory.check_fits`` accepts with prefill in chunks of
``hx.workload.MIN_CHUNK`` tokens.
"""

from __future__ import annotations

from ortools.linear_solver import pywraplp

from hx.devices import ACCELERATOR, HOST, Devices
from hx.errors import HxError
from hx.memory import PROXY, activation_reserve, check_fits
from hx.models.spec import HEAD, LAYER_OPS, SCORE, ModelSpec
from hx.models.tensors import layer_cache_bytes
from hx.plan import DISK, RESIDENT, STREAMED, WEIGHTED_OPS, ExecutionPlan
from hx.planner.fitting import fits
from hx.planner.patterns import Pattern, layer_plan
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import op_seconds
from hx.workload import MIN_CHUNK, Workload


def _op_times(spec: ModelSpec, profile: HardwareProfile, workload: Workload
              ) -> dict[str, dict[str, float]]:
    """{device: {op: seconds per decode step}} at the middle of the cache."""
    context = workload.decode_context
    return {d: {op: op_seconds(spec, profile, d, op, workload.batch, 1, workload.cache_slots,
                               context) for op in LAYER_OPS + (HEAD,)}
            for d in (ACCELERATOR, HOST)}


def _fits(plan: ExecutionPlan, spec: ModelSpec, devices: Devices, workload: Workload) -> bool:
    """Whether the plan fits with prefill in chunks of ``MIN_CHUNK`` tokens."""
    return fits(plan.with_prefill_chunk(MIN_CHUNK), spec, devices, workload)


def _reserve(spec: ModelSpec, workload: Workload) -> int:
    return activation_reserve(spec, workload, min(workload.prompt_tokens, MIN_CHUNK))


def min_max(spec: ModelSpec, profile: HardwareProfile, devices: Devices, workload: Workload
            ) -> ExecutionPlan:
    """TwinPilots-style load balancing (Yu et al. 2024): start with every op on the host and
    greedily move the op whose move most lowers max(host load, accelerator load), where the
    accelerator's load counts its compute, the weight copies of streamed ops and one
    activation transfer per op that leaves the host. An op's weights are resident when they
    fit, else streamed; SCORE moves with its KV cache. Memory is tracked as resident weights +
    accelerator KV + twice the largest streamed layer (double buffer) + activations; it stops
    when no move lowers the maximum and fits, and backs out moves if ``check_fits`` disagrees.

    Raises:
      HxError: not even every op on the host fits (the host memory budget), by how much.
    """
    times = _op_times(spec, profile, workload)
    capacity = devices.accelerator.capacity
    act = _reserve(spec, workload)
    kv_layer = layer_cache_bytes(spec, workload.rows, workload.cache_slots)
    state: dict[tuple[int | None, str], str] = {(i, op): HOST for i in range(spec.n_layers)
                                                for op in LAYER_OPS}
    state[(None, HEAD)] = HOST
    resident = 0
    streamed = {i: 0 for i in range(spec.n_layers)} | {None: 0}

    def acc_cost(op: str, home: str) -> float:
        copy = spec.op_weight_bytes(op) / profile.h2d_bandwidth if home == STREAMED else 0.0
        return times[ACCELERATOR][op] + copy + profile.transfer_latency

    host_load = sum(times[HOST][op] for (_, op) in state)
    acc_load, moves = 0.0, []
    while True:
        best, peak = None, max(streamed.values())  # the largest streamed layer so far
        for (layer, op), current in state.items():
            if current != HOST:
                continue
            size = kv_layer if op == SCORE else spec.op_weight_bytes(op)
            for home in ((RESIDENT,) if op == SCORE else (RESIDENT, STREAMED)):
                needed = (resident + size + 2 * peak if home == RESIDENT
                          else resident + 2 * max(peak, streamed[layer] + size)) + act
                fits = capacity is None or needed <= capacity
                if not fits:
                    continue
                load = max(host_load - times[HOST][op], acc_load + acc_cost(op, home))
                if load < max(host_load, acc_load) and (best is None or load < best[0]):
                    best = (load, (layer, op), home, size)
                break  # resident is preferred whenever it fits
        if best is None:
            break
        _, key, home, size = best
        state[key] = home
        moves.append(key)
        if home == RESIDENT:
            resident += size
        else:
            streamed[key[0]] += size
        host_load -= times[HOST][key[1]]
        acc_load += acc_cost(key[1], home)

    def plan_of() -> ExecutionPlan:
        return layer_plan(spec, [Pattern(ACCELERATOR if state[(i, SCORE)] != HOST else HOST,
                                         tuple(state[(i, op)] for op in WEIGHTED_OPS))
                                 for i in range(spec.n_layers)], state[(None, HEAD)], "min-max")

    while not _fits(plan_of(), spec, devices, workload):  # the tally is an estimate
        if not moves:  # all on the host, and that does not fit: say why
            check_fits(plan_of().with_prefill_chunk(MIN_CHUNK), spec, devices, workload,
                       sizing=PROXY)
        state[moves.pop()] = HOST
    return plan_of()


def flexgen_lp(spec: ModelSpec, profile: HardwareProfile, devices: Devices, workload: Workload
               ) -> ExecutionPlan:
    """FlexGen's policy search as a linear program (Sheng et al. 2023, §4): the fraction w of
    weights kept resident (the rest streamed in) and the fraction c of KV cache on the
    accelerator (the rest on the host, attended there: FlexGen's CPU-cache compute), minimising
    the per-layer decode time T >= copy time, >= accelerator compute, >= host compute (FlexGen
    overlaps the three), under the accelerator budget. The LP is solved with OR-Tools (GLOP);
    w becomes, in every layer, the largest ops resident while their share stays within w, and
    c the number of layers whose KV sits on the accelerator (rounded down until the plan fits).
    Every op but host-cache SCORE runs on the accelerator; HEAD is resident when w = 1, else
    streamed, else on the host if streaming it does not fit; EMBED stays on the host.

    Raises:
      HxError: no plan fits, with the minimum feasible budget (two streamed layers and the
        activations).
    """
    L = spec.n_layers
    times = _op_times(spec, profile, workload)
    layer_w = spec.layer_weight_bytes
    kv_layer = layer_cache_bytes(spec, workload.rows, workload.cache_slots)
    acc_compute = sum(times[ACCELERATOR][op] for op in WEIGHTED_OPS)
    capacity = devices.accelerator.capacity
    act = _reserve(spec, workload)

    no_fit = (f"flexgen-lp: no plan fits the accelerator budget of {capacity} bytes at batch "
              f"{workload.batch}; the minimum feasible budget is {2 * layer_w + act} bytes (two "
              f"streamed layers and activations)")
    solver = pywraplp.Solver.CreateSolver("GLOP")
    w = solver.NumVar(0, 1, "w")
    c = solver.NumVar(0, 1, "c")
    t = solver.NumVar(0, solver.infinity(), "T")
    solver.Add(t >= (1 - w) * layer_w / profile.h2d_bandwidth)
    solver.Add(t >= acc_compute + c * times[ACCELERATOR][SCORE])
    solver.Add(t >= (1 - c) * times[HOST][SCORE])
    if capacity is not None:
        solver.Add(w * L * layer_w + c * L * kv_layer + 2 * layer_w + act <= capacity)
    solver.Minimize(t)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        raise HxError(no_fit)
    w_value, c_value = w.solution_value(), c.solution_value()
    by_size = sorted(WEIGHTED_OPS, key=spec.op_weight_bytes, reverse=True)
    resident, share = set(), 0.0
    for op in by_size:
        if share + spec.op_weight_bytes(op) / layer_w <= w_value + 1e-9:
            resident.add(op)
            share += spec.op_weight_bytes(op) / layer_w
    homes = tuple(RESIDENT if op in resident else STREAMED for op in WEIGHTED_OPS)
    heads = ((RESIDENT,) if w_value >= 1 - 1e-9 else ()) + (STREAMED, HOST)
    for kv_layers in range(round(c_value * L), -1, -1):
        first_acc_kv = L - kv_layers
        for head in heads:
            plan = layer_plan(spec, [Pattern(HOST if i < first_acc_kv else ACCELERATOR, homes)
                                     for i in range(L)], head, "flexgen-lp")
            if _fits(plan, spec, devices, workload):
                return plan
    raise HxError(no_fit)


def flexgen_published(spec: ModelSpec, devices: Devices, workload: Workload,
                      weights_gpu: float, weights_cpu: float | None = None,
                      kv: str = HOST) -> ExecutionPlan:
    """A FlexGen policy as published (Sheng et al. 2023, §6 and ``bench_suite.py``, e.g.
    OPT-30B on a T4: ``--percent 20 80 0 100 0 100 --cpu-cache-compute``): ``weights_gpu`` of
    every layer's weight bytes resident on the accelerator, ``weights_cpu`` (default: the
    rest) streamed from host memory and the rest streamed from disk (OPT-175B: 0 / 50 / 50),
    the KV cache on the host (``kv``: or on disk, as OPT-175B's ``--percent ... 0 0`` puts it)
    with attention computed on the host, the activations moving through host memory. FlexGen
    assigns each weight tensor of a layer wholly to one tier by the
    midpoint of its cumulative byte range (``init_weight_list``); here the unit is an op, in
    the layer's order. HEAD is resident when ``weights_gpu`` is 1, else streamed; EMBED stays
    on the host. The block (GPU batch x micro-batches) is the workload's.

    Raises:
      HxError: shares outside [0, 1] or summing past 1, or the plan does not fit the budgets.
    """
    cpu = 1.0 - weights_gpu if weights_cpu is None else weights_cpu
    if not (0.0 <= weights_gpu <= 1.0 and 0.0 <= cpu and weights_gpu + cpu <= 1.0 + 1e-9):
        raise HxError(f"FlexGen's weight shares must lie in 0..1 and sum to at most 1, got GPU "
                      f"{weights_gpu}, CPU {cpu}")
    layer_w, done, homes = spec.layer_weight_bytes, 0, []
    for op in WEIGHTED_OPS:
        size = spec.op_weight_bytes(op)
        middle = (done + size / 2) / layer_w
        homes.append(RESIDENT if middle < weights_gpu else
                     STREAMED if middle < weights_gpu + cpu else DISK)
        done += size
    head = RESIDENT if weights_gpu >= 1.0 else STREAMED
    name = f"flexgen:{round(weights_gpu * 100)}" + (
        f":{round(cpu * 100)}" if weights_gpu + cpu < 1 - 1e-9 else "")
    name += ":kv-disk" if kv == DISK else ""
    plan = layer_plan(spec, [Pattern(kv, tuple(homes))] * spec.n_layers, head, name)
    check_fits(plan.with_prefill_chunk(MIN_CHUNK), spec, devices, workload, sizing=PROXY)
    return plan
