"""The executor runs ``streamed`` KV caches (host memory, attended on the accelerator) with KV
recompute (KVPR): logits equal the single-jit model's whatever r, copies and memory behave as
``hx.schedule`` says, and greedy outputs of SmolLM2 do not change."""

import dataclasses

import jax
import numpy as np
import pytest

from hx import schedule, streamed_kv
from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.executor import Executor
from hx.generate import Engine
from hx.memory import estimate
from hx.models.decoder import forward
from hx.models.loader import Model
from hx.plan import STREAMED, ExecutionPlan, Placement, Stint
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.schedule import KV_LOAD, KV_STORE, RECOMPUTE
from hx.timeline import ACC_COMPUTE, D2H, H2D, Timeline
from hx.workload import Workload

from steps import left_padded_steps
from test_executor import B, DECODE_STEPS, S, T, token_batches



@pytest.fixture(scope="module")
def reference(tiny_model):
    """Logits of prefill + decode steps from one jitted ``forward`` per step (float32)."""
    spec = tiny_model.spec
    f = jax.jit(forward, static_argnums=0)
    caches = [{name: np.zeros((B, S, spec.n_kv_heads, spec.head_dim), np.float32)
               for name in ("k", "v")} for _ in range(spec.n_layers)]
    out = []
    for step, tokens in zip(left_padded_steps(T, DECODE_STEPS), token_batches(spec)):
        logits, caches = f(spec, tiny_model.params, tokens, step, caches)
        out.append(np.asarray(logits))
    return out


def run(model, plan, timeline=None):
    """(executor, logits of every step) at the tightest budget the plan's estimate claims."""
    budget = estimate(plan, model.spec, Workload(B, T, S)).accelerator
    ex = Executor(model.spec, model.params, plan, discover(accelerator_memory=budget), timeline)
    caches, out = ex.new_cache(B, S), []
    for i, (step, tokens) in enumerate(zip(left_padded_steps(T, DECODE_STEPS),
                                           token_batches(model.spec))):
        logits, caches = ex.run("prefill" if i == 0 else "decode", tokens, step, caches)
        out.append(np.asarray(logits))
    return ex, out, caches


@pytest.mark.parametrize("r, quantum, weights_streamed", [
    (0, 4, True), (1, 4, True), (T // 2, 4, True), (S // 2, 4, True), (S, 4, True),
    (0, schedule.COPY_QUANTUM, False), (S // 2, schedule.COPY_QUANTUM, False)])
def test_logits_equal_the_whole_model_for_any_r(tiny_model, reference, monkeypatch, r, quantum,
                                                 weights_streamed):
    """r = 0 (the whole cache crosses), 1, half the prompt, half the slots, all of them; the
    copies in quanta of 4 slots (padded on the accelerator) or whole (a quantum past S), the
    weights streamed or resident."""
    monkeypatch.setattr(schedule, "COPY_QUANTUM", quantum)
    plan = policies.kv_streamed(tiny_model.spec.n_layers, r, weights_streamed)
    assert plan.recompute(0) == r
    ex, out, caches = run(tiny_model, plan)
    for logits, ref in zip(out, reference):
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    # the host keeps the caches (and h where it recomputes); nothing is left on the accelerator
    host = discover()[HOST]
    assert all(a.devices() == {host} for c in caches for a in c.values())
    assert all((streamed_kv.H in c) == bool(r) for c in caches)
    assert ex.accountant.in_use == ex.accountant.by_owner()["weights"]


def test_kept_h_and_cache_equal_an_accelerator_homed_run(tiny_model):
    """The host cache a streamed layer keeps is the cache an accelerator-homed layer holds, bit
    for bit, and its ``h`` is the layer's normed input (recomputing K from it gives K)."""
    n = tiny_model.spec.n_layers
    _, _, plain = run(tiny_model, policies.kv_streamed(n, 0, layers=()))
    _, _, kept = run(tiny_model, policies.kv_streamed(n, S))
    for a, b in zip(plain, kept):
        for name in ("k", "v"):
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    h = np.asarray(kept[0][streamed_kv.H])
    written = T + DECODE_STEPS
    assert np.abs(h[:, :written]).min(axis=-1).max() > 0 and not h[:, written:].any()


def test_a_mixed_plan_recomputes_only_where_k_and_v_run_on_the_accelerator(tiny_model,
                                                                           reference):
    """Layer 0 streamed with K on the host (no recompute there), layer 1 on the accelerator,
    layer 2 streamed recomputing; ``with_recompute`` leaves layer 0 at r = 0, and forcing it
    is refused."""
    spec = tiny_model.spec
    place = Placement.uniform(spec.n_layers, lambda op: ACCELERATOR)
    layers = list(place.layers)
    layers[0] = tuple(HOST if op == "K" else d for op, d in zip(place.OPS, layers[0]))
    place = dataclasses.replace(place, layers=tuple(layers))
    base = ExecutionPlan.from_placement(place, streamed=True, name="mixed")
    plan = dataclasses.replace(base, kv=(STREAMED, ACCELERATOR, STREAMED)).with_recompute(6)
    assert plan.kv_recompute == (0, 0, 6)
    _, out, _ = run(tiny_model, plan)
    for logits, ref in zip(out, reference):
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(HxError, match="K or V op runs on the host"):
        dataclasses.replace(plan, kv_recompute=(6, 0, 6)).validate(spec)


def test_the_timeline_shows_the_copies_and_the_recompute(tiny_model):
    """Per streamed layer and step: one K/V copy in, a recompute, one copy out of the new
    positions' K, V and h -- the bytes the schedule names, at r = S/2 in decode."""
    tl = Timeline()
    n, r = tiny_model.spec.n_layers, S // 2
    ex, _, _ = run(tiny_model, policies.kv_streamed(n, r), tl)
    events = [e for e in tl.events if e.step == tl.events[-1].step]  # the last decode step
    loads = [e for e in events if e.resource == H2D and e.name == "KV"]
    stores = [e for e in events if e.resource == D2H and e.name == "KV"]
    recomputes = [e for e in events if e.resource == ACC_COMPUTE and e.name == "recompute K V"]
    assert len(loads) == len(stores) == len(recomputes) == n
    schedule = ex.schedule("decode", B, 1, S)
    by_kind = {k: [i.nbytes for i in schedule.instructions if i.kind == k]
               for k in (KV_LOAD, KV_STORE, RECOMPUTE)}
    assert [e.args["bytes"] for e in stores] == by_kind[KV_STORE]
    assert [e.args["bytes"] for e in loads] == by_kind[KV_LOAD]  # a quantum past S: all


def test_compressed_kv_streams_its_compressed_bytes(tiny_model):
    """An int8 KV cache crosses compressed; at r = 0 the logits equal the accelerator-homed
    int8 cache's exactly, and with recompute (re-quantized K, V) closely."""
    model = Model(tiny_model.spec.replace(kv_format="int8"), tiny_model.params,
                  tiny_model.tokenizer, "tiny-int8")
    n = model.spec.n_layers
    _, homed, _ = run(model, policies.kv_streamed(n, 0, layers=()))
    _, plain, caches = run(model, policies.kv_streamed(n, 0))
    _, recomputed, _ = run(model, policies.kv_streamed(n, S // 2))
    for a, b, c in zip(homed, plain, recomputed):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(c, a, rtol=0, atol=2e-2 * np.abs(a).max())
    assert caches[0]["k"].dtype == np.uint8


def test_greedy_generation_with_a_chunked_prefill(tiny_model):
    """Through the engine, prefilling in chunks of 4 tokens (each chunk recomputes what the
    chunks before it wrote): the all-accelerator plan's tokens. (Micro-batches, joins and
    re-framed caches: ``tests/test_continuous.py``.)"""
    prompts = [[5, 9, 13, 200, 7, 7, 42], [300, 301, 302], [11] * 12, [4, 4]]
    sampling = SamplingParams(max_new_tokens=6)
    want = Engine(tiny_model, ExecutionPlan.all_accelerator(3)).generate_ids(prompts, sampling)
    plan = dataclasses.replace(policies.kv_streamed(3, 5), prefill_chunk=4)
    got = Engine(tiny_model, plan).generate_ids(prompts, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


@pytest.mark.slow
def test_smollm2_greedy_outputs_do_not_change(smollm):
    """The README's prompt, 16 tokens: every layer's cache streamed, every slot recomputed,
    then half the prompt and another plan after 8 tokens: the all-accelerator plan's tokens
    (r = 0 and the others: the tiny model's tests)."""
    prompt = smollm.tokenizer.encode("The capital of France is")
    sampling = SamplingParams(max_new_tokens=16)
    n = smollm.spec.n_layers
    want = Engine(smollm, ExecutionPlan.all_accelerator(n)).generate_ids([prompt], sampling)
    got = Engine(smollm, policies.kv_streamed(n, 1024, weights_streamed=False)).generate_ids(
        [prompt], sampling)
    assert got[0].token_ids == want[0].token_ids
    stints = [Stint(0, policies.kv_streamed(n, len(prompt) // 2, weights_streamed=False)),
              Stint(8, policies.stream_all(n))]
    engine = Engine(smollm, stints=stints)
    assert engine.generate_ids([prompt], sampling)[0].token_ids == want[0].token_ids
    assert [start for start, _ in engine.plan_log] == [0, 8]
