"""Issue 40's D: hx's simulated Mixture-of-Experts plans beside the published figures of the
settings they come from (docs/hardware-sources.md §9: the machines, the runs, their sources).

Each setting is one workload on one machine preset (``planner.hardware``); every policy plans
it (CP-SAT placing each routed expert, llama.cpp's ``--cpu-moe`` and ``--n-cpu-moe`` at the
smallest N that fits, kTransformers' and Fiddler's hottest experts resident) and the simulator
prices the run (``planner.grid``: prefill, then the decode steps). Decode tokens/s is rows over
a decode step, prefill tokens/s the prompt's tokens over the prefill, end to end the grid's
(generated tokens over prefill plus decode). Times are the simulator's on datasheet presets,
not measurements.

    python scripts/moe_published.py [--expert-activity zipf:1.2] [--json out/moe_published.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from hx.planner.grid import Grid, GridRow, Scenario, run_grid

POLICIES = ("cpsat", "cpu-moe", "n-cpu-moe", "ktransformers", "fiddler")


@dataclass(frozen=True)
class Setting:
    """A published run: ``system`` on ``model`` (an hx preset in ``weights``, ``dtype``) on
    ``machine`` at ``scenario``; ``published`` its figures (tokens/s by name), ``measure``
    which of hx's rates each stands beside (``decode``, ``prefill``, ``end to end``)."""

    system: str
    model: str
    weights: str
    dtype: str
    machine: str
    scenario: Scenario
    published: dict[str, float]
    measure: dict[str, str]


SETTINGS = (
    # AlexsJones/llmfit #755: llama-server -ngl 99 --n-cpu-moe 36, short chat prompts, 300 tokens
    Setting("llama.cpp --n-cpu-moe 36", "qwen3-30b-a3b", "q4_0", "float16", "rtx2080-i9-10900x",
            Scenario("chat b1 64+300", 1, 64, 300), {"llama.cpp decode": 36.7},
            {"llama.cpp decode": "decode"}),
    # efeslab/fiddler README (v1): Mixtral-8x7B in 16 bits, [128 in, 512 out], end to end
    Setting("Fiddler", "mixtral-8x7b", "dense", "float16", "quadro-rtx6000-48c",
            Scenario("b1 128+512", 1, 128, 512),
            {"Fiddler": 4.2, "Mixtral-offloading": 0.3},
            {"Fiddler": "end to end", "Mixtral-offloading": "end to end"}),
    # MoE-Lightning Table 3 (S1: T4, MTBench, 128 new tokens; prompts 77 on average): FlexGen's
    # policy ran 139 micro-batches of 8 rows; MoE-Lightning's batch is not given
    Setting("MoE-Lightning", "mixtral-8x7b", "dense", "float16", "t4",
            Scenario("8x64 128+128", 64, 128, 128, micro_batches=8),
            {"MoE-Lightning": 97.7, "FlexGen": 9.5},
            {"MoE-Lightning": "end to end", "FlexGen": "end to end"}),
    # kvcache-ai/ktransformers doc/en/DeepseekR1_V3_tutorial.md, V0.2 table: DeepSeek-V3
    # Q4_K_M (about 4.8 bits a weight; hx's nearest block format is q4_0, 4.5), a 500-token
    # prompt, both sockets, 8 experts a token; the output length is not given (its commands
    # ask for up to 1,000 tokens)
    Setting("kTransformers v0.2", "deepseek-v3", "q4_0", "bfloat16", "rtx4090d-2x6454s",
            Scenario("b1 500+1000", 1, 500, 1000),
            {"kTransformers decode": 12.21, "kTransformers prefill": 82.94,
             "llama.cpp decode": 4.51, "llama.cpp prefill": 10.31},
            {"kTransformers decode": "decode", "kTransformers prefill": "prefill",
             "llama.cpp decode": "decode", "llama.cpp prefill": "prefill"}),
)


def rates(row: GridRow, scenario: Scenario) -> dict[str, float | None]:
    """A row's decode, prefill and end-to-end tokens/s (None where no plan fits)."""
    if row.tokens_per_s is None:
        return {"decode": None, "prefill": None, "end to end": None}
    rows = scenario.batch * scenario.micro_batches
    return {"decode": rows / row.tpot_s, "prefill": rows * scenario.prompt_tokens / row.ttft_s,
            "end to end": row.tokens_per_s}


def main() -> None:
    """Plan and simulate each setting under each policy; print the tables, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expert-activity", default="uniform",
                        help="uniform, zipf:S[:SEED] or a trace file (hx plan's option)")
    parser.add_argument("--time-limit", type=float, default=5.0,
                        help="CP-SAT's deterministic seconds per solve")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", help="run the settings whose system contains this text")
    args = parser.parse_args()
    out = []
    for s in SETTINGS:
        if args.only and args.only not in s.system:
            continue
        grid = Grid(models=(s.model,), hardware=(s.machine,), policies=POLICIES, budgets=(1.0,),
                    scenarios=(s.scenario,), dtype=s.dtype, weights=(s.weights,),
                    expert_activity=args.expert_activity)
        print(f"\n{s.system}: {s.model} {s.weights} on {s.machine}, {s.scenario.name}, "
              f"experts {args.expert_activity}; published: "
              + ", ".join(f"{k} {v} tokens/s ({s.measure[k]})" for k, v in s.published.items()))
        print(f"{'policy':14} {'plan':22} {'decode':>8} {'prefill':>8} {'end to end':>10}"
              + "".join(f" {'x ' + k:>20}" for k in s.published))
        for row in run_grid(grid, args.time_limit):
            r = rates(row, s.scenario)
            cells = (f"{r['decode']:8.2f} {r['prefill']:8.1f} {r['end to end']:10.2f}"
                     if r["decode"] else f"{'-':>8} {'-':>8} {'-':>10}")
            ratios = "".join(f" {r[s.measure[k]] / v:20.2f}" if r["decode"] else f" {'-':>20}"
                             for k, v in s.published.items())
            print(f"{row.policy:14} {str(row.plan or row.error)[:22]:22} {cells}{ratios}")
            out.append({"setting": asdict(s), "row": asdict(row), "rates": r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"expert_activity": args.expert_activity, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
