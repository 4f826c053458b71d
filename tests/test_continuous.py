"""Iteration-level scheduling: each prompt's tokens equal a run of it alone, rows are refilled
the step they free, caches are reframed both ways, and memory stays within the estimate."""

import numpy as np
import pytest

from hx import continuous, scheduler
from hx.continuous import ContinuousBatcher, run_slots
from hx.devices import discover
from hx.generate import Engine
from hx.memory import estimate
from hx.sampling import SamplingParams
from hx.workload import new_tokens

from plans import kv_host_odd
from hx.planner import policies

MAX_NEW = 24
PLANS = {"all-accelerator": policies.all_accelerator(3), "stream-all": policies.stream_all(3),
         "kv-host-odd": kv_host_odd(3), "kv-streamed": policies.kv_streamed(3, 6, layers=(0, 2))}


@pytest.fixture(scope="module")
def prompts(tiny_model):
    rng = np.random.default_rng(4)
    return [[int(t) for t in rng.integers(5, 4000, n)] for n in (3, 70, 12, 41, 5, 90, 29, 8, 55)]


@pytest.fixture(scope="module")
def stops(tiny_model, prompts):
    """Stop tokens that end prompts after different numbers of tokens: a token some prompts
    produce early, taken from greedy runs alone."""
    engine = Engine(tiny_model)
    runs = [engine.generate_ids([p], SamplingParams(max_new_tokens=MAX_NEW))[0].token_ids
            for p in prompts[:4]]
    return tuple(sorted({runs[0][3], runs[1][9], runs[2][16]}))


def spy_decisions(monkeypatch):
    """Every decision ``hx.scheduler.schedule`` hands the runner, in order."""
    decisions = []

    def spy(state):
        decisions.append(scheduler.schedule(state))
        return decisions[-1]

    monkeypatch.setattr(continuous, "schedule", spy)
    return decisions


def joins(decisions):
    """Prompts per join prefill."""
    return [len(d.requests) for d in decisions if isinstance(d, scheduler.Join)]


@pytest.mark.parametrize("name", list(PLANS))
def test_each_prompt_gets_what_it_gets_alone(tiny_model, prompts, stops, name, monkeypatch):
    plan = PLANS[name]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, stop_ids=stops)
    engine = Engine(tiny_model, plan)
    alone = [engine.generate_ids([p], greedy)[0] for p in prompts]
    lengths = {len(c.token_ids) for c in alone}
    assert len(lengths) >= 3  # rows end at different steps
    decisions = spy_decisions(monkeypatch)
    finished = []
    real_block = engine.executor.run_block
    rows_per_step = []  # (micro-batches, rows) of each decode step

    def spy(phase, tokens, *rest):
        if phase == "decode":
            rows_per_step.append((len(tokens), len(tokens[0])))
        return real_block(phase, tokens, *rest)

    monkeypatch.setattr(engine.executor, "run_block", spy)
    got = ContinuousBatcher(engine, 2, 2).run(prompts, greedy,
                                              on_finish=lambda i, c: finished.append(i))
    assert [c.token_ids for c in got] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in alone]
    assert sorted(finished) == list(range(len(prompts)))
    reframes = [r.slots for d in decisions if d is not None for r in d.reframes]
    assert min(reframes) < 0 < max(reframes)  # caches reframed towards both ends
    # a row that ends is refilled at once, and once no prompt waits micro-batches shrink to
    # their rows in use: no step computes a row that has ended
    decoded = sum(len(c.token_ids) + (c.finish_reason == "stop") - 1 for c in alone)
    assert sum(n * b for n, b in rows_per_step) == decoded
    assert rows_per_step[0] == (2, 2) and min(b for _, b in rows_per_step) == 1


def test_sampled_rows_draw_what_they_draw_alone(tiny_model, prompts):
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=1)
    seeds = [100 + i for i in range(len(prompts))]
    engine = Engine(tiny_model, PLANS["stream-all"])
    alone = [engine.generate_ids([p], sampled, seeds=[s])[0].token_ids
             for p, s in zip(prompts, seeds)]
    got = ContinuousBatcher(engine, 3, 1).run(prompts, sampled, seeds)
    assert [c.token_ids for c in got] == alone
    assert len({tuple(t) for t in alone}) == len(prompts)


@pytest.mark.parametrize("block", [(2, 2, None), (4, 1, 2)])
def test_the_run_fits_its_estimate(tiny_model, prompts, block, monkeypatch):
    """Under a budget of exactly the estimate of the run's workload (caches of every row of
    the block, a spare group, the reframing temporary, prefill activations of the largest
    join group), the run completes with the tokens each prompt gets alone, and no join
    prefills more prompts than ``join_max``."""
    B, N, join_max = block
    plan = PLANS["kv-host-odd"]
    engine = Engine(tiny_model, plan)
    greedy = SamplingParams(max_new_tokens=MAX_NEW)
    alone = [engine.generate_ids([p], greedy)[0].token_ids for p in prompts]
    batcher = ContinuousBatcher(engine, B, N, join_max=join_max)
    spec = tiny_model.spec
    slots = run_slots([len(p) for p in prompts],
                      [new_tokens(len(p), MAX_NEW, spec) for p in prompts], spec, batcher.chunk)
    need = estimate(plan, spec, batcher.workload(slots)).accelerator
    engine = Engine(tiny_model, plan, discover(accelerator_memory=need))
    decisions = spy_decisions(monkeypatch)
    got = ContinuousBatcher(engine, B, N, join_max=join_max).run(prompts, greedy)
    assert [c.token_ids for c in got] == alone
    assert 0 < engine.accountant.peak <= need
    assert max(joins(decisions)) == (join_max or B)


def test_a_smaller_join_group_needs_less_memory(tiny_model):
    """Prefill runs only on join groups: capping them at 1 row of a 4-row block sizes
    prefill at 1 row, so a block whose peak was a 4-row prefill needs less, with 1 spare
    cache row."""
    plan = policies.stream_all(3).with_prefill_chunk(64)
    engine = Engine(tiny_model, plan)
    workloads = {cap: ContinuousBatcher(engine, 4, join_max=cap).workload(128) for cap in (1, 4)}
    need = {cap: estimate(plan, tiny_model.spec, w) for cap, w in workloads.items()}
    assert need[4].phase == "prefill"
    assert need[1].accelerator < need[4].accelerator
    assert workloads[1].rows == 5


def test_token_limits_per_prompt(tiny_model, prompts, monkeypatch):
    """Each prompt stops at its own limit, in a static batch and with iteration-level
    scheduling alike (joining at once, or waiting for 3 free rows: fewer, larger join
    prefills), with the tokens it gets alone."""
    engine = Engine(tiny_model)
    limits = [1 + (7 * i) % 20 for i in range(len(prompts))]
    greedy = SamplingParams(max_new_tokens=MAX_NEW)
    alone = [engine.generate_ids([p], SamplingParams(max_new_tokens=n))[0].token_ids
             for p, n in zip(prompts, limits)]
    static = engine.generate_ids(prompts, greedy, max_new_tokens=limits)
    groups, refilled = {}, {}
    for k in (1, 3):
        decisions = spy_decisions(monkeypatch)
        refilled[k] = ContinuousBatcher(engine, 4, join_min=k).run(
            prompts, greedy, max_new_tokens=limits)
        groups[k] = joins(decisions)
    for got in (static, *refilled.values()):
        assert [c.token_ids for c in got] == alone
        assert {c.finish_reason for c in got} == {"length"}
    assert sum(groups[1]) == sum(groups[3]) == len(prompts)
    assert len(groups[3]) < len(groups[1])
