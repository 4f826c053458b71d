"""Bytes an MoE run moves and holds, on a GGUF of Qwen3-30B-A3B's shapes (issue 40, B).

  python scripts/moe_bytes.py --gguf q3moe_8l_q4_0.gguf [--json out.json]

Two plans on the emulated accelerator, one prompt, a few greedy tokens:

* ``cpu-moe`` (every routed expert on the host): the accelerator's weights hold no expert byte
  (its resident bytes equal ``n-cpu-moe:0``'s less every layer's experts), and the run's
  accelerator peak equals the exact estimate;
* ``resident-experts:0:streamed`` (every routed expert streamed, copied as routed): each decode
  step of one row copies, per layer, exactly the k experts its token routes to (a token's k
  are distinct), k experts' held bytes and ids -- read off the timeline's ``experts``
  copies -- and nothing else of the experts.

Prints a table and writes JSON. The times are an emulated accelerator's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json

import hx
from hx.devices import discover
from hx.generate import Engine
from hx.memory import EXACT, estimate
from hx.models.ops import EXPERTS_STREAMED
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.timeline import H2D, Timeline
from hx.workload import Workload

NEW_TOKENS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    devices = discover()  # before any JAX computation: it makes the emulated accelerator
    model = hx.load(args.gguf, dtype="float32")
    spec = model.spec
    prompt = [model.tokenizer.encode("The experts of a layer")]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_ids=())
    work = Workload.for_prompts(1, len(prompt[0]), NEW_TOKENS, spec)
    experts = spec.op_weight_bytes("MLP2")
    rows = []

    plan = policies.cpu_moe(spec)
    engine = Engine(model, plan, devices)
    need = estimate(plan.with_prefill_chunk(engine.plan.prefill_chunk), spec, work,
                    engine.executor.programs, EXACT)
    engine.generate_ids(prompt, params)
    kept = estimate(policies.cpu_moe(spec, 0), spec, work).weights - need.weights
    rows.append({"plan": plan.name, "accelerator_weights": need.weights,
                 "experts_bytes_left": kept, "experts_bytes": spec.n_layers * experts,
                 "peak": engine.accountant.peak, "estimate": need.accelerator})
    print(f"{plan.name}: accelerator weights {need.weights} B, {kept} B fewer than with the "
          f"experts resident (the experts: {spec.n_layers * experts} B); peak "
          f"{engine.accountant.peak} B, exact estimate {need.accelerator} B")
    engine.executor.release_cache()
    del engine

    plan = policies.resident_experts(spec, 0, "streamed")
    timeline = Timeline()
    engine = Engine(model, plan, devices, timeline=timeline)
    engine.generate_ids(prompt, params)
    timeline.wait()
    one = spec.expert_part(EXPERTS_STREAMED, 1).op_weight_bytes(EXPERTS_STREAMED)
    for step, events in enumerate(timeline.steps("decode")):
        copies = [e.args for e in events if e.resource == H2D and e.name.startswith("experts")]
        other = sum(e.args.get("bytes", 0) for e in events
                    if e.resource == H2D and e.name.startswith("weights"))
        counts = [len(c["experts"]) for c in copies]
        copied = sum(c["bytes"] for c in copies)
        rows.append({"plan": plan.name, "decode_step": step, "layers": len(copies),
                     "experts_per_layer": counts, "bytes": copied,
                     "k_experts_bytes": spec.n_layers * spec.moe.top_k * one,
                     "whole_weights_copied": other})
        print(f"{plan.name} decode step {step}: {len(copies)} layers copied "
              f"{counts} experts, {copied} B (k experts a layer: "
              f"{spec.n_layers * spec.moe.top_k * one} B); whole weights copied {other} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gguf": args.gguf, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
