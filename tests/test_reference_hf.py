"""SmolLM2-135M through hx vs Hugging Face transformers on the same GGUF.

float32 (hx's float32 on any backend, HF float32 on CPU torch): for every acceptance plan
(all-accelerator, all-host, stream-all, layer-split 10, alternating op devices, SCORE + MLP1
on the host): last-position logits within 1e-4 relative and
identical 32-token greedy continuations, while the accelerator budget is set to exactly what the
plan claims to need (the accountant raises if it is ever passed). hx runs each prompt set as one
left-padded batch; the reference runs each prompt alone.

bfloat16 (both dequantize the GGUF to bfloat16: the same weights, bit for bit): top-1 agreement
over 8 teacher-forced 64-token texts under all-accelerator and stream-all (SCORE on the host).
"""

import numpy as np
import pytest
import torch

import hx
from hx.devices import discover
from hx.executor import Executor
from hx.generate import Engine
from hx.memory import estimate
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.workload import Workload

from plans import acceptance_plans
from test_dtypes import teacher_forced

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
PLANS = {name: plan for name, plan in acceptance_plans(30, splits=()).items()
         if name != "kv-host-odd"}  # host KV: all-host, stream-all; layer splits: the tiny
# model's tests/test_executor.py (CI time)


@pytest.fixture(scope="module")
def smollm():
    """The default model in float32 whatever the platform (``auto`` is bfloat16 on a GPU), its
    host ops multiplying in float32 (``host_matmul`` xla: ``auto``'s ggml rounds activations
    to 8 bits, as llama.cpp; tests/test_ggml_kernel.py bounds that)."""
    return hx.load(dtype="float32", host_matmul="xla")


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


@pytest.mark.slow
@pytest.mark.parametrize("policy,weights", [("stream-all", "dense"), ("auto", "dense"),
                                            ("auto", "auto")])
def test_quarter_of_the_weights_budget(smollm, smollm_dense, reference, policy, weights):
    """With 25 % of the weight bytes as accelerator budget, generation runs and matches, with
    the matrices expanded to float32 or held as the GGUF's blocks (the default: there the
    tied Q8_0 embedding alone is 31 % of the bytes, so no plan streams it)."""
    smollm = smollm if weights == "auto" else smollm_dense
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


TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden screw press into a system that "
    "could produce books far faster than any team of scribes working by hand. Within fifty "
    "years, presses operated in more than two hundred European cities, and the price of books "
    "fell sharply.",
    "def merge_sort(items):\n    \"\"\"Return a new list with the items in ascending order."
    "\"\"\"\n    if len(items) <= 1:\n        return list(items)\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n"
    "    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += 1\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. In the chloroplasts, chlorophyll absorbs sunlight, and the "
    "energy is used to split water molecules, releasing oxygen. The hydrogen and energy carriers "
    "produced then drive the Calvin cycle, which fixes carbon dioxide from the air into simple "
    "sugars that the plant uses to grow and to store energy.",
    "<|im_start|>user\nCan you explain why the sky is blue, in simple terms?<|im_end|>\n"
    "<|im_start|>assistant\nSure! Sunlight looks white, but it is made of many colors. When it "
    "enters the atmosphere, it bumps into tiny gas molecules. Blue light has a shorter "
    "wavelength, so it gets scattered in all directions much more than red light. That "
    "scattered blue light reaches our eyes from every part of the sky.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker named Elias. Every morning he opened the shutters of his workshop, wound the "
    "hundred clocks that lined its walls, and listened until they all ticked together. The "
    "children of the village said that his clocks could tell more than the time.",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a heavy pan over medium "
    "heat. Add one finely chopped onion and a pinch of salt, and cook until soft and golden, "
    "about ten minutes. Stir in two cloves of crushed garlic, then add a can of whole tomatoes, "
    "crushing them with a wooden spoon. Simmer gently for twenty minutes.",
    "The mitochondrion is often called the powerhouse of the cell. It has two membranes: a "
    "smooth outer membrane and a folded inner membrane whose folds, the cristae, carry the "
    "enzymes of the electron transport chain. As electrons pass along this chain, protons are "
    "pumped across the inner membrane, and their flow back through ATP synthase makes ATP.",
    "In economics, inflation is a general increase in the prices of goods and services over "
    "time. When inflation is high, each unit of currency buys fewer goods than before, so the "
    "purchasing power of money falls. Central banks usually try to keep inflation low and "
    "stable, often targeting about two percent a year, by raising or lowering interest rates.",
]
TEXT_TOKENS = 64


@pytest.fixture(scope="module")
def smollm_bf16():
    """bfloat16, its host ops' 4-bit products in torch's kernel (bfloat16 activations)."""
    return hx.load(dtype="bfloat16", host_matmul="torch-int4")


@pytest.fixture(scope="module")
def texts(smollm_bf16):
    ids = [smollm_bf16.tokenizer.encode(t)[:TEXT_TOKENS] for t in TEXTS]
    assert all(len(i) == TEXT_TOKENS for i in ids)
    return np.array(ids, np.int32)


@pytest.fixture(scope="module")
def bf16_reference(texts, hf_smollm):
    """Logits (8, 64, V) of every position: HF in bfloat16 (the float32 reference cast to
    bfloat16: the GGUF dequantized to float32, then rounded to nearest even, as loading it with
    ``dtype=torch.bfloat16`` does and as hx's bfloat16 load does; a plain dense model, SDPA
    attention) and, for scale, HF in float32."""
    import copy

    model = copy.deepcopy(hf_smollm).to(torch.bfloat16).eval()
    with torch.no_grad():
        bf16 = model(torch.tensor(texts)).logits.float().numpy()
        f32 = hf_smollm(torch.tensor(texts)).logits.numpy()
    return bf16, f32


def top1_agreement(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(share of positions where the top-1 tokens are equal, the same counting as equal a
    top-1 of ``got`` whose logit in ``ref`` is within one bfloat16 step of ref's largest --
    tokens ref's own bfloat16 logits cannot rank)."""
    top = got.argmax(-1)
    best = ref.max(-1)
    step = 2.0 ** (np.floor(np.log2(np.abs(best))) - 7)  # bf16 keeps 8 significant bits
    theirs = np.take_along_axis(ref, top[..., None], -1)[..., 0]
    return float((top == ref.argmax(-1)).mean()), float((theirs >= best - step).mean())


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["all-accelerator", "stream-all"])
def test_bfloat16_matches_hugging_face_bfloat16(smollm_bf16, texts, bf16_reference, plan_name):
    """Acceptance C. Two bfloat16 implementations round at different points (hx: once per op,
    after float32 accumulation; HF also rounds each projection, product and residual
    separately), so near-ties flip: measured here 99.0 % (all-accelerator) and 98.2 %
    (stream-all, whose host attention sums in another order) top-1 agreement, every
    disagreement a near-tie in HF's own logits; HF bfloat16 itself agrees 98.6 % with HF
    float32, hx bfloat16 99.2 %. Asserted: >= 99 % counting ties at bfloat16 resolution,
    >= 98 % exact, the largest |logit difference| within 10 % of the largest logit."""
    ref, ref32 = bf16_reference
    spec = smollm_bf16.spec
    plan = PLANS[plan_name]
    budget = max(estimate(plan, spec, Workload(len(TEXTS), 1, TEXT_TOKENS)).accelerator,
                 estimate(plan, spec, Workload(1, 1, 1)).accelerator)
    executor = Executor(spec, smollm_bf16.params, plan, discover(accelerator_memory=budget))
    got = teacher_forced(executor, texts)
    exact, with_ties = top1_agreement(got, ref)
    delta = np.abs(got - ref).max()
    print(f"\n{plan_name}: hx bfloat16 vs HF bfloat16 top-1 {exact:.2%} ({with_ties:.2%} "
          f"counting bf16 ties), max |dlogit| {delta:.3f} (largest |logit| "
          f"{np.abs(ref).max():.1f}); vs HF float32: hx bf16 {top1_agreement(got, ref32)[0]:.2%}, "
          f"HF bf16 {top1_agreement(ref, ref32)[0]:.2%}")
    assert with_ties >= 0.99 and exact >= 0.98
    assert delta <= 0.1 * np.abs(ref).max()
