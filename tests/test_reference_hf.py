"""SmolLM2-135M through hx vs Hugging Face transformers on the same GGUF (both float32, CPU).

For every acceptance plan (all-accelerator, all-host, stream-all, layer-split 10 and 20, KV on
the host for odd layers, alternating op devices, SCORE + MLP1 on the host): last-position logits
within 1e-4 relative and identical 32-token greedy continuations, while the accelerator budget
is set to exactly what the plan claims to need (the accountant raises if it is ever passed).
hx runs each prompt set as one left-padded batch; the reference runs each prompt alone.
"""

import numpy as np
import pytest
import torch

from hx.devices import discover
from hx.generate import Engine
from hx.memory import estimate
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.workload import Workload

from plans import acceptance_plans

LOGIT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Les élèves ont étudié la photosynthèse 🌱 et",
]
GREEDY_PROMPTS = LOGIT_PROMPTS[:3] + [
    "The three primary colors are",
    "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Water boils at a temperature of",
    "A haiku about autumn:\n",
]
PLANS = acceptance_plans(30, splits=(10, 20))


@pytest.fixture(scope="module")
def reference(hf_smollm, smollm):
    """HF last-position logits and 32-token greedy continuations (cut at EOS)."""
    tok = smollm.tokenizer
    logits = []
    with torch.no_grad():
        for p in LOGIT_PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            logits.append(hf_smollm(ids).logits[0, -1].numpy().astype(np.float64))
        greedy = []
        for p in GREEDY_PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            out = hf_smollm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                     do_sample=False, eos_token_id=tok.eos_id,
                                     pad_token_id=tok.eos_id)[0, ids.shape[1]:].tolist()
            greedy.append(out[:out.index(tok.eos_id)] if tok.eos_id in out else out)
    return logits, greedy


def claimed_budget(plan, smollm):
    """The largest accelerator estimate of the two jobs the test runs with ``plan``."""
    tok = smollm.tokenizer
    longest = max(len(tok.encode(p)) for p in LOGIT_PROMPTS)
    logits_job = Workload.for_prompts(len(LOGIT_PROMPTS), longest, 0, smollm.spec)
    logits_job = Workload(logits_job.batch, logits_job.prompt_tokens, logits_job.prompt_tokens)
    longest = max(len(tok.encode(p)) for p in GREEDY_PROMPTS)
    greedy_job = Workload.for_prompts(len(GREEDY_PROMPTS), longest, 32, smollm.spec)
    return max(estimate(plan, smollm.spec, job).accelerator for job in (logits_job, greedy_job))


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_matches_hugging_face(smollm, reference, plan_name):
    ref_logits, ref_greedy = reference
    plan = PLANS[plan_name]
    budget = claimed_budget(plan, smollm)
    engine = Engine(smollm, plan, discover(accelerator_memory=budget))
    tok = smollm.tokenizer

    got = engine.last_logits([tok.encode(p) for p in LOGIT_PROMPTS])
    for row, ref in zip(got, ref_logits):
        assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4

    completions = engine.generate(GREEDY_PROMPTS, SamplingParams(max_new_tokens=32))
    for c, ref in zip(completions, ref_greedy):
        assert c.token_ids == ref
    assert sum(len(r) for r in ref_greedy) > 8 * 16  # the comparison covers real text
    assert 0 < engine.accountant.peak <= budget or plan_name == "all-host"


@pytest.mark.parametrize("policy", ["stream-all", "auto"])
def test_quarter_of_the_weights_budget(smollm, reference, policy):
    """With 25 % of the weight bytes as accelerator budget, generation runs and matches."""
    budget = smollm.spec.weight_bytes // 4
    devices = discover(accelerator_memory=budget)
    tok = smollm.tokenizer
    longest = max(len(tok.encode(p)) for p in GREEDY_PROMPTS)
    job = Workload.for_prompts(len(GREEDY_PROMPTS), longest, 32, smollm.spec)
    engine = Engine(smollm, policies.build(policy, smollm.spec, devices, job), devices)
    completions = engine.generate(GREEDY_PROMPTS, SamplingParams(max_new_tokens=32))
    assert [c.token_ids for c in completions] == reference[1]
    assert engine.accountant.peak <= budget
    if policy == "stream-all":
        assert engine.accountant.peak_by_owner["staging"] > 0
    else:
        assert engine.plan.name.startswith("layer-split:")
