"""Where each routed expert of a Mixture of Experts lives: expert activity profiles and the
placements of CP-SAT and of the published systems (docs/architecture.md, "Planner").

**Activity** (``ExpertActivity``): per layer and expert, the chance a token picks it (the k
picks of a token sum to k). ``uniform`` is a random router's (this machine's random models);
``zipf`` a skewed one for planning tests, each layer's experts ranked by a seeded permutation
with shares falling as rank^-s (trained routers are skewed: a few experts of a layer take
most tokens -- Fiddler, Kamahori et al. 2024, Fig. 3; MoE-Infinity); ``from_trace`` reads the
counts of a run (``{"layers": [[picks of expert 0, ...], ...]}``, as a router trace gives).

**Placements**, all keeping every op but the routed experts resident on the accelerator
(EMBED's table on the host, as llama.cpp keeps it), MLP2 with the shared expert there:

* ``cpsat_experts`` (CP-SAT): each expert resident, streamed (copied when routed to) or on the
  host (computed there on its rows), minimising a run's expected time -- prefill plus the
  decode steps, each expert priced at the chance a step routes to it times the time it then
  takes where it lives (``ExpertCosts``), each layer that computes some experts on the host
  or streams some paying that side's fixed crossing -- under the accelerator and host
  budgets;
* ``hot_experts`` (kTransformers' rule, the hottest (layer, expert) pairs over the whole model
  resident, the rest on the host) and ``hot_experts(per_layer=True)`` (Fiddler's, the same
  count of each layer's hottest resident).

Times come from the simulator (``simulator.op_seconds``) on a ``HardwareProfile`` at the
expected rows an expert gets; planner code, so no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

from hx.devices import ACCELERATOR, HOST, Devices
from hx.errors import HxError
from hx.models.ops import EXPERTS_HOST, EXPERTS_RESIDENT
from hx.models.spec import EMBED, ModelSpec, gathers
from hx.plan import DISK, RESIDENT, STREAMED, ExecutionPlan, ExpertHomes, Placement
from hx.planner.cost import routed_chance
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import ggml_seconds, op_seconds
from hx.schedule import WHOLE_PART_BUFFERS, routed_expert_bytes
from hx.workload import Workload

TIME_UNIT = 1e-7  # seconds per integer unit of CP-SAT's objective (0.1 µs)


@dataclass(frozen=True)
class ExpertActivity:
    """Per layer, per routed expert, the chance a token picks it (each layer's sum is k).

    Attributes:
      shares: (layers, experts) of probabilities in [0, 1].
      name: how it was made, for reports.
    """

    shares: tuple[tuple[float, ...], ...]
    name: str = "uniform"

    @classmethod
    def uniform(cls, spec: ModelSpec) -> "ExpertActivity":
        """A random router's: every expert k / X (0 in a dense first layer, which has
        none: ``ModelSpec.expert_layers``)."""
        X, k = spec.moe.routed, spec.moe.top_k
        experts = set(spec.expert_layers)
        return cls(tuple((k / X if l in experts else 0.0,) * X for l in range(spec.n_layers)))

    @classmethod
    def zipf(cls, spec: ModelSpec, s: float = 1.0, seed: int = 0) -> "ExpertActivity":
        """A skewed router's: in each layer, the expert of rank r (a seeded permutation) picked
        in proportion to r^-s, scaled so a layer's shares sum to k, none above 1."""
        X, k = spec.moe.routed, spec.moe.top_k
        rng = np.random.default_rng(seed)
        layers, experts = [], set(spec.expert_layers)
        for l in range(spec.n_layers):
            weight = np.arange(1, X + 1, dtype=np.float64) ** -s
            share = _capped(k * weight / weight.sum())[rng.permutation(X)]
            layers.append(tuple(float(v) if l in experts else 0.0 for v in share))
        return cls(tuple(layers), f"zipf:{s:g}")

    @classmethod
    def from_trace(cls, path: str, spec: ModelSpec) -> "ExpertActivity":
        """Counts of picks per layer and expert, ``{"layers": [[count, ...], ...]}``, as
        shares (each layer's counts scaled to sum to k).

        Raises:
          HxError: not such a file, or another count of layers or experts than the model's.
        """
        try:
            with open(path) as f:
                rows = json.load(f)["layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HxError(f"expert trace {path}: {e}; write {{\"layers\": [[picks of expert "
                          "0, ...], ...]}}") from None
        X, experts = spec.moe.routed, set(spec.expert_layers)
        if len(rows) != spec.n_layers or any(
                len(r) != X or (sum(r) <= 0) == (l in experts) for l, r in enumerate(rows)):
            raise HxError(f"expert trace {path} has {len(rows)} layers of counts; "
                          f"{spec.name} has {spec.n_layers} layers of {X} experts, each MoE "
                          "layer's counts summing above 0 and a dense layer's to 0")
        k = spec.moe.top_k
        return cls(tuple(tuple(float(v) for v in _capped(k * np.asarray(r, np.float64)
                                                          / max(sum(r), 1)))
                         for r in rows), f"trace:{path}")


def activity_named(spec: ModelSpec, name: str | None) -> ExpertActivity | None:
    """The activity ``--expert-activity`` names: ``uniform``, ``zipf:S[:SEED]``, or a trace
    file's path (``ExpertActivity.from_trace``); None for None.

    Raises:
      HxError: a dense model, a malformed ``zipf``, or a bad trace file.
    """
    if name is None:
        return None
    if spec.moe is None:
        raise HxError(f"--expert-activity is for a Mixture of Experts; {spec.name} has none")
    if name == "uniform":
        return ExpertActivity.uniform(spec)
    if name.startswith("zipf:"):
        try:
            s, *seed = name.split(":")[1:]
            return ExpertActivity.zipf(spec, float(s), int(seed[0]) if seed else 0)
        except (ValueError, IndexError):
            raise HxError(f"--expert-activity {name!r}: write zipf:S[:SEED], e.g. zipf:1.2 "
                          "(experts' shares falling as rank^-S)") from None
    return ExpertActivity.from_trace(name, spec)


def _capped(share: np.ndarray) -> np.ndarray:
    """``share`` with no value above 1 (a token picks an expert once), the excess spread
    over the others in proportion (the sum kept)."""
    share = share.copy()
    for _ in range(len(share)):
        over = share > 1
        if not over.any():
            break
        excess = (share[over] - 1).sum()
        share[over] = 1
        rest = ~over & (share < 1)
        share[rest] += excess * share[rest] / share[rest].sum()
    return share


def expert_plan(spec: ModelSpec, homes: ExpertHomes, name: str) -> ExecutionPlan:
    """Every op on the accelerator with its weights resident, but EMBED on the host, and the
    routed experts at ``homes`` (the placements' common frame, module docstring)."""
    placement = Placement.uniform(spec.n_layers,
                                  lambda op: HOST if op == EMBED else ACCELERATOR)
    plan = ExecutionPlan.from_placement(placement, name=name)
    return dataclasses.replace(plan, experts=homes)


@dataclass(frozen=True)
class ExpertCosts:
    """Expected seconds of one expert per step where it lives, and each side's fixed cost a
    layer pays once it holds some expert there, for a run of ``workload`` (prefill once, then
    its decode steps: ``Workload.decode_steps``), each priced as the executor computes it:

    * where the device multiplies the experts as held (the host's ggml over GGUF blocks), an
      expert costs its product over the rows routed to it, times the chance a step routes to
      it;
    * where XLA runs them (``models.moe.Experts``): at fewer (row, expert) pairs than experts
      (decode) it gathers each row's k of the part's experts, whatever they are: a layer's
      fixed cost, k experts' products a row; at more (prefill) every expert of the part runs
      on every row, routed to or not;
    * a streamed expert adds its copy when a step routes to it; a disk-homed one (where the
      profile has a disk) its read from disk besides, in the same op as the streamed ones.

    Attributes:
      seconds: {home: (layers, experts) array}: an expert's expected seconds there over the
        run (``disk`` only where the profile has a disk's read rate).
      fixed: {home: seconds a layer pays over the run for running some experts there}: the
        host's x and a crossing and coming back, a launch each side; a streamed part's
        routing read back and its launch (disk-homed experts' too); XLA's gathered
        products.
      nbytes: bytes of one expert as the accelerator and the host hold it.
    """

    seconds: dict[str, np.ndarray]
    fixed: dict[str, float]
    nbytes: int

    @classmethod
    def price(cls, spec: ModelSpec, profile: HardwareProfile, workload: Workload,
              activity: ExpertActivity) -> "ExpertCosts":
        """Price every expert at each home (class docstring) on ``profile``."""
        X, k, slots = spec.moe.routed, spec.moe.top_k, workload.cache_slots
        op_of = {HOST: EXPERTS_HOST, RESIDENT: EXPERTS_RESIDENT, STREAMED: EXPERTS_RESIDENT}
        device_of = {HOST: HOST, RESIDENT: ACCELERATOR, STREAMED: ACCELERATOR}
        memo: dict[tuple, float] = {}

        def run(home: str, experts: int, rows: int) -> float:
            """A part of ``experts`` at ``home`` over ``rows`` rows, each row picking each."""
            key = (device_of[home], experts, rows)
            if key not in memo:
                part = spec.expert_part(op_of[home], experts, picks=(1.0,) * experts)
                memo[key] = op_seconds(part, profile, device_of[home], op_of[home], 1, rows,
                                       slots, 0)
            return memo[key]

        one_host = spec.expert_part(EXPERTS_HOST, 1, picks=(1.0,))
        takes = {HOST: ggml_seconds(one_host, profile.host, EXPERTS_HOST, 1) is not None,
                 RESIDENT: False, STREAMED: False}
        nbytes = routed_expert_bytes(spec)
        copy = {STREAMED: profile.h2d_latency + nbytes / profile.h2d_bandwidth}
        share = np.asarray(activity.shares)
        seconds = {home: np.zeros_like(share) for home in (RESIDENT, STREAMED, HOST)}
        fixed = {HOST: 0.0, STREAMED: 0.0, RESIDENT: 0.0}
        read = np.zeros_like(share)  # a disk-homed expert's reads before its copies
        steps = ((workload.batch * workload.prompt_tokens, 1),
                 (workload.batch, workload.decode_steps))
        for rows, count in steps:
            if not count:
                continue
            routed = routed_chance(share, rows)  # the chance a step routes to each expert
            each = np.maximum(1, np.rint(rows * share / np.maximum(routed, 1e-12)))
            for home in (RESIDENT, STREAMED, HOST):
                seconds[home] += count * routed * copy.get(home, 0.0)
                if takes[home]:
                    at = np.vectorize(lambda m: run(home, 1, int(m)))(each)
                    seconds[home] += count * routed * at
                elif gathers(rows, k, X):  # rows·k gathered experts, however many are here
                    fixed[home] += count * run(home, X, rows)
                else:  # every expert here on every row
                    seconds[home] += count * run(home, 1, rows)
            if profile.disk_read_bandwidth:
                read += count * routed * nbytes / profile.disk_read_bandwidth
        if profile.disk_read_bandwidth:  # a streamed expert read from disk first
            seconds[DISK] = seconds[STREAMED] + read
        for rows, count in steps:
            x = rows * spec.d_model * spec.dtype_bytes
            a = rows * spec.inner_width * spec.dtype_bytes
            fixed[HOST] += count * (profile.device(HOST).launch_seconds(workload.batch)
                                    + profile.device(ACCELERATOR).launch_seconds(workload.batch)
                                    + 2 * profile.transfer_latency + (x + a) / profile.d2h_bandwidth
                                    + x / profile.h2d_bandwidth + profile.sync_overhead)
            fixed[STREAMED] += count * (
                profile.device(ACCELERATOR).launch_seconds(workload.batch)
                + profile.transfer_latency + profile.sync_overhead
                + rows * spec.moe.routed * spec.dtype_bytes / profile.d2h_bandwidth)
        return cls(seconds, fixed, nbytes)


def cpsat_experts(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                  activity: ExpertActivity, accelerator_bytes: int, host_bytes: int | None,
                  time_limit_s: float = 5.0, streams: bool = True) -> ExpertHomes:
    """CP-SAT's expert homes (module docstring): a boolean per (layer, expert, home), one home
    an expert, an indicator per (layer, side) that any expert runs there (a disk-homed one
    in the streamed op); minimised: the experts' expected seconds plus the layers' fixed ones
    (``ExpertCosts``); subject to the resident experts' bytes within ``accelerator_bytes``
    and the host's and streamed ones' within ``host_bytes`` (None: unbounded), the
    accelerator's beside the buffer of the most streamed and disk-homed experts of a layer
    (``schedule``'s ``experts in``: a prefill chunk's routing fills it; ``WHOLE_PART_BUFFERS``
    of them where the part crosses whole). With a host budget
    and a profile with a disk's read rate (``ExpertCosts``) an expert may live on disk,
    costing no memory. Started from whole layers resident or on the host
    (``_whole_layers``). One worker, a seed and a deterministic limit: the same homes however
    loaded the machine is.

    Raises:
      HxError: the host cannot hold the experts the accelerator does not.
    """
    from ortools.sat.python import cp_model

    costs = ExpertCosts.price(spec, profile, workload, activity)
    homes = (RESIDENT, STREAMED, HOST) if streams else (RESIDENT, HOST)
    if streams and DISK in costs.seconds and host_bytes is not None:
        homes += (DISK,)
    layers, X = spec.expert_layers, spec.moe.routed  # a dense first layer has none
    model = cp_model.CpModel()
    x = {(l, e, h): model.NewBoolVar(f"x{l}_{e}_{h}") for l in layers for e in range(X)
         for h in homes}
    sides = [h for h in homes if h != DISK]  # a disk-homed expert runs in the streamed op
    any_at = {(l, h): model.NewBoolVar(f"y{l}_{h}") for l in layers for h in sides}
    for l in layers:
        for e in range(X):
            model.AddExactlyOne(x[(l, e, h)] for h in homes)
            for h in homes:
                model.AddImplication(x[(l, e, h)], any_at[(l, STREAMED if h == DISK else h)])
    _add_budgets(model, x, spec, workload, costs.nbytes, accelerator_bytes, host_bytes)
    hint = _whole_layers(costs, layers, X, accelerator_bytes)
    for (l, e, h), var in x.items():
        model.AddHint(var, hint[l] == h)
    for (l, h), var in any_at.items():
        model.AddHint(var, hint[l] == h)
    units = lambda v: int(round(v / TIME_UNIT))  # noqa: E731
    model.Minimize(sum(units(costs.seconds[h][l, e]) * x[(l, e, h)] for (l, e, h) in x)
                   + sum(units(costs.fixed[h]) * y for (l, h), y in any_at.items()))
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise HxError(f"no placement of {spec.name}'s routed experts fits: the host holds "
                      f"{host_bytes} bytes for them" + ("" if DISK in homes else
                      ", and the hardware profile has no disk to keep the others on"))
    return ExpertHomes(tuple(tuple(next(h for h in homes if solver.Value(x[(l, e, h)]))
                                   for e in range(X)) if l in hint else ()
                             for l in range(spec.n_layers)))


def _add_budgets(model, x: dict, spec: ModelSpec, workload: Workload, nbytes: int,
                 accelerator_bytes: int, host_bytes: int | None) -> None:
    """``cpsat_experts``' memory constraints over its booleans ``x`` ((layer, expert, home) ->
    var) of experts of ``nbytes`` each: the resident ones within ``accelerator_bytes`` beside
    the buffer streamed and disk-homed experts are copied into -- the most a layer streams (a
    prefill chunk of ``workload.prompt_tokens`` rows routes to all of them), one layer at a
    time, ``WHOLE_PART_BUFFERS`` of them where the part crosses whole -- and the host's and
    streamed ones within ``host_bytes`` (None: unbounded)."""
    layers, X = spec.expert_layers, spec.moe.routed
    homes = {h for _, _, h in x}
    copied = [h for h in (STREAMED, DISK) if h in homes]  # the streamed op's homes
    widest = model.NewIntVar(0, X, "streamed")
    for l in layers:
        if copied:
            model.Add(widest >= sum(x[(l, e, h)] for e in range(X) for h in copied))
    buffer = min(1.0, workload.batch * min(workload.prompt_tokens, 512) * spec.moe.top_k / X)
    buffers = WHOLE_PART_BUFFERS if buffer >= 1.0 else 1  # parts crossing whole, a layer ahead
    model.Add(sum(x[(l, e, RESIDENT)] for l in layers for e in range(X)) * nbytes
              + widest * buffers * int(math.ceil(buffer * nbytes)) <= accelerator_bytes)
    if host_bytes is not None:
        model.Add(sum(var for (_, _, h), var in x.items() if h not in (RESIDENT, DISK))
                  * nbytes <= host_bytes)


def whole_layers(spec: ModelSpec, profile: HardwareProfile, workload: Workload,
                 activity: ExpertActivity, accelerator_bytes: int) -> ExpertHomes:
    """Each layer's experts all resident or all on the host, resident for the layers that
    save the most time per byte while ``accelerator_bytes`` hold them (``_whole_layers``,
    priced by ``ExpertCosts``): where CP-SAT's expert placement starts."""
    costs = ExpertCosts.price(spec, profile, workload, activity)
    X = spec.moe.routed
    homes = _whole_layers(costs, spec.expert_layers, X, accelerator_bytes)
    return ExpertHomes(tuple((homes[l],) * X if l in homes else ()
                             for l in range(spec.n_layers)))


def _whole_layers(costs: ExpertCosts, layers: tuple[int, ...], experts: int,
                  accelerator_bytes: int) -> dict[int, str]:
    """CP-SAT's starting point: for each of ``layers`` (those with experts) one home for all
    its experts, resident for the layers that save the most time per byte over the host
    while the accelerator holds them, the host's otherwise (``--n-cpu-moe``'s kind of
    placement, priced by ``costs``)."""
    whole = {h: costs.seconds[h].sum(axis=1) + costs.fixed[h] for h in (RESIDENT, HOST)}
    saved = whole[HOST] - whole[RESIDENT]
    homes, room = dict.fromkeys(layers, HOST), accelerator_bytes
    for l in sorted(layers, key=lambda l: -saved[l]):
        if saved[l] > 0 and experts * costs.nbytes <= room:
            homes[l], room = RESIDENT, room - experts * costs.nbytes
    return homes


def hot_experts(spec: ModelSpec, activity: ExpertActivity, accelerator_bytes: int,
                per_layer: bool = False) -> ExpertHomes:
    """The hottest experts resident within ``accelerator_bytes``, the rest on the host:
    over all (layer, expert) pairs (kTransformers' rule), or, ``per_layer``, the same count
    of each layer's hottest (Fiddler's)."""
    layers = spec.expert_layers  # a dense first layer has none
    share = np.asarray(activity.shares)[list(layers)]
    L, X = share.shape
    fit = accelerator_bytes // routed_expert_bytes(spec)
    resident = np.zeros((L, X), bool)
    if per_layer:
        n = min(X, fit // L)
        for l in range(L):
            resident[l, np.argsort(-share[l], kind="stable")[:n]] = True
    else:
        order = np.argsort(-share.reshape(-1), kind="stable")[:min(fit, L * X)]
        resident.reshape(-1)[order] = True
    rows = dict(zip(layers, resident))
    return ExpertHomes(tuple(tuple(RESIDENT if r else HOST for r in rows[l]) if l in rows
                             else () for l in range(spec.n_layers)))


def expert_budget(spec: ModelSpec, devices: Devices, workload: Workload,
                  margin: float = 0.0) -> tuple[int, int | None]:
    """(accelerator, host) bytes left for routed experts once everything else is placed:
    ``expert_plan`` with every expert on the host, estimated (``hx.memory.estimate``,
    proxy-sized), less ``margin`` of what the accelerator has left; without an accelerator
    budget, every expert's bytes; host None: unbounded.

    Raises:
      HxError: even with every expert on the host the plan does not fit the accelerator.
    """
    from hx.memory import PROXY, estimate

    layers = set(spec.expert_layers)
    base = expert_plan(spec, ExpertHomes(tuple((HOST,) * spec.moe.routed if l in layers else ()
                                               for l in range(spec.n_layers))),
                       "experts on the host")
    need = estimate(base.with_prefill_chunk(min(workload.prompt_tokens, 512)), spec, workload,
                    sizing=PROXY)
    capacity, each = devices.accelerator.capacity, routed_expert_bytes(spec)
    experts = len(layers) * spec.moe.routed * each  # what ``base`` holds on the host
    host = None if devices.host.capacity is None else devices.host.capacity - (
        need.host - experts)
    if capacity is None:
        return experts, host
    left = capacity - need.accelerator
    if left < 0:
        raise HxError(f"{spec.name} does not fit the accelerator with every routed expert on "
                      f"the host: it needs {need.accelerator} bytes ({need.breakdown()})")
    return int(left * (1 - margin)), host
