"""The step as data: schedules, their dry run against real runs, chunked prefill."""

import numpy as np
import pytest

from hx.devices import ACCELERATOR, discover
from hx.generate import Engine
from hx.memory import estimate
from hx.models.loader import Model
from hx.models.spec import PRESETS, ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.programs import Programs, proxy
from hx.schedule import (H2D, LAUNCH, MOVE, STAGE, WAIT, compile_schedule, dry_run,
                         staged_bytes)
from hx.segments import split_segments
from hx.workload import Workload, prefill_chunks

from plans import acceptance_plans

PLANS = acceptance_plans(3, splits=(1, 2, 4))


@pytest.mark.parametrize("name", list(PLANS))
def test_schedule_launches_every_segment_once_after_its_weights(tiny_model, name):
    plan, spec = PLANS[name], tiny_model.spec
    for phase in ("prefill", "decode"):
        schedule = compile_schedule(plan, spec, phase, 2, 8, 32)
        launches = [ins.segment for ins in schedule.instructions if ins.kind == LAUNCH]
        assert launches == list(range(len(schedule.segments)))
        staged_live, seen = set(), []
        for ins in schedule.instructions:
            if ins.kind == STAGE:
                staged_live.add(ins.segment)
                seen.append(ins.segment)
                assert len(staged_live) <= 2  # double buffer
            elif ins.kind == WAIT:
                staged_live.discard(ins.segment)
            elif ins.kind == LAUNCH and schedule.segments[ins.segment].streams:
                assert ins.segment in staged_live
        streaming = [i for i, s in enumerate(schedule.segments) if s.streams]
        assert seen == streaming  # each staged once, in order
        assert sum(ins.nbytes for ins in schedule.instructions if ins.kind == STAGE) == sum(
            staged_bytes(spec, s) for s in schedule.segments)
        assert dry_run(schedule).peak >= 0


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_ready_inputs_cross_ahead_of_the_next_weights(tiny_model, micro_batches):
    """One H2D link carries weights and activations in issue order: the first streamed
    layer's input (embeddings gathered on the host, ready at once) goes ahead of the next
    weights; an input from host attention goes behind them (the executor blocks on it)."""
    spec = tiny_model.spec
    schedule = compile_schedule(policies.stream_all(spec.n_layers), spec, "decode", 2, 1, 32,
                                micro_batches=micro_batches)
    link = [(ins.kind, ins.segment) for ins in schedule.instructions if ins.resource == H2D]
    qkv0, out0, qkv1 = [i for i, seg in enumerate(schedule.segments) if seg.streams][:3]
    assert schedule.segments[qkv0 + 1].ops == ((0, "SCORE"),)  # host attention between
    moves_of = lambda i: [k for k, x in enumerate(link) if x == (MOVE, i)]
    assert len(moves_of(qkv0)) == len(moves_of(out0)) == micro_batches
    assert max(moves_of(qkv0)) < link.index((STAGE, out0))
    assert link.index((STAGE, qkv1)) < min(moves_of(out0))


def test_dry_run_frees_everything_it_allocates(tiny_model):
    for plan in PLANS.values():
        for phase in ("prefill", "decode"):
            schedule = compile_schedule(plan, tiny_model.spec, phase, 2, 8, 32,
                                        lambda *a: 1000)
            live = set()
            for ins in schedule.instructions:
                live.difference_update(ins.frees)
                live.update(key for key, _, _ in ins.allocs)
            assert live == set(), (plan.name, phase)


def _long_model(tiny_model) -> Model:
    spec = tiny_model.spec.replace(context_length=512)
    return Model(spec, tiny_model.params, tiny_model.tokenizer, "tiny, 512 context")


@pytest.mark.parametrize("name", ["all-accelerator", "stream-all", "host:SCORE,MLP1"])
def test_chunked_prefill_equals_unchunked(tiny_model, devices, name):
    model = _long_model(tiny_model)
    plan = PLANS[name]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1000, 300).tolist(), rng.integers(0, 1000, 211).tolist()]
    whole = Engine(model, plan, devices).last_logits(prompts)
    for chunk in (1, 7, 64):
        chunked = Engine(model, plan.with_prefill_chunk(chunk), devices).last_logits(prompts)
        np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5 * np.abs(whole).max())


def test_prefill_chunks_cover_the_prompt():
    for T in (1, 16, 300, 304):
        for chunk in (None, 1, 7, 64, 512):
            chunks = prefill_chunks(T, chunk)
            assert sum(chunks) == T and all(0 < c <= (chunk or T) for c in chunks)
            assert len(set(chunks[1:])) <= 1  # one compiled shape after the first


def test_workload_counts_the_tokens_asked_for_not_the_rounded_cache():
    """512 + 32 tokens round up to 576 slots; the run has 31 decode steps (prefill gives the
    first token) priced at the middle of generation, not 63 at the middle of the cache."""
    spec = PRESETS["llama2-7b"]
    w = Workload.for_prompts(16, 512, 32, spec)
    assert (w.cache_slots, w.generated, w.decode_steps, w.decode_context) == (576, 32, 31, 528)
    full = Workload(16, 512, 576)  # no generation length: until the cache is full
    assert (full.generated, full.decode_steps, full.decode_context) == (64, 63, 544)
    near_end = Workload.for_prompts(1, spec.context_length - 8, 32, spec)
    assert near_end.generated == 8  # the context cuts max_new_tokens short


def test_chunking_bounds_prefill_memory(tiny_model):
    spec, work = tiny_model.spec, Workload(4, 256, 320)
    plan = policies.all_accelerator(spec.n_layers)
    need = [estimate(plan.with_prefill_chunk(c), spec, work).activations for c in (None, 64, 16)]
    assert need[0] > need[1] > need[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_proxy_sizing_follows_a_deep_segment(devices, dtype):
    """Sizing by proxy (one middle layer, plus the measured growth of each further one) gives
    the temporaries of the whole 8-layer segment within 1 %, whether they grow with depth (half
    precision on XLA:CPU: float32 copies of every weight) or not; exact sizing is the
    executable's own figure."""
    spec = ModelSpec(name="deep", n_layers=8, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                     d_ff=704, vocab_size=1024, context_length=512, dtype=dtype)
    programs = Programs(spec, devices)
    whole = split_segments(ExecutionPlan.all_accelerator(8), "prefill")[0]
    short = proxy(whole)
    assert len({layer for layer, _ in short.ops if layer is not None}) == 3 < 8
    assert programs.sizing_segments(whole, exact=False)[0] == short
    for B, T, S in ((1, 1, 256), (2, 128, 256)):
        full = programs.compiled(whole, B, T, S).memory_analysis().temp_size_in_bytes
        assert programs.temp_bytes(whole, B, T, S, exact=True) == full
        by_proxy = programs.temp_bytes(whole, B, T, S, exact=False)
        assert abs(by_proxy - full) <= 0.01 * full, (B, T, S, by_proxy, full)


def test_accelerator_peak_of_a_run_equals_the_estimate(tiny_model):
    """The accountant applies the schedule with the real arrays' sizes: the peak of a real
    run equals the dry run's, for every acceptance plan."""
    from test_executor import B, S, T, run_plan

    for plan in PLANS.values():
        need = estimate(plan, tiny_model.spec, Workload(B, T, S)).accelerator
        ex, _ = run_plan(tiny_model, plan, discover(accelerator_memory=need))
        assert ex.accountant.peak == need, plan.name
        if any(s.device == ACCELERATOR for s in ex.segments["decode"]):
            assert need > 0


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_instructions_carry_their_data_flow_edges(tiny_model, micro_batches):
    """Every copy depends on the launches that wrote what it copies, every launch on the
    launches that wrote what it reads (through a copy or not), on its segment's staged
    weights and on the stream's last wait, and every wait on the last launch of its
    segment: the edges the executor's timeline and the simulator take from the Schedule."""
    for plan in PLANS.values():
        for phase in ("prefill", "decode"):
            schedule = compile_schedule(plan, tiny_model.spec, phase, 2, 4, 64, None,
                                        micro_batches)
            wrote: dict[tuple[str, int], int] = {}
            last_launch, stage, wait = {}, {}, None
            for k, ins in enumerate(schedule.instructions):
                assert all(d < k for d in ins.deps)
                m = ins.micro
                if ins.kind == MOVE:
                    assert set(ins.deps) == {wrote[(n, m)] for n in ins.names if (n, m) in wrote}
                elif ins.kind == LAUNCH:
                    seg = schedule.segments[ins.segment]
                    assert {wrote[(n, m)] for n in seg.reads if (n, m) in wrote} <= set(ins.deps)
                    if seg.streams:
                        assert stage[ins.segment] in ins.deps
                        assert wait is None or wait in ins.deps
                    wrote.update({(n, m): k for n in seg.writes})
                    last_launch[ins.segment] = k
                elif ins.kind == STAGE:
                    stage[ins.segment] = k
                elif ins.kind == WAIT:
                    assert ins.deps == (last_launch[ins.segment],)
                    wait = k
