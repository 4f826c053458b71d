"""DeepSeek-V2's latent attention and routing (``models.deepseek_v2``) beyond the family suite
(tests/test_families.py runs DeepSeek-V2-Lite's layout under every plan): the query's own
low-rank projection and greedy routing against transformers, the group-limited top k against
float64 numpy, and the KV cache holding the latent alone."""

import numpy as np
import pytest

import hx
from hx.devices import discover
from hx.generate import Engine
from hx.models.moe import top_k_routed
from hx.models.tensors import kv_arrays, kv_bytes
from hx.planner import policies
from hx.sampling import SamplingParams

from hf_families import CONFIGS, PROMPTS, reference, write_checkpoint


def test_query_low_rank_yarn_and_greedy_routing_match_transformers(tmp_path):
    """DeepSeek-V2's own layout (``q_lora_rank``: q = RMSNorm(h Wq_a) Wq_b; greedy top k, no
    groups; YaRN, here over a ramp of the 4 frequencies and with attention factors 1.065 on
    the rotated parts and 1.143 on the softmax): logits within 1e-4 relative and 16 greedy
    tokens equal to transformers', with SCORE on the accelerator and on the host
    (stream-all)."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5}
    fields = dict(CONFIGS["deepseek_v2"][1], q_lora_rank=24, topk_method="greedy",
                  n_group=None, topk_group=None, routed_scaling_factor=1.0,
                  rope_parameters=yarn)
    ref_model = write_checkpoint("deepseek_v2", str(tmp_path), config=("deepseek_v2", fields))
    model = hx.load(str(tmp_path), dtype="float32")
    assert model.spec.mla.q_rank == 24 and model.spec.moe.groups == 0
    assert dict(model.spec.rope_scaling)["rope_type"] == "yarn"
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    ref_logits, ref_greedy = reference(ref_model, prompts, 16, model.tokenizer.eos_id)
    n = model.spec.n_layers
    for plan in (policies.all_accelerator(n), policies.stream_all(n)):
        engine = Engine(model, plan, discover())
        for row, ref in zip(engine.last_logits(prompts), ref_logits):
            assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4, plan.name
        got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=16))
        assert [c.token_ids for c in got] == ref_greedy, plan.name


def test_a_dense_first_layer_runs_beside_moe_layers_on_either_device(tmp_path):
    """DeepSeek's dense first layer (``first_k_dense_replace``) is its own layer type: its MLP
    is held d_ff wide and its ``a`` crosses the devices (B, T, d_ff) where an MoE layer's is
    (B, T, D + X). With MLP1 on the host (``a`` crossing to the accelerator) and with MLP2 on
    the host (crossing back): transformers' logits and greedy tokens, the accelerator's peak
    at most the exact estimate; the weights as many bytes as the file's float32 tensors."""
    from hx.memory import estimate
    from hx.plan import ExecutionPlan
    from hx.workload import Workload

    ref_model = write_checkpoint("deepseek_v2", str(tmp_path))
    model = hx.load(str(tmp_path), dtype="float32")
    spec = model.spec
    assert spec.layer_types == ("dense", "moe", "moe") and spec.expert_layers == (1, 2)
    assert spec.layer_spec(0).moe is None and spec.layer_spec(1).moe == spec.moe
    assert spec.weight_bytes == 4 * sum(p.numel() for p in ref_model.parameters())
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    ref_logits, ref_greedy = reference(ref_model, prompts, 16, model.tokenizer.eos_id)
    work = Workload.for_prompts(len(prompts), max(map(len, prompts)), 16, spec)
    for ops in (("MLP1",), ("MLP2",)):
        plan = ExecutionPlan.uniform(spec.n_layers, ops)
        engine = Engine(model, plan, discover())
        for row, ref in zip(engine.last_logits(prompts), ref_logits):
            assert np.abs(row - ref).max() / np.abs(ref).max() <= 1e-4, ops
        got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=16))
        assert [c.token_ids for c in got] == ref_greedy, ops
        assert engine.accountant.peak <= estimate(plan, spec, work).accelerator, ops


def _group_limited(probs: np.ndarray, groups: int, top_groups: int, k: int) -> np.ndarray:
    """The experts a row routes to, in float64: the k best of the best groups' experts."""
    chosen = []
    for row in probs:
        best = np.argsort(-row.reshape(groups, -1).max(axis=1))[:top_groups]
        allowed = np.concatenate([np.arange(g * len(row) // groups, (g + 1) * len(row) // groups)
                                  for g in best])
        chosen.append(sorted(allowed[np.argsort(-row[allowed])[:k]]))
    return np.array(chosen)


def test_group_limited_top_k_takes_the_best_groups_experts():
    """``top_k_routed`` with groups: the ids of float64 numpy's choice, their probabilities as
    weights, and on these rows a different choice from the ungrouped top k (the groups
    matter)."""
    from hx.models.spec import MoeShape

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(16), size=64)
    moe = MoeShape(16, 3, 8, groups=4, top_groups=2)
    weights, ids = top_k_routed(probs.astype(np.float32), moe)
    ids = np.sort(np.asarray(ids), axis=1)
    assert (ids == _group_limited(probs, 4, 2, 3)).all()
    np.testing.assert_allclose(np.sort(np.asarray(weights), axis=1),
                               np.sort(np.take_along_axis(probs, ids, 1), axis=1), rtol=1e-6)
    _, free = top_k_routed(probs.astype(np.float32), MoeShape(16, 3, 8))
    assert (np.sort(np.asarray(free), axis=1) != ids).any(axis=1).sum() >= 8


def test_the_kv_cache_holds_the_latent_alone(tmp_path):
    """Each layer's cache is the latent (1 head of kv_lora_rank) as K and the shared rotated
    key (1 head of qk_rope_head_dim) as V: (32 + 8) elements a token, where expanded keys and
    values would take 2 x 4 heads x (16 + 8) -- what the executor allocates and the bytes
    table counts."""
    write_checkpoint("deepseek_v2", str(tmp_path))
    model = hx.load(str(tmp_path), dtype="float32")
    spec = model.spec
    assert {k: shape for k, (shape, _) in kv_arrays(spec, 2, 64).items()} == {
        "k": (2, 64, 1, 32), "v": (2, 64, 1, 8)}
    assert kv_bytes(spec, 2, 64) == 2 * 64 * (32 + 8) * 4
    engine = Engine(model, policies.all_accelerator(spec.n_layers), discover())
    caches = engine.executor.new_cache(2, 64)
    assert [{k: a.shape for k, a in c.items()} for c in caches] == [
        {"k": (2, 64, 1, 32), "v": (2, 64, 1, 8)}] * spec.n_layers
    engine.executor.release_cache()


def test_latent_attention_is_not_split_across_accelerators(tmp_path):
    """Tensor parallelism would split heads hx keeps whole: refused with one line."""
    write_checkpoint("deepseek_v2", str(tmp_path))
    spec = hx.load(str(tmp_path), dtype="float32").spec
    with pytest.raises(ValueError, match="latent attention") as refused:
        spec.shard(2)
    assert "\n" not in str(refused.value)
