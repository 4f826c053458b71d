"""Layouts of a model over several GPUs: tensor parallelism within a group, pipeline stages
across groups, each GPU's part planned and priced as one accelerator (docs/architecture.md,
"Planner"; issue 28). The executor runs both (``hx.discover(accelerators=k)``,
``hx.pipeline``).

A layout is ``tp`` x ``pp`` GPUs: the layers cut into ``pp`` contiguous stages
(``plan.stage_layers``, as even as the count allows), each stage on a group of ``tp`` GPUs that
split its ops (``ModelSpec.shard``, ``mesh.tensor_parallel``). A stage is planned by a policy
(CP-SAT, FlexGen's LP, ...) as a model of its own layers (``ModelSpec.pipeline_stage``, as the
executor runs it: ``hx.pipeline``) on one GPU's memory and a share of the host, and priced by
the simulator (``simulator.predict_run``); activations cross to the
next stage over the interconnect (latency + bytes / bandwidth, a point-to-point copy).

A run's time (``price``):
  prefill = Σ_s prefill_s + (pp - 1) crossings (one micro-batch: the stages in turn);
  decode step = max_s t_s + Σ_{s ≠ max} t_s / N + (pp - 1) crossings, t_s a stage's step of
  the block of N micro-batches: with N micro-batches in flight each stage waits for the one
  before it only for its first micro-batch (GPipe, Huang et al. 2019: bubble (pp - 1) / (N +
  pp - 1) at equal stages); with N = 1 the stages run in turn (Σ_s t_s).
When stages run at once (N > 1) they share the host: each stage's view has the host's rates and
links / min(pp, N) (``mesh.host_share``); its host memory is the host's / pp either way.

A stage's spec holds EMBED's table only in the first stage and HEAD's only in the last (a tied
table in both); elsewhere EMBED and HEAD pass the residual stream through, at no cost but
their launches, and a stage's output is x (B, T, D), the bytes that cross.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hx.errors import HxError
from hx.memory import MemoryEstimate
from hx.models.spec import ModelSpec
from hx.models.tensors import activation_bytes
from hx.plan import ExecutionPlan, stage_cuts
from hx.planner.hardware import hardware_profile, machine, memory_sizing
from hx.planner.mesh import Interconnect, host_share, tensor_parallel
from hx.planner.policies import plan_on
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import RunPrediction, predict_run
from hx.workload import Workload


@dataclass(frozen=True)
class Layout:
    """``tp``-way tensor parallelism within each of ``pp`` pipeline stages; ``policy`` plans
    each stage (a name of ``policies.POLICIES``)."""

    tp: int = 1
    pp: int = 1
    policy: str = "cpsat"

    @property
    def gpus(self) -> int:
        """GPUs the layout takes."""
        return self.tp * self.pp

    @property
    def name(self) -> str:
        """e.g. ``tp2xpp2 cpsat``."""
        return f"tp{self.tp}xpp{self.pp} {self.policy}"


def split_hardware(name: str) -> tuple[str, int, int]:
    """``"4xa10g:tp2xpp2"`` -> (``"4xa10g"``, tp 2, pp 2): a grid's hardware entry, a machine
    and optionally its layout (``tpA``, ``ppB``, ``tpAxppB``; none: one GPU).

    Raises:
      HxError: a layout not of that form.
    """
    machine_name, _, layout = name.partition(":")
    if not layout:
        return machine_name, 1, 1
    match = re.fullmatch(r"(?:tp(\d+))?x?(?:pp(\d+))?", layout.strip().lower())
    if match is None or not any(match.groups()):
        raise HxError(f"bad layout {layout!r} in {name!r}: write tpA, ppB or tpAxppB after the "
                      "machine, e.g. 4xa10g:tp2xpp2")
    tp, pp = (int(g or 1) for g in match.groups())
    return machine_name, tp, pp


@dataclass(frozen=True)
class Stage:
    """One stage of a priced layout: its layers, spec (one GPU's shard), plan, the plan's
    memory on one GPU and the host, and its run."""

    layers: range
    spec: ModelSpec
    plan: ExecutionPlan
    need: MemoryEstimate
    run: RunPrediction


@dataclass(frozen=True)
class LayoutRun:
    """A layout's predicted run (``price``): generated tokens over the run's seconds (as
    ``simulator.RunPrediction``), seconds of its prefill, decode step and whole run (prefill
    + decode steps), and its stages."""

    layout: Layout
    tokens_per_s: float
    ttft_s: float
    tpot_s: float
    total_s: float
    stages: tuple[Stage, ...]

    @property
    def slowest(self) -> Stage:
        """The stage with the longest decode step (the pipeline's pace)."""
        return max(self.stages, key=lambda stage: stage.run.tpot_s)


def crossing_seconds(spec: ModelSpec, link: Interconnect, rows: int, tokens: int) -> float:
    """Seconds of one stage's output activations (rows x tokens x D) crossing to the next."""
    return link.latency + activation_bytes(spec, "h", rows, tokens) / link.bandwidth


def stage_view(profile: HardwareProfile, pp: int, concurrent: int) -> HardwareProfile:
    """A stage's profile: host memory / ``pp``; host rates and links / ``concurrent``, the
    stages running at once."""
    view = host_share(profile, concurrent)
    return dataclasses.replace(view, host_memory=None if profile.host_memory is None
                               else profile.host_memory // pp)


def price(spec: ModelSpec, machine_name: str, layout: Layout, workload: Workload,
          time_limit_s: float = 2.0, link: Interconnect | None = None,
          budget: int | None = None) -> LayoutRun:
    """Plan each stage of ``layout`` on ``machine_name`` (a preset of ``hardware.MACHINES``,
    or a one-GPU preset for 1 x 1) with its policy and price the run (module docstring);
    ``link`` in place of the machine's interconnect (a what-if); ``budget``: bytes of each
    GPU's memory the plans may use (default all of it).

    Raises:
      HxError: more GPUs than the machine has, or a stage that no plan of the policy fits.
    """
    several = machine(machine_name)
    gpus = several.gpus if several else 1
    if layout.gpus > gpus:
        raise HxError(f"layout {layout.name} takes {layout.gpus} GPUs; {machine_name!r} has "
                      f"{gpus}")
    link = link or (several.interconnect if several else None)
    group = tensor_parallel(hardware_profile(machine_name), layout.tp, link)
    shard = spec.shard(layout.tp)
    concurrent = min(layout.pp, workload.micro_batches)
    view = stage_view(group, layout.pp, concurrent)
    parts = []
    with memory_sizing(machine_name):
        for layers, first, last in stage_cuts(spec.n_layers, layout.pp):
            part = shard.pipeline_stage(layers, first, last)
            plan, need = plan_on(layout.policy, part, machine_name, view,
                                 budget or view.accelerator_memory, workload, time_limit_s)
            parts.append(Stage(layers, part, plan, need, predict_run(plan, part, view, workload)))
    hops = layout.pp - 1
    cross_prefill = hops * (crossing_seconds(spec, link, workload.prefill_rows,
                                             workload.prompt_tokens) if hops else 0.0)
    cross_decode = hops * (crossing_seconds(spec, link, workload.batch, 1) if hops else 0.0)
    steps = [p.run.tpot_s for p in parts]
    longest = max(steps)
    tpot = longest + (sum(steps) - longest) / workload.micro_batches + cross_decode
    ttft = sum(p.run.ttft_s for p in parts) + cross_prefill
    total = ttft + workload.decode_steps * tpot
    rows = workload.batch * workload.micro_batches
    return LayoutRun(layout, rows * workload.generated / total, ttft, tpot, total,
                     tuple(parts))


def layouts(gpus: int, policy: str = "cpsat") -> list[Layout]:
    """Every tp x pp layout of exactly ``gpus`` GPUs."""
    return [Layout(tp, gpus // tp, policy) for tp in range(1, gpus + 1) if gpus % tp == 0]


def best_layout(spec: ModelSpec, machine_name: str, gpus: int, workload: Workload,
                time_limit_s: float = 2.0) -> LayoutRun:
    """CP-SAT's layout on ``gpus`` GPUs: each tp x pp of them with CP-SAT planning every
    stage, the shortest predicted run kept (layouts no plan fits are skipped).

    Raises:
      HxError: no layout fits.
    """
    runs, why = [], []
    for layout in layouts(gpus):
        try:
            runs.append(price(spec, machine_name, layout, workload, time_limit_s))
        except HxError as e:
            why.append(f"{layout.name}: {e}")
    if not runs:
        raise HxError(f"no layout of {gpus} GPUs fits: " + "; ".join(why))
    return min(runs, key=lambda r: r.total_s)

