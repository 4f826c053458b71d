"""FlexGen's setting, simulated: OPT-30B and OPT-175B on the T4 preset (16 GB GPU, 208 GB host,
NVMe), prompt 512, generation 32, each under FlexGen's published policy and under hx's CP-SAT
plan with the same memory and block.

Usage: python scripts/flexgen_setting.py [--json OUT.json] [--time-limit 5]

Takes 1.5-2.5 minutes on the 2-core development VM (1 min 26 s idle, 2 min 19 s beside other
work): two settings, each planned under FlexGen's policy and by CP-SAT and simulated. Prints
only the table (a spinner on a terminal's stderr meanwhile); ``--json`` writes the rows.

FlexGen's policies (Sheng et al. 2023 §6.1, FMInference/FlexiGen benchmark/flexgen/
bench_suite.py), each weight tensor homed as FlexGen's ``init_weight_list`` homes it
(``flexgen_homes``: per sub-layer -- attention, MLP, ``--sep-layer`` being FlexGen's default --
by the midpoint of the tensor's cumulative bytes, disk first, then CPU, then GPU):

* OPT-30B: ``--percent 20 80 0 100 0 100 --cpu`` -- of each attention sub-layer the last 20 %
  on the GPU (OUT resident; Q, K, V from CPU memory), the MLP from CPU memory (fc1 and fc2
  both below 80 %); KV cache and activations on the CPU, attention on the CPU, GPU batch
  48 x 3 micro-batches. Published: 7.32 tokens/s.
* OPT-175B: ``--percent 0 50 0 0 0 100 --cpu --pin-weight 0`` -- Q, K and MLP1 (fc1) on disk,
  V, OUT and MLP2 in CPU memory (exactly half of each layer's bytes on disk); the KV cache on
  disk (256 sequences of 544 tokens hold ~650 GB of KV, past the host's 208 GB), activations
  on the CPU, attention on the CPU, 32 x 8. Published: 0.69 tokens/s.

Both sides run in float16 and are priced by the same simulator and profile, so the comparison
is between placements; the published figures are FlexGen's own measurements on a real T4
(README table; docs/hardware-sources.md, "FlexGen's T4 setting (issue 26)").
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from hx.cli.console import print_table
from hx.devices import HOST, discover
from hx.errors import HxError
from hx.memory import PROXY, check_fits
from hx.models.spec import preset
from hx.plan import DISK, RESIDENT, STREAMED, WEIGHTED_OPS
from hx.planner.grid import Scenario, plan_on, simulate_run
from hx.planner.hardware import hardware_profile, memory_sizing
from hx.planner.patterns import Pattern, layer_plan
from hx.planner.policies import fit_prefill_chunk
from hx.workload import MIN_CHUNK

# (model, FlexGen's policy: weights % on GPU, % on CPU, KV home; block; published tokens/s)
SETTINGS = (("opt-30b", ("flexgen:20:80", 20, 80, HOST), Scenario("48x3", 48, 512, 32, 3), 7.32),
            ("opt-175b", ("flexgen:0:50:kv-disk", 0, 50, DISK), Scenario("32x8", 32, 512, 32, 8),
             0.69))
# FlexGen's sub-layers (``--sep-layer``, its default): SelfAttention and MLP, each split on its own
SUBLAYERS = (("Q", "K", "V", "OUT"), ("MLP1", "MLP2"))


def flexgen_homes(spec, gpu_percent: float, cpu_percent: float) -> tuple[str, ...]:
    """Each weighted op's home (``WEIGHTED_OPS`` order) as FlexGen's ``init_weight_list``
    (flexgen/flex_opt.py) homes its weight tensors: within each sub-layer, a tensor goes to
    disk, CPU or GPU by where the midpoint of its cumulative size falls among the cumulative
    percentages in the order disk, CPU, GPU (``get_choice``). An op here is one tensor
    (its bias and norms ride with it)."""
    disk = 100 - gpu_percent - cpu_percent
    home = {}
    for ops in SUBLAYERS:
        sizes = [spec.op_weight_bytes(op) for op in ops]
        done = 0
        for op, size in zip(ops, sizes):
            middle = 100 * (done + size / 2) / sum(sizes)
            home[op] = DISK if middle < disk else STREAMED if middle < disk + cpu_percent \
                else RESIDENT
            done += size
    return tuple(home[op] for op in WEIGHTED_OPS)


def flexgen_plan(spec, policy, profile, workload):
    """FlexGen's placement (``flexgen_homes``) for every layer, the KV cache at ``policy``'s
    home with attention beside it, HEAD streamed (FlexGen's output embedding follows the same
    split), EMBED on the host; with the largest prefill chunk that fits the T4's budgets.

    Raises:
      HxError: it does not fit.
    """
    name, gpu, cpu, kv = policy
    pattern = Pattern(kv, flexgen_homes(spec, gpu, cpu))
    plan = layer_plan(spec, [pattern] * spec.n_layers, RESIDENT if gpu == 100 else STREAMED,
                      name)
    devices = discover(accelerator_memory=profile.accelerator_memory,
                       host_memory=profile.host_memory)
    with memory_sizing("t4"):
        check_fits(plan.with_prefill_chunk(MIN_CHUNK), spec, devices, workload, sizing=PROXY)
        return fit_prefill_chunk(plan, spec, devices, workload)


def settings():
    """(spec in float16, policy, scenario, published tokens/s or None) of every row: each
    setting under FlexGen's policy, then under CP-SAT."""
    for model, flexgen, scenario, published in SETTINGS:
        spec = preset(model).replace(dtype="float16")
        yield spec, flexgen, scenario, published
        yield spec, "cpsat", scenario, None


def setting_row(spec, policy: str, scenario: Scenario, published: float | None, profile,
                time_limit: float, status) -> dict:
    """One row: the policy's plan on the T4 preset and its simulated run (or why none fits).
    ``policy``: FlexGen's (a ``SETTINGS`` tuple) or a ``policies.build`` name. ``status`` is
    told what is being planned."""
    name = policy[0] if isinstance(policy, tuple) else policy
    status(f"planning and simulating {spec.name} under {name}")
    row = {"model": spec.name, "policy": name, "block": scenario.name,
           "published_tok_s": published}
    try:
        if isinstance(policy, tuple):
            plan = flexgen_plan(spec, policy, profile, scenario.workload())
        else:
            plan, _ = plan_on(policy, spec, "t4", profile, profile.accelerator_memory,
                              scenario.workload(), time_limit)
        run = simulate_run(plan, spec, profile, scenario)
        row.update(tokens_per_s=run.tokens_per_s, ttft_s=run.ttft_s, tpot_s=run.tpot_s,
                   utilisation=run.utilisation, prefill_chunk=plan.prefill_chunk)
    except HxError as e:
        row["error"] = str(e).splitlines()[0]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per solve")
    args = parser.parse_args()
    profile = hardware_profile("t4")
    with Console(stderr=True).status("planning") as status:
        rows = [setting_row(spec, policy, scenario, published, profile, args.time_limit,
                            status.update)
                for spec, policy, scenario, published in settings()]
    table = Table(title=f"FlexGen's setting on {profile.name}, prompt 512, generation 32 "
                        "(simulated)")
    for col in ("model", "policy", "block", "tokens/s", "TPOT s", "host busy",
                "published tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["policy"], r["block"],
                      f"{r['tokens_per_s']:.2f}" if "tokens_per_s" in r else "no plan",
                      f"{r['tpot_s']:.1f}" if "tpot_s" in r else r.get("error", "")[:60],
                      f"{r['utilisation'].get('host', 0):.0%}" if "utilisation" in r else "",
                      str(r["published_tok_s"] or ""))
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
