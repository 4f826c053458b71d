"""FlexGen's setting, simulated: OPT-30B and OPT-175B on the T4 preset (16 GB GPU, 208 GB host,
NVMe), prompt 512, generation 32, each under FlexGen's published policy and under hx's CP-SAT
plan with the same memory and block; FlexGen's compressed rows with why they are not priced.

Usage: python scripts/flexgen_setting.py [--json OUT.json] [--time-limit 5]

Takes 1.5-3.5 minutes on the 2-core development VM (3 min 36 s beside other work, 2026-11-24):
two settings, each planned under FlexGen's policy and by CP-SAT and simulated (CP-SAT is most of
it). Prints only the table (a spinner on a terminal's stderr
meanwhile); ``--json`` writes the rows.

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

FlexGen's rows are run as FlexGen's benchmark ran them (flexgen/flex_opt.py, ``--debug
fewer_batch``, which every bench_suite case of these rows passes):

* prefill takes each GPU batch's whole 512-token prompt in one pass (``load_hidden`` at i = 0),
  so the plan's prefill chunk is the prompt, not the largest chunk hx's own executor fits;
* decode is timed on the first decode token only (``generation_loop_debug_multi_batch``:
  sub-layers 10-19 of token 1, context 513: 512 cached slots read, exactly, plus the new one),
  so the step is priced at 512 cached slots (``FlexGenWorkload``), not mid-generation;
* that mean sub-layer time is multiplied by all 2L + 2 of FlexGen's layers (the input and
  output embeddings counted as average sub-layers), so its decode time is (L + 1) / L of the
  step's (``flexgen_tokens_per_s``).

FlexGen's compressed rows (4-bit group-wise weights and/or KV cache, group 64) are listed with
their published figures and why hx cannot price them yet (``COMPRESSED``).

Both sides run in float16 and are priced by the same simulator and profile, so the comparison
is between placements; the published figures are FlexGen's own measurements on a real T4
(README table; docs/hardware-sources.md, "FlexGen's T4 setting (issue 26)").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

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
from hx.planner.simulator import RunPrediction, predict_run
from hx.workload import MIN_CHUNK, Workload

# (model, FlexGen's policy: weights % on GPU, % on CPU, KV home; block; published tokens/s)
SETTINGS = (("opt-30b", ("flexgen:20:80", 20, 80, HOST), Scenario("48x3", 48, 512, 32, 3), 7.32),
            ("opt-175b", ("flexgen:0:50:kv-disk", 0, 50, DISK), Scenario("32x8", 32, 512, 32, 8),
             0.69))
# FlexGen's sub-layers (``--sep-layer``, its default): SelfAttention and MLP, each split on its own
SUBLAYERS = (("Q", "K", "V", "OUT"), ("MLP1", "MLP2"))
# FlexGen's compressed rows (bench_suite.py ``*_1x1_comp``, seq_len 512; README table): model,
# policy, block, published tokens/s, and what hx lacks to price them
COMPRESSED = (
    ("opt-30b", "flexgen-c:0:100 (KV 4-bit)", "64x8", 8.38,
     "KV cache 4-bit on the CPU, streamed to the GPU and attended there (no --cpu): hx has "
     "no compressed KV cache and no KV streamed to the accelerator"),
    ("opt-175b", "flexgen-c:0:100 (w+KV 4-bit)", "48x3", 1.12,
     "weights int4 on the CPU (hx can), KV cache 4-bit on the CPU streamed to the GPU and "
     "attended there: hx has no compressed KV cache and no KV streamed to the accelerator"),
)


@dataclass(frozen=True)
class FlexGenWorkload(Workload):
    """The workload as FlexGen's benchmark times it: the decode step at the first decode
    token, whose attention reads the prompt's cached slots (``--debug fewer_batch`` times
    sub-layers of token 1 only and takes that for every token)."""

    @property
    def decode_context(self) -> int:
        return self.prompt_tokens


def flexgen_workload(scenario: Scenario) -> FlexGenWorkload:
    """``scenario``'s workload with FlexGen's timed decode context."""
    w = scenario.workload()
    return FlexGenWorkload(w.batch, w.prompt_tokens, w.cache_slots, w.micro_batches,
                           w.spare_rows, w.new_tokens)


def flexgen_tokens_per_s(run: RunPrediction, workload: Workload, n_layers: int) -> float:
    """Generation throughput as FlexGen's ``--debug fewer_batch`` counts it: generated tokens
    over prefill plus G - 1 decode steps, each step taken as 2L + 2 times the mean sub-layer
    time (its input and output embeddings counted as average sub-layers), i.e. (L + 1) / L of
    the simulated step."""
    decode = workload.decode_steps * run.tpot_s * (n_layers + 1) / n_layers
    rows = workload.batch * workload.micro_batches
    return rows * workload.generated / (run.ttft_s + decode)


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
    split), EMBED on the host; prefill in one chunk of the whole prompt, as FlexGen's (the
    placement is checked against the T4's budgets at hx's smallest chunk: hx's executor
    would need smaller chunks than FlexGen's, whose run did fit).

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
    return plan.with_prefill_chunk(None)


def settings():
    """(spec in float16, policy, scenario, published tokens/s or None) of every priced row:
    each setting under FlexGen's policy, then under CP-SAT."""
    for model, flexgen, scenario, published in SETTINGS:
        spec = preset(model).replace(dtype="float16")
        yield spec, flexgen, scenario, published
        yield spec, "cpsat", scenario, None


def setting_row(spec, policy: str, scenario: Scenario, published: float | None, profile,
                time_limit: float, status) -> dict:
    """One row: the policy's plan on the T4 preset and its simulated run (or why none fits).
    ``policy``: FlexGen's (a ``SETTINGS`` tuple), run and counted as FlexGen's benchmark runs
    and counts it (``FlexGenWorkload``, ``flexgen_tokens_per_s``), or a ``policies.build``
    name, run as hx runs it (mid-generation decode context). ``status`` is told what is being
    planned."""
    name = policy[0] if isinstance(policy, tuple) else policy
    status(f"planning and simulating {spec.name} under {name}")
    row = {"model": spec.name, "policy": name, "block": scenario.name,
           "published_tok_s": published}
    try:
        if isinstance(policy, tuple):
            workload = flexgen_workload(scenario)
            plan = flexgen_plan(spec, policy, profile, workload)
            run = predict_run(plan, spec, profile, workload)
            tokens_per_s = flexgen_tokens_per_s(run, workload, spec.n_layers)
        else:
            plan, _ = plan_on(policy, spec, "t4", profile, profile.accelerator_memory,
                              scenario.workload(), time_limit)
            run = simulate_run(plan, spec, profile, scenario)
            tokens_per_s = run.tokens_per_s
        row.update(tokens_per_s=tokens_per_s, ttft_s=run.ttft_s, tpot_s=run.tpot_s,
                   utilisation=run.utilisation, prefill_chunk=plan.prefill_chunk)
    except HxError as e:
        row["error"] = str(e).splitlines()[0]
    return row


def compressed_rows() -> list[dict]:
    """FlexGen's compressed rows: published figures, no simulated ones (``COMPRESSED``)."""
    return [{"model": preset(model).name, "policy": policy, "block": block,
             "published_tok_s": published, "error": f"not priced: {why}"}
            for model, policy, block, published, why in COMPRESSED]


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
    rows += compressed_rows()
    table = Table(title=f"FlexGen's setting on {profile.name}, prompt 512, generation 32 "
                        "(simulated)",
                  caption="flexgen rows: run and counted as FlexGen's benchmark (--debug "
                          "fewer_batch); cpsat rows: hx's own plan, run and counted as hx's")
    for col in ("model", "policy", "block", "tokens/s", "TTFT s", "TPOT s", "host busy",
                "published tokens/s", "vs published"):
        table.add_column(col, justify="right")
    notes = []
    for r in rows:
        published, simulated = r["published_tok_s"], r.get("tokens_per_s")
        error = f"{simulated / published - 1:+.0%}" if simulated and published else ""
        if "error" in r:
            notes.append(f"[{len(notes) + 1}] {r['model']} {r['policy']}: {r['error']}")
        table.add_row(r["model"], r["policy"], r["block"],
                      f"{simulated:.2f}" if simulated else f"- [{len(notes)}]",
                      f"{r['ttft_s']:.0f}" if "ttft_s" in r else "",
                      f"{r['tpot_s']:.1f}" if "tpot_s" in r else "",
                      f"{r['utilisation'].get('host', 0):.0%}" if "utilisation" in r else "",
                      str(published or ""), error)
    print_table(table)
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
