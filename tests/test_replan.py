"""Plans that follow the context (``hx.planner.replan``): the engine switches between decode
steps and the tokens do not change; the planner's schedule is priced as its parts."""

import dataclasses

import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.models.spec import PRESETS
from hx.plan import ExecutionPlan, Stint, recompute_consistent
from hx.planner import policies
from hx.planner.hardware import hardware_profile
from hx.planner.replan import plan_schedule, switch_seconds, windows
from hx.planner.simulator import predict, predict_run
from hx.sampling import SamplingParams
from hx.timeline import Timeline
from hx.workload import Workload

from plans import kv_host_odd


def forced_every_8(n_layers: int) -> list[Stint]:
    """A different plan every 8 decode steps: caches streamed with recompute, on the host
    in odd layers, weights streamed with host attention, all on the accelerator, back."""
    plans = [policies.kv_streamed(n_layers, 5), kv_host_odd(n_layers),
             policies.stream_all(n_layers), ExecutionPlan.all_accelerator(n_layers),
             policies.kv_streamed(n_layers, 5, weights_streamed=False)]
    return [Stint(8 * i, plan) for i, plan in enumerate(plans)]


def test_switching_every_8_tokens_keeps_the_tokens(tiny_model):
    prompts = [[5, 9, 13, 200, 7, 7, 42], [300, 301, 302]]
    sampling = SamplingParams(max_new_tokens=40)
    n = tiny_model.spec.n_layers
    want = Engine(tiny_model, ExecutionPlan.all_accelerator(n)).generate_ids(prompts, sampling)
    stints = recompute_consistent(forced_every_8(n))
    assert stints[0].plan.recompute(0) == 5 and stints[4].plan.recompute(0) == 0
    engine = Engine(tiny_model, stints=stints)
    got = engine.generate_ids(prompts, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert engine.plan_log == [(s.start, s.plan.name) for s in stints]
    # a second run starts under the first plan again
    again = engine.generate_ids(prompts, SamplingParams(max_new_tokens=12))
    assert [c.token_ids for c in again] == [c.token_ids[:12] for c in want]
    assert engine.plan_log == [(s.start, s.plan.name) for s in stints[:2]]
    # caches released, every plan's resident weights placed once at a time
    assert engine.accountant.in_use == engine.accountant.by_owner()["weights"]


def test_a_switch_moves_out_what_leaves_the_accelerator_before_anything_arrives(
        tiny_model, monkeypatch):
    """All on the accelerator, then stream-all (weights streamed, caches on the host): when
    the new executor starts placing, no weight or cache of the old plan is still in
    accelerator memory (a switch holds what one plan holds, not both)."""
    import jax

    from hx import executor as executor_module

    n = tiny_model.spec.n_layers
    earlier = jax.live_arrays()  # other tests' arrays in this process: held, so ids stay theirs
    others = {id(a) for a in earlier}
    engine = Engine(tiny_model, stints=[Stint(0, ExecutionPlan.all_accelerator(n)),
                                        Stint(3, policies.stream_all(n))])
    device = engine.executor.devices.accelerator.device
    seen, build = [], executor_module.Executor.__init__

    def watched(self, *args, **kwargs):
        seen.append(sum(a.nbytes for a in jax.live_arrays() if a.devices() == {device}
                        and a.sharding.memory_kind == "device" and id(a) not in others))
        build(self, *args, **kwargs)

    monkeypatch.setattr(executor_module.Executor, "__init__", watched)
    out = engine.generate_ids([[5, 9, 13], [7, 8]], SamplingParams(max_new_tokens=6))
    assert engine.plan_log == [(0, "all-accelerator"), (3, "stream-all")]
    weights = tiny_model.spec.weight_bytes
    assert len(seen) == 1 and seen[0] < weights / 10, (seen, weights)
    assert all(len(c.token_ids) == 6 for c in out)


def test_recompute_after_a_plan_that_kept_no_h_is_refused(tiny_model):
    n = tiny_model.spec.n_layers
    stints = [Stint(0, ExecutionPlan.all_accelerator(n)), Stint(4, policies.kv_streamed(n, 5))]
    with pytest.raises(HxError, match="kept no activations h"):
        Engine(tiny_model, stints=stints)


def test_switch_cost_counts_the_bytes_that_change_homes():
    spec = PRESETS["llama2-7b"].replace(dtype="float16", n_layers=4)
    profile = hardware_profile("a10g")
    workload = Workload(4, 512, 1024, new_tokens=512)
    acc, stream = ExecutionPlan.all_accelerator(4), policies.stream_all(4)
    assert switch_seconds(acc, acc, spec, profile, workload, 600) == 0
    weights = sum(spec.op_weight_bytes(op) for op in ("Q", "K", "V", "OUT", "MLP1", "MLP2"))
    kv = 2 * 600 * 4 * spec.n_kv_heads * spec.head_dim * 2
    # stream-all: weights leave the accelerator (D2H), caches go to the host (D2H)
    down = switch_seconds(acc, stream, spec, profile, workload, 600)
    copies = 4 * 6 + 2 + 4  # the layers' weighted ops, EMBED and HEAD, the caches
    moved = 4 * (weights + kv) + spec.op_weight_bytes("EMBED") + spec.op_weight_bytes("HEAD")
    assert down == pytest.approx(copies * profile.transfer_latency
                                 + moved / profile.d2h_bandwidth)
    back = switch_seconds(stream, acc, spec, profile, workload, 600)
    assert back == pytest.approx(copies * profile.transfer_latency
                                 + moved / profile.h2d_bandwidth)


def test_a_schedule_of_one_window_is_the_fixed_plan():
    spec = PRESETS["llama2-7b"].replace(dtype="float16", n_layers=4)
    profile = hardware_profile("t4")
    workload = Workload(1, 256, 256 + 64, new_tokens=64)
    plan = policies.stream_all(4)
    schedule = plan_schedule(spec, profile, None, workload, 1000, lambda w: plan)
    assert schedule.stints == (Stint(0, plan),) and schedule.fixed[0] == plan
    run = predict_run(plan, spec, profile, workload)
    (window,) = windows(workload, 1000)
    assert window.steps == workload.decode_steps
    step = predict(plan, spec, profile, "decode", 1, 1, workload.cache_slots,
                   window.context).seconds
    assert schedule.predicted_s == pytest.approx(run.ttft_s + window.steps * step)


def test_the_schedule_switches_only_where_it_pays():
    """Two candidate plans, one per window: the dynamic program takes the second only if its
    gain over the rest of the run beats the switch, and never does worse than either fixed."""
    spec = PRESETS["llama2-7b"].replace(dtype="float16", n_layers=4)
    profile = hardware_profile("t4")
    workload = Workload(1, 256, 256 + 512, new_tokens=512)
    a, b = policies.stream_all(4), dataclasses.replace(policies.layer_split(4, 2), name="split")
    plans = iter([a, b])
    schedule = plan_schedule(spec, profile, None, workload, 256, lambda w: next(plans))
    fixed = {p.name: predict_run(p, spec, profile, workload).total_s for p in (a, b)}
    assert schedule.predicted_s <= schedule.fixed[1] + 1e-9
    assert schedule.fixed[1] == pytest.approx(min(fixed.values()), rel=0.05)


def test_the_timeline_shows_each_switch(tiny_model):
    n = tiny_model.spec.n_layers
    stints = recompute_consistent(forced_every_8(n))
    timeline = Timeline()
    engine = Engine(tiny_model, stints=stints, timeline=timeline)
    engine.generate_ids([[5, 9, 13]], SamplingParams(max_new_tokens=40))
    timeline.wait()
    switches = [e for e in timeline.events if e.name.startswith("re-plan to ")]
    assert [(e.args["decode_step"], e.name[len("re-plan to "):]) for e in switches] == [
        (s.start, s.plan.name) for s in stints[1:]]
    assert all(e.end >= e.start for e in switches)
