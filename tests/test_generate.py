"""Generation loop: stopping, lengths, batching, context limits (tiny model)."""

import numpy as np
import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.plan import ExecutionPlan
from hx.sampling import SamplingParams

from numpy_reference import logits_np


def test_greedy_continuation_matches_float64(tiny_model):
    """Each generated token is the float64 argmax given the prompt and earlier tokens."""
    prompt = [100, 200, 300, 400, 500]
    c = Engine(tiny_model).generate_ids([prompt], SamplingParams(max_new_tokens=6))[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    seq = list(prompt)
    for tok in c.token_ids:
        assert tok == int(np.argmax(logits_np(tiny_model.spec, tiny_model.params, seq)[-1]))
        seq.append(tok)


def test_a_new_generation_length_compiles_nothing_new(tiny_model):
    """The generation length is a planning input, not a shape: 6 and 9 new tokens after a
    5-token prompt share the padded prompt and the cache, so the second run compiles nothing."""
    engine = Engine(tiny_model)
    prompt = [100, 200, 300, 400, 500]
    first = engine.generate_ids([prompt], SamplingParams(max_new_tokens=6))[0]
    second = engine.generate_ids([prompt], SamplingParams(max_new_tokens=9))[0]
    assert first.compile_s > 0 and second.compile_s == 0
    assert second.token_ids[:6] == first.token_ids


def test_batch_equals_one_by_one(tiny_model):
    engine = Engine(tiny_model, ExecutionPlan.uniform(tiny_model.spec.n_layers, ("SCORE",)))
    prompts = ["Hi", "A much longer prompt with quite a few more tokens than the first one",
               "Numbers: 1 2 3"]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=5)
    together = engine.generate(prompts, sampling)
    for p, c in zip(prompts, together):
        alone = engine.generate([p], sampling)[0]
        assert alone.token_ids == c.token_ids
        assert c.prompt_tokens == len(tiny_model.tokenizer.encode(p))


def test_stop_token_ends_a_row(tiny_model):
    engine = Engine(tiny_model)
    prompt = [[10, 20, 30]]
    free = engine.generate_ids(prompt, SamplingParams(max_new_tokens=5))[0].token_ids
    stopped = engine.generate_ids(prompt, SamplingParams(max_new_tokens=5,
                                                         stop_ids=(free[2],)))[0]
    assert stopped.token_ids == free[:free.index(free[2])]
    assert stopped.finish_reason == "stop"


def test_context_end_limits_new_tokens(tiny_model):
    n_ctx = tiny_model.spec.context_length
    c = Engine(tiny_model).generate_ids([[5] * (n_ctx - 3)],
                                        SamplingParams(max_new_tokens=50))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "context"


def test_prompt_errors(tiny_model):
    engine = Engine(tiny_model)
    with pytest.raises(HxError, match="context is 256 tokens"):
        engine.generate_ids([[1] * 256])
    with pytest.raises(HxError, match="empty"):
        engine.generate([""])
    with pytest.raises(HxError, match="too small"):
        engine.generate_ids([[1] * 20], SamplingParams(max_new_tokens=40), cache_slots=32)


def test_a_row_is_reported_the_moment_it_stops(tiny_model, monkeypatch):
    """``on_finish`` hands over a row at its stop token, before the batch's other rows end
    (a batch run writes it then: a later crash loses nothing of it)."""
    engine = Engine(tiny_model)
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    free = engine.generate_ids(prompts, SamplingParams(max_new_tokens=6))
    stop = next(t for t in free[0].token_ids[1:] if t not in free[1].token_ids)
    cut = free[0].token_ids.index(stop)
    real, decodes = engine.executor.run_block, []

    def crash_late(phase, *args):
        decodes.append(phase)
        if decodes.count("decode") > cut + 1:
            raise KeyboardInterrupt
        return real(phase, *args)

    monkeypatch.setattr(engine.executor, "run_block", crash_late)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        engine.generate_ids(prompts, SamplingParams(max_new_tokens=6, stop_ids=(stop,)),
                            on_finish=lambda r, c: seen.append((r, c)))
    assert [(r, c.token_ids, c.finish_reason) for r, c in seen] == [
        (0, free[0].token_ids[:cut], "stop")]


def test_an_engine_without_a_plan_plans_for_its_budget(tiny_model, monkeypatch, tmp_path):
    """``Engine(model, devices=...)`` makes the plan ``hx generate`` makes by default (``auto``
    for one prompt of up to 512 tokens and 512 new ones), not all-accelerator: at a quarter of
    the weights, where all-accelerator is refused, it generates what all-accelerator does with
    room (no saved profile here: the largest layer split)."""
    from hx.devices import discover
    from hx.generate import default_workload
    from hx.planner import policies

    monkeypatch.setattr("hx.planner.profile.DEFAULT_PATH", str(tmp_path / "profile.json"))
    spec, prompt = tiny_model.spec, [100, 200, 300, 400, 500]
    sampling = SamplingParams(max_new_tokens=6)
    devices = discover(accelerator_memory=spec.weight_bytes // 4)
    with pytest.raises(HxError, match="does not fit"):
        Engine(tiny_model, ExecutionPlan.all_accelerator(spec.n_layers),
               devices).generate_ids([prompt], sampling)
    engine = Engine(tiny_model, devices=devices)
    assert engine.plan == policies.build("auto", spec, devices, default_workload(spec))
    assert engine.plan.name.startswith("layer-split")
    assert engine.generate_ids([prompt], sampling)[0].token_ids == \
        Engine(tiny_model).generate_ids([prompt], sampling)[0].token_ids
