"""SmolLM2-135M through hx vs Hugging Face transformers on the same GGUF (both float32, CPU).

Acceptance A of the real-model issue, for three plans: all-accelerator, all-host, and SCORE +
MLP1 on the host. hx runs each prompt set as one left-padded batch; the reference runs each
prompt alone.
"""

import numpy as np
import pytest
import torch

from hx.generate import Engine
from hx.plan import ExecutionPlan
from hx.sampling import SamplingParams

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
PLANS = {
    "all-accelerator": lambda n: ExecutionPlan.all_accelerator(n),
    "all-host": lambda n: ExecutionPlan.all_host(n),
    "mixed": lambda n: ExecutionPlan.uniform(n, ("SCORE", "MLP1")),
}


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


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_matches_hugging_face(smollm, reference, plan_name):
    ref_logits, ref_greedy = reference
    engine = Engine(smollm, PLANS[plan_name](smollm.spec.n_layers))
    tok = smollm.tokenizer

    got = engine.last_logits([tok.encode(p) for p in LOGIT_PROMPTS])
    for row, ref in zip(got, ref_logits):
        assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4

    completions = engine.generate(GREEDY_PROMPTS, SamplingParams(max_new_tokens=32))
    for c, ref in zip(completions, ref_greedy):
        assert c.token_ids == ref
    assert sum(len(r) for r in ref_greedy) > 8 * 16  # the comparison covers real text
