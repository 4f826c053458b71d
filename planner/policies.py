"""Placement policies as plan builders (DESIGN §6): each returns an ``ExecutionPlan``.

These are the fixed baselines of the ablations; the CP-SAT planner arrives with the planner
issue. EMBED (a row lookup in a table as large as the LM head) always stays on the host, as in
llama.cpp; copying the whole table to the accelerator to gather B rows would never pay.
"""

from __future__ import annotations

from hx.devices import ACCELERATOR, HOST, Devices
from hx.errors import HxError
from hx.memory import check_fits
from hx.models.spec import EMBED, ModelSpec
from hx.plan import ExecutionPlan, Placement
from hx.workload import Workload


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
        n_layers, lambda op: HOST if op in ("SCORE", EMBED) else ACCELERATOR)
    return ExecutionPlan.from_placement(placement, name="stream-all", streamed=True)


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


def largest_layer_split(spec: ModelSpec, devices: Devices, workload: Workload
                        ) -> ExecutionPlan:
    """``layer_split`` with the largest N whose plan fits the budgets (N = 0 always fits the
    accelerator)."""
    for n in range(spec.n_layers + 1, -1, -1):
        plan = layer_split(spec.n_layers, n)
        try:
            check_fits(plan, spec, devices, workload)
            return plan
        except HxError:
            continue
    return layer_split(spec.n_layers, 0)


POLICIES = ("all-accelerator", "all-host", "stream-all", "layer-split", "auto")


def build(policy: str, spec: ModelSpec, devices: Devices, workload: Workload,
          gpu_layers: int | None = None) -> ExecutionPlan:
    """The plan of a named policy.

    ``layer-split`` uses ``gpu_layers``, or the largest N that fits when it is None. ``auto``
    is all-accelerator when that fits, else the largest fitting layer split.
    Raises:
      HxError: an unknown policy.
    """
    n = spec.n_layers
    if policy == "all-accelerator":
        return all_accelerator(n)
    if policy == "all-host":
        return all_host(n)
    if policy == "stream-all":
        return stream_all(n)
    if policy == "layer-split":
        if gpu_layers is None:
            return largest_layer_split(spec, devices, workload)
        return layer_split(n, gpu_layers)
    if policy == "auto":
        try:
            check_fits(all_accelerator(n), spec, devices, workload)
            return all_accelerator(n)
        except HxError:
            return largest_layer_split(spec, devices, workload)
    raise HxError(f"unknown policy {policy!r}; policies are {', '.join(POLICIES)}")
