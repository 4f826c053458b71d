"""Where a run's routed tokens were computed: the (token, expert) pairs of a Mixture of Experts
counted by the device and home of the expert each went to (issue 40's "routed tokens per
device"; ``hx generate`` reports them).

A layer whose routed experts all live in one place -- MLP2 whole on a device (its weights
resident, streamed or on the host), or every expert of the layer at one ``ExpertHomes`` home --
computes all of a step's rows x k pairs there, whatever the routing. A layer whose experts are
split reads its routing back: the executor keeps the routing weights that cross the devices
(the router's ``a`` a segment of that layer reads, or a streamed part's ``route``) and counts
the nonzero weights in each home's columns once the step is done. The pairs are those the
devices computed: a prefill chunk's padding rows (``workload.PREFILL_BUCKET``) route too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

import numpy as np

from hx.errors import HxError
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan, home_device


def split_layers(plan: ExecutionPlan) -> frozenset[int]:
    """The layers whose routed experts live at more than one home (``ExpertHomes``)."""
    return frozenset(layer for layer, homes in enumerate(plan.experts.layers)
                     if len(set(homes)) > 1)


class RoutedPairs:
    """A run's routed (token, expert) pairs by (device, home) of the expert: ``counts``.

    Args:
      spec: the model (``ModelSpec.expert_layers``: a dense first layer routes nothing).
      plan: where its experts live.
    """

    def __init__(self, spec: ModelSpec, plan: ExecutionPlan):
        self.spec, self.plan = spec, plan
        self.layers = spec.expert_layers  # kept: every step asks
        self.split = split_layers(plan)
        self.counts: Counter[tuple[str, str]] = Counter()

    def _whole(self, phase: str, layer: int) -> tuple[str, str]:
        """(device, home) of every expert of an unsplit layer in ``phase``."""
        homes = self.plan.experts.layers[layer] if self.plan.experts.of(layer) else ()
        if homes:
            return home_device(homes[0]), homes[0]
        return (self.plan.phase(phase).get(layer, "MLP2"),
                self.plan.weight_home(layer, "MLP2"))

    def add_step(self, phase: str, rows: int, routing: Mapping[int, Any]) -> None:
        """One micro-batch's step of ``rows`` rows (B x T): each unsplit layer's rows x k pairs
        where its experts live; each split layer's counted from its routing weights
        ``routing[layer]`` ((..., D + X) router output or (..., X) weights, any device).

        Raises:
          HxError: a split layer's routing was not kept (an executor that lost it).
        """
        k = self.spec.moe.top_k
        for layer in self.layers:
            if layer not in self.split:
                self.counts[self._whole(phase, layer)] += rows * k
                continue
            if layer not in routing:
                raise HxError(f"layer {layer}'s routing weights were not kept to count its "
                              "routed tokens")
            weights = np.asarray(routing[layer])[..., -self.spec.moe.routed:]
            chosen = (weights.reshape(-1, weights.shape[-1]) != 0).sum(axis=0)
            for home, n in zip(self.plan.experts.layers[layer], chosen):
                self.counts[(home_device(home), home)] += int(n)

    def add_loop(self, phase: str, rows: int, steps: int) -> None:
        """``steps`` steps of ``rows`` rows run as one launch on one device (no split
        layer: each layer's rows x k a step)."""
        self.add_step(phase, rows * steps, {})

    def summary(self) -> str:
        """One line: the pairs on each device, by home, and their total."""
        parts = []
        for device in sorted({d for d, _ in self.counts}):
            homes = {h: n for (d, h), n in sorted(self.counts.items()) if d == device}
            parts.append(f"{device} {sum(homes.values())} ("
                         + ", ".join(f"{h} {n}" for h, n in homes.items()) + ")")
        return "; ".join(parts) + f" of {sum(self.counts.values())}"
