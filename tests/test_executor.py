"""The executor under many plans gives the single-jit model's logits; placement, memory
accounting, streaming, compilation and the timeline behave as documented."""

import json

import jax
import numpy as np
import pytest

from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.executor import Executor
from hx.memory import check_fits, estimate
from hx.models.decoder import forward
from hx.models.spec import EMBED, HEAD, LAYER_OPS
from hx.plan import ExecutionPlan, Placement
from hx.planner import policies
from hx.segments import split_segments
from hx.timeline import ACC_COMPUTE, H2D, RESOURCES, Timeline
from hx.workload import Workload

from conftest import force_numpy_attention
from plans import acceptance_plans
from steps import left_padded_steps

B, T, S, DECODE_STEPS = 2, 8, 32, 4
PLANS = acceptance_plans(3, splits=(1, 2, 4))


def steps():
    return left_padded_steps(T, DECODE_STEPS)


def token_batches(spec):
    rng = np.random.default_rng(0)
    return [rng.integers(0, spec.vocab_size, (B, T), dtype=np.int32)] + [
        rng.integers(0, spec.vocab_size, (B, 1), dtype=np.int32) for _ in range(DECODE_STEPS)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Logits of prefill + decode steps from one jitted ``forward`` per step."""
    spec, params = tiny_model.spec, tiny_model.params
    f = jax.jit(forward, static_argnums=0)
    caches = [{"k": np.zeros((B, S, spec.n_kv_heads, spec.head_dim), np.float32),
               "v": np.zeros((B, S, spec.n_kv_heads, spec.head_dim), np.float32)}
              for _ in range(spec.n_layers)]
    out = []
    for step, tokens in zip(steps(), token_batches(spec)):
        logits, caches = f(spec, params, tokens, step, caches)
        out.append(np.asarray(logits))
    return out


def run_plan(model, plan, devices, timeline=None):
    ex = Executor(model.spec, model.params, plan, devices, timeline)
    caches = ex.new_cache(B, S)
    out = []
    for i, (step, tokens) in enumerate(zip(steps(), token_batches(model.spec))):
        logits, caches = ex.run("prefill" if i == 0 else "decode", tokens, step, caches)
        out.append(logits)
    ex.release_cache()
    return ex, out


NUMPY_ATTENTION_PLANS = ("all-host", "stream-all", "alternating", "kv-host-odd")


@pytest.mark.parametrize("name, numpy_attention", [(name, False) for name in PLANS]
                         + [(name, True) for name in NUMPY_ATTENTION_PLANS])
def test_plans_match_whole_model(tiny_model, reference, name, numpy_attention, monkeypatch):
    """Every acceptance plan gives the whole model's logits, also with host attention in
    numpy between XLA pieces (``SplitHostProgram``) instead of inside the host program."""
    if numpy_attention:
        force_numpy_attention(monkeypatch)
    plan = PLANS[name]
    budget = estimate(plan, tiny_model.spec, Workload(B, T, S)).accelerator
    devices = discover(accelerator_memory=budget)  # the tightest budget the plan claims
    ex, out = run_plan(tiny_model, plan, devices)
    for i, (logits, ref) in enumerate(zip(out, reference)):
        phase = "prefill" if i == 0 else "decode"
        assert logits.devices() == {devices[plan.phase(phase).head]}
        np.testing.assert_allclose(np.asarray(logits), ref, rtol=0,
                                   atol=1e-5 * np.abs(ref).max())
    split = {type(ex._executable(phase, i, B, 1, S)[0]).__name__
             for phase in ("decode",) for i, seg in enumerate(ex.segments[phase])
             if seg.device == HOST and seg.cache_layers}
    assert split == ({"SplitHostProgram"} if numpy_attention else split - {"SplitHostProgram"})
    assert 0 < ex.accountant.peak <= budget or budget == 0
    assert ex.accountant.in_use == sum(
        n for owner, n in ex.accountant.by_owner().items() if owner == "weights")


def test_weights_live_at_their_homes(tiny_model, devices):
    plan = PLANS["alternating"]
    ex = Executor(tiny_model.spec, tiny_model.params, plan, devices)
    acc, host = devices[ACCELERATOR], devices[HOST]
    for phase in ("prefill", "decode"):
        for seg, params in zip(ex.segments[phase], ex._params[phase]):
            for (layer, op), staged, tree in zip(seg.ops, seg.staged, params):
                home = plan.weights.get(layer, op)
                for leaf in jax.tree.leaves(tree):
                    want = acc if home == "resident" else host
                    if home == "streamed":
                        assert leaf.sharding.memory_kind == "pinned_host"
                        want = acc
                    assert leaf.devices() == {want}, (phase, layer, op, home)
                assert staged == (seg.device == ACCELERATOR and home not in (None, "resident"))
    caches = ex.new_cache(1, 8)
    assert [next(iter(c["k"].devices())) for c in caches] == [devices[d] for d in plan.kv]


def test_stream_all_stages_at_most_two_segments(tiny_model, devices):
    plan = PLANS["stream-all"]
    ex, _ = run_plan(tiny_model, plan, devices)
    est = estimate(plan, tiny_model.spec, Workload(B, T, S))
    assert ex.accountant.peak_by_owner["weights"] == 0
    assert 0 < ex.accountant.peak_by_owner["staging"] <= est.staging
    decode = split_segments(plan, "decode")
    assert all(len({layer for layer, _ in s.ops}) == 1 for s in decode if s.streams)


def test_plan_over_budget_is_rejected_before_running(tiny_model):
    plan = policies.all_accelerator(3)
    need = estimate(plan, tiny_model.spec, Workload(B, T, S)).accelerator
    devices = discover(accelerator_memory=need - 1000)
    with pytest.raises(HxError, match="over by 1000 bytes"):
        check_fits(plan, tiny_model.spec, devices, Workload(B, T, S))


def test_decode_does_not_recompile(tiny_model, devices):
    ex = Executor(tiny_model.spec, tiny_model.params, PLANS["alternating"], devices)
    caches = ex.new_cache(B, S)
    compilations = []
    for i, (step, tokens) in enumerate(zip(steps(), token_batches(tiny_model.spec))):
        _, caches = ex.run("prefill" if i == 0 else "decode", tokens, step, caches)
        compilations.append(ex.compilations)
    assert compilations[1] > compilations[0]  # decode compiled once ...
    assert compilations[1:] == [compilations[1]] * DECODE_STEPS  # ... and never again


def test_timeline_and_trace(tiny_model, devices, tmp_path):
    timeline = Timeline()
    run_plan(tiny_model, PLANS["stream-all"], devices, timeline)
    timeline.wait()
    assert all(e.dispatch <= e.start <= e.end for e in timeline.events)
    for step_events in timeline.steps("decode"):
        weights = [e for e in step_events if e.resource == H2D and e.name.startswith("weights")]
        compute = [e for e in step_events if e.resource == ACC_COMPUTE]
        assert len(weights) == len(compute)  # every accelerator segment streams its weights
        for w, c in zip(weights[1:], compute):  # next segment's copy issued before launch
            assert w.dispatch < c.dispatch
    timeline.to_chrome(str(tmp_path / "t.json"))
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == set(RESOURCES)
    assert sum(e["ph"] == "X" for e in trace) == len(timeline.events)


def test_segments_fuse_and_share_functions(tiny_model):
    n = tiny_model.spec.n_layers
    acc = split_segments(policies.all_accelerator(n), "decode")
    assert len(acc) == 1 and len(acc[0].ops) == 2 + 7 * n
    assert acc[0].reads == ("tokens",) and acc[0].writes == ("logits",)
    mixed = split_segments(ExecutionPlan.uniform(n, ("SCORE", "MLP1")), "decode")
    # [EMBED Q K V] [SCORE] [OUT] [MLP1] ([MLP2 Q K V] [SCORE] [OUT] [MLP1])* [MLP2 HEAD]
    assert len(mixed) == 4 * n + 1
    score = mixed[1]
    assert [op for _, op in score.ops] == ["SCORE"] and score.device == HOST
    assert score.reads == ("q", "k", "v") and score.writes == ("o",)  # x stays behind
    assert len({s.signature for s in mixed}) == 6  # layers share compiled functions


def test_every_read_is_produced_before():
    """Liveness over many random plans: each segment's reads were written by an earlier
    segment (or are the input tokens), and 'logits' is written last."""
    rng = np.random.default_rng(0)
    n = 3
    for _ in range(200):
        rows = tuple(tuple(rng.choice([ACCELERATOR, HOST]) for _ in LAYER_OPS) for _ in range(n))
        placement = Placement(rng.choice([ACCELERATOR, HOST]), rows,
                              rng.choice([ACCELERATOR, HOST]))
        plan = ExecutionPlan.from_placement(placement, streamed=bool(rng.integers(2)))
        available = {"tokens"}
        segments = split_segments(plan, "decode")
        for seg in segments:
            assert set(seg.reads) <= available
            available |= set(seg.writes)
        assert segments[-1].writes[-1] == "logits"
        assert [op for s in segments for _, op in s.ops] == [EMBED] + list(LAYER_OPS) * n + [HEAD]


def test_step_traffic_is_the_median_step_of_a_phase():
    """``timeline.step_traffic``: over two decode steps (a prefill step aside), the median
    bytes each copy resource moved a step and the streamed experts a step copied."""
    from hx.timeline import D2H, H2D, Event, Timeline, step_traffic

    def event(i, resource, step, **args):
        return Event(i, resource, "e", step, 0.0, (), args, 0.0, 1.0)

    events = [event(0, H2D, 0, bytes=10**6), event(1, H2D, 1, bytes=100),
              event(2, D2H, 1, bytes=10), event(3, H2D, 1, bytes=0, experts=[4, 5]),
              event(4, H2D, 2, bytes=300), event(5, D2H, 2, bytes=30),
              event(6, H2D, 2, bytes=0, experts=[1])]
    timeline = Timeline(events=events, step=2,
                        step_names={0: "prefill", 1: "decode", 2: "decode"})
    assert step_traffic(timeline) == {H2D: 200, D2H: 20, "experts": 1.5}
    assert step_traffic(timeline, "prefill") == {H2D: 10**6, D2H: 0, "experts": 0}
    assert step_traffic(timeline, "none") == {}
