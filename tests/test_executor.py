"""The executor under different plans gives the single-jit model's logits; segments are right."""

import itertools

import jax
import numpy as np
import pytest

from hx.devices import ACCELERATOR, HOST
from hx.executor import Executor
from hx.models.llama import Step, forward
from hx.models.spec import EMBED, HEAD, LAYER_OPS
from hx.plan import ExecutionPlan, PhasePlan
from hx.segments import split_segments


def alternating(n_layers: int) -> ExecutionPlan:
    """Op devices alternate within each layer (and the pattern flips every layer); prefill uses
    the opposite pattern from decode; KV on the host for odd layers."""
    cycle = itertools.cycle([ACCELERATOR, HOST])
    decode_layers = tuple(tuple(next(cycle) for _ in LAYER_OPS) for _ in range(n_layers))
    flip = {ACCELERATOR: HOST, HOST: ACCELERATOR}
    prefill_layers = tuple(tuple(flip[d] for d in row) for row in decode_layers)
    return ExecutionPlan(prefill=PhasePlan(HOST, prefill_layers, ACCELERATOR),
                         decode=PhasePlan(ACCELERATOR, decode_layers, HOST),
                         kv=tuple(HOST if i % 2 else ACCELERATOR for i in range(n_layers)),
                         name="alternating")


def plans(n):
    return [ExecutionPlan.all_accelerator(n), ExecutionPlan.all_host(n),
            ExecutionPlan.uniform(n, ("SCORE", "MLP1")), alternating(n)]


def reference_run(spec, params, tokens_seq, devices):
    """Prefill tokens_seq[0] then decode the rest with one jitted ``forward`` per step."""
    f = jax.jit(forward, static_argnums=0)
    B, T = tokens_seq[0].shape
    caches = [{"k": np.zeros((B, 32, spec.n_kv_heads, spec.head_dim), np.float32),
               "v": np.zeros((B, 32, spec.n_kv_heads, spec.head_dim), np.float32)}
              for _ in range(spec.n_layers)]
    out = []
    for step, tokens in zip(steps_for(B, T, len(tokens_seq)), tokens_seq):
        logits, caches = f(spec, params, tokens, step, caches)
        out.append(np.asarray(logits))
    return out


def steps_for(B, T, n):
    kv_start = np.array([0, 2][:B], np.int32)  # row 1 is left-padded by 2
    yield Step(np.maximum(np.arange(T, dtype=np.int32)[None] - kv_start[:, None], 0),
               np.int32(0), kv_start)
    for i in range(1, n):
        yield Step((T - kv_start + i - 1)[:, None].astype(np.int32), np.int32(T + i - 1),
                   kv_start)


@pytest.mark.parametrize("plan_index", range(4))
def test_plans_match_whole_model(tiny_model, devices, plan_index):
    spec, params = tiny_model.spec, tiny_model.params
    plan = plans(spec.n_layers)[plan_index]
    rng = np.random.default_rng(0)
    tokens_seq = [rng.integers(0, spec.vocab_size, (2, 8), dtype=np.int32)] + [
        rng.integers(0, spec.vocab_size, (2, 1), dtype=np.int32) for _ in range(4)]
    ref = reference_run(spec, params, tokens_seq, devices)
    ex = Executor(spec, params, plan, devices)
    caches = ex.new_cache(2, 32)
    for i, (step, tokens) in enumerate(zip(steps_for(2, 8, 5), tokens_seq)):
        logits, caches = ex.run("prefill" if i == 0 else "decode", tokens, step, caches)
        assert logits.devices() == {devices[plan.phase("prefill" if i == 0 else "decode").head]}
        np.testing.assert_allclose(np.asarray(logits), ref[i], rtol=0, atol=1e-5 * np.abs(
            ref[i]).max())


def test_weights_and_caches_live_where_the_plan_says(tiny_model, devices):
    spec, params = tiny_model.spec, tiny_model.params
    plan = ExecutionPlan.uniform(spec.n_layers, ("SCORE", "MLP1"))
    ex = Executor(spec, params, plan, devices)
    for seg, seg_params in zip(ex.segments["decode"], ex._segment_params["decode"]):
        for leaf in jax.tree.leaves(seg_params):
            assert leaf.devices() == {devices[seg.device]}
    caches = ex.new_cache(1, 8)
    assert all(c["k"].devices() == {devices[HOST]} for c in caches)


def test_segments_fuse_and_share_functions(tiny_model, devices):
    n = tiny_model.spec.n_layers
    acc = split_segments(ExecutionPlan.all_accelerator(n).decode)
    assert len(acc) == 1 and len(acc[0].ops) == 2 + 7 * n
    assert acc[0].reads == ("tokens",) and acc[0].writes == ("logits",)

    mixed = split_segments(ExecutionPlan.uniform(n, ("SCORE", "MLP1")).decode)
    # [EMBED Q K V] [SCORE] [OUT] [MLP1] ([MLP2 Q K V] [SCORE] [OUT] [MLP1])* [MLP2 HEAD]
    assert len(mixed) == 4 * n + 1
    score = mixed[1]
    assert [op for _, op in score.ops] == ["SCORE"] and score.device == HOST
    assert score.reads == ("q", "k", "v") and score.writes == ("o",)  # x stays behind
    mlp1 = mixed[3]
    assert mlp1.reads == ("x",) and mlp1.writes == ("a",)
    ex = Executor(tiny_model.spec, tiny_model.params, ExecutionPlan.uniform(n, ("SCORE", "MLP1")),
                  devices)
    signatures = {s.signature for s in ex.segments["decode"]}
    assert len(signatures) == 6  # layers share compiled segment functions


def test_every_read_is_produced_before(tiny_model):
    """Liveness invariant over many random plans: each segment's reads were written by an
    earlier segment (or are the input tokens), and 'logits' is written last."""
    rng = np.random.default_rng(0)
    n = tiny_model.spec.n_layers
    for _ in range(200):
        rows = tuple(tuple(rng.choice([ACCELERATOR, HOST]) for _ in LAYER_OPS) for _ in range(n))
        phase = PhasePlan(rng.choice([ACCELERATOR, HOST]), rows, rng.choice([ACCELERATOR, HOST]))
        available = {"tokens"}
        segments = split_segments(phase)
        for seg in segments:
            assert set(seg.reads) <= available
            available |= set(seg.writes)
            assert seg.device in (ACCELERATOR, HOST)
        assert segments[-1].writes[-1] == "logits"
        flat = [op for seg in segments for _, op in seg.ops]
        assert flat == [EMBED] + list(LAYER_OPS) * n + [HEAD]
