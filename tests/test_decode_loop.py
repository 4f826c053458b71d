"""Several decode steps a launch (``hx.decode_loop``) draw the tokens step-by-step decode draws.

Where a plan's decode is one host segment holding every weight and KV cache, a static batch runs
up to ``Engine.loop_steps`` steps in one XLA program, sampling in it. Each step runs the same
segment function and sampler with each row's own (seed, token index), so a run's tokens and
finish reasons equal the step-by-step run's: greedy and sampled, rows of different prompt lengths
and token limits, a stop token ending a row in the middle of a launch, launch boundaries at
different steps (1, 3 and 16 steps a launch), over XLA's host products and over the ggml graph.
"""

import dataclasses

import pytest

from hx.generate import Engine
from hx.host_compute import ggml_kernel
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.sampling import SamplingParams

PROMPTS = [[100, 200, 300, 400, 500, 600, 700], [11, 12], [5, 6, 7, 8]]
LIMITS = [13, 20, 7]
SAMPLINGS = {"greedy": SamplingParams(max_new_tokens=20),
             "top-k": SamplingParams(max_new_tokens=20, temperature=0.9, top_k=20, seed=5),
             "top-p": SamplingParams(max_new_tokens=20, temperature=1.3, top_p=0.8, seed=2)}


def models(tiny_model):
    """The tiny model over XLA's host products, and over ggml's graph where ggml is built."""
    yield "xla", tiny_model
    if ggml_kernel.unavailable() is None:
        yield "ggml", dataclasses.replace(tiny_model,
                                          spec=tiny_model.spec.replace(host_matmul="ggml"))


def run(engine: Engine, steps: int, sampling: SamplingParams, prompts=PROMPTS,
        limits=LIMITS) -> list[tuple[list[int], str]]:
    engine.loop_steps = steps
    return [(c.token_ids, c.finish_reason)
            for c in engine.generate_ids(prompts, sampling, max_new_tokens=limits)]


@pytest.mark.parametrize("name", SAMPLINGS)
def test_a_launch_of_steps_draws_what_steps_one_by_one_draw(tiny_model, devices, name):
    sampling = SAMPLINGS[name]
    for holding, model in models(tiny_model):
        engine = Engine(model, policies.all_host(model.spec.n_layers), devices)
        one_by_one = run(engine, 1, sampling)
        assert [len(t) for t, _ in one_by_one] == LIMITS  # no stop token: each its limit
        for steps in (3, 16):
            assert run(engine, steps, sampling) == one_by_one, (holding, steps)


def test_a_stop_token_ends_its_row_inside_a_launch(tiny_model, devices):
    """A row stops at its stop token although the launch goes on for the others; the launch
    ends once every row has ended."""
    engine = Engine(tiny_model, policies.all_host(tiny_model.spec.n_layers), devices)
    free = run(engine, 1, SAMPLINGS["greedy"])
    stop = free[1][0][4]  # the second row's fifth token
    sampling = dataclasses.replace(SAMPLINGS["greedy"], stop_ids=(stop,))
    one_by_one = run(engine, 1, sampling)
    assert one_by_one[1] == (free[1][0][:free[1][0].index(stop)], "stop")
    launches = []
    executor = engine.executor
    original = executor.decode_steps

    def counted(*args, **kwargs):
        tokens, caches = original(*args, **kwargs)
        launches.append(tokens.shape[1])
        return tokens, caches

    executor.decode_steps = counted
    assert run(engine, 16, sampling) == one_by_one
    # a row that drew d tokens took d - 1 decode steps (its first comes from prefill), a
    # stop token drawn but not kept: the launches end with the longest row
    drawn = [len(t) + (reason == "stop") for t, reason in one_by_one]
    assert launches == [16, max(drawn) - 1 - 16] if max(drawn) > 17 else launches == [
        max(drawn) - 1]


def test_only_a_plan_held_on_the_host_loops(tiny_model, devices):
    """Decode loops where it is one host segment; a plan with accelerator ops, or any weight
    or KV cache elsewhere, steps one by one (its copies and accounting are per step)."""
    n = tiny_model.spec.n_layers
    assert Engine(tiny_model, policies.all_host(n), devices).executor.loops(1, 64)
    for plan in (ExecutionPlan.uniform(n, ()),
                 ExecutionPlan.uniform(n, ("SCORE",))):
        assert not Engine(tiny_model, plan, devices).executor.loops(1, 64)
