"""Plans used by several tests, beyond the policies of ``hx.planner.policies``."""

from __future__ import annotations

from hx.devices import ACCELERATOR, HOST
from hx.models.spec import LAYER_OPS
from hx.plan import ExecutionPlan, Placement
from hx.planner import policies


def kv_host_odd(n_layers: int) -> ExecutionPlan:
    """Everything on the accelerator but the KV caches (and so SCORE) of odd layers."""
    layers = tuple(tuple(HOST if op == "SCORE" and i % 2 else ACCELERATOR for op in LAYER_OPS)
                   for i in range(n_layers))
    return ExecutionPlan.from_placement(Placement(ACCELERATOR, layers, ACCELERATOR),
                                        name="kv-host-odd")


def alternating(n_layers: int) -> ExecutionPlan:
    """Decode: op devices alternate within each layer (even layers start on the accelerator,
    odd ones on the host), EMBED on the host, HEAD on the accelerator. Prefill runs every op
    but SCORE on the accelerator, so decode's host weights are staged in during prefill."""
    decode = tuple(tuple(ACCELERATOR if (i + j) % 2 == 0 else HOST
                         for j, _ in enumerate(LAYER_OPS)) for i in range(n_layers))
    score = LAYER_OPS.index("SCORE")
    prefill = tuple(tuple(row[score] if op == "SCORE" else ACCELERATOR for op in LAYER_OPS)
                    for row in decode)
    return ExecutionPlan.from_placement(Placement(ACCELERATOR, prefill, ACCELERATOR),
                                        Placement(HOST, decode, ACCELERATOR),
                                        name="alternating")


def acceptance_plans(n_layers: int, splits: tuple[int, ...]) -> dict[str, ExecutionPlan]:
    """The plans the executor must run exactly: policies, KV on host for odd layers, and
    alternating op devices."""
    plans = [policies.all_accelerator(n_layers), policies.all_host(n_layers),
             policies.stream_all(n_layers)]
    plans += [policies.layer_split(n_layers, n) for n in splits]
    plans += [kv_host_odd(n_layers), alternating(n_layers),
              ExecutionPlan.uniform(n_layers, ("SCORE", "MLP1"))]
    return {p.name: p for p in plans}
