"""Figures of an ablation grid (matplotlib, Agg backend: files only, no display).

* ``throughput_vs_memory``: simulated tokens/s against the accelerator budget, one line per
  policy, for one (model, hardware, workload) of a budget sweep.
* ``decode_gantt``: one simulated decode step per policy, a lane per resource (accelerator,
  host, H2D, D2H, sync), each task a bar -- the simulated counterpart of ``hx generate
  --trace``'s timeline.
"""

from __future__ import annotations

from typing import Sequence

from hx.planner.grid import GridRow
from hx.planner.simulator import Prediction

LANES = ("accelerator", "host", "H2D", "D2H", "sync")
COLOURS = {"accelerator": "tab:green", "host": "tab:blue", "H2D": "tab:orange",
           "D2H": "tab:red", "sync": "tab:gray"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_vs_memory(rows: Sequence[GridRow], path: str, title: str) -> None:
    """Tokens/s (log scale) against budget GiB per policy; policies with no feasible plan at a
    budget have no point there."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy in dict.fromkeys(r.policy for r in rows):
        points = sorted((r.budget_bytes / 2**30, r.tokens_per_s) for r in rows
                        if r.policy == policy and r.tokens_per_s)
        if points:
            ax.plot(*zip(*points), marker="o", label=policy)
    ax.set_xlabel("accelerator memory budget (GiB)")
    ax.set_ylabel("generation throughput (tokens/s, simulated)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode_gantt(steps: dict[str, Prediction], path: str, title: str) -> None:
    """One row of lanes per policy; bars are the decode step's simulated tasks (ms)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(steps), 1, figsize=(8, 1.2 + 1.1 * len(steps)), squeeze=False)
    for ax, (policy, step) in zip(axes[:, 0], steps.items()):
        for lane, resource in enumerate(LANES):
            bars = [(t.start * 1e3, (t.end - t.start) * 1e3) for t in step.tasks
                    if t.resource == resource and t.end > t.start]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=COLOURS[resource])
        ax.set_yticks(range(len(LANES)), LANES, fontsize=7)
        ax.set_xlim(0, step.seconds * 1e3 * 1.02)
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{policy}: {step.seconds * 1e3:.1f} ms", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms into the decode step (simulated)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
