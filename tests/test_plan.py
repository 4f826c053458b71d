"""ExecutionPlan as data: builders, policies, JSON round trip, validation."""

import json

import pytest

from hx.devices import ACCELERATOR, HOST
from hx.errors import HxError
from hx.models.spec import LAYER_OPS
from hx.plan import RESIDENT, STREAMED, ExecutionPlan
from hx.planner import policies

from plans import acceptance_plans


def test_uniform_builders():
    plan = ExecutionPlan.uniform(4, ("SCORE", "MLP1"))
    assert plan.decode.get(2, "SCORE") == HOST and plan.decode.get(2, "Q") == ACCELERATOR
    assert plan.kv == (HOST,) * 4
    assert plan.weights.get(1, "MLP1") == HOST and plan.weights.get(1, "MLP2") == RESIDENT
    assert all(d == HOST for _, _, d in ExecutionPlan.all_host(4).prefill.sequence())
    assert all(d == ACCELERATOR for _, _, d in ExecutionPlan.all_accelerator(4).decode.sequence())


def test_policies():
    s = policies.stream_all(4)
    assert all(s.weights.get(i, op) == STREAMED for i in range(4) for op in ("Q", "MLP2"))
    assert s.kv == (HOST,) * 4 and s.decode.get(0, "SCORE") == HOST
    split = policies.layer_split(4, 3)
    assert [split.decode.get(i, "MLP1") for i in range(4)] == [HOST] + [ACCELERATOR] * 3
    assert split.kv == (HOST,) + (ACCELERATOR,) * 3 and split.decode.head == HOST
    assert policies.layer_split(4, 5).decode.head == ACCELERATOR
    with pytest.raises(HxError, match="between 0 and 5"):
        policies.layer_split(4, 6)


@pytest.mark.parametrize("plan", list(acceptance_plans(3, (1, 4)).values()),
                         ids=lambda p: p.name)
def test_json_round_trip(tmp_path, plan, tiny_model):
    plan.validate(tiny_model.spec)
    plan.save(tmp_path / "p.json")
    assert ExecutionPlan.load(str(tmp_path / "p.json"), 3) == plan
    assert ExecutionPlan.from_json(json.loads(json.dumps(plan.to_json())), 3) == plan


def test_shorthand_json():
    plan = ExecutionPlan.from_json({"decode": {"layers": {"MLP1": "host"}},
                                    "weights": {"layers": {"Q": "streamed"}}}, 2)
    assert plan.prefill == plan.decode
    assert [plan.decode.get(1, op) for op in LAYER_OPS].count(HOST) == 1
    assert plan.weights.get(0, "Q") == STREAMED and plan.weights.get(0, "MLP1") == HOST
    assert plan.kv == (ACCELERATOR, ACCELERATOR)


@pytest.mark.parametrize("data, match", [
    ({"decode": {"layers": {"MLP3": "host"}}}, "unknown ops"),
    ({"decode": {"layers": {"MLP1": "gpu"}}}, "device 'gpu'"),
    ({"decode": {"layers": [{}] * 2}}, "has 2 layers"),
    ({"decode": {}, "kv": ["host"]}, "KV homes"),
    ({"decode": {}, "weights": {"layers": {"Q": "tape"}}}, "weight home 'tape'"),
    ([1, 2], "JSON object"),
])
def test_malformed_plans(data, match):
    with pytest.raises(HxError, match=match):
        ExecutionPlan.from_json(data, 3)


@pytest.mark.parametrize("data, match", [
    ({"decode": {}, "kv": "host"}, "SCORE must run where its KV cache is"),
    ({"decode": {"layers": {"MLP1": "host"}}, "weights": {"layers": {"MLP1": "resident"}}},
     "host ops need weights at home on the host"),
])
def test_inconsistent_plans(data, match, tiny_model):
    with pytest.raises(HxError, match=match):
        ExecutionPlan.from_json(data, 3).validate(tiny_model.spec)


def test_plan_file_errors(tmp_path, tiny_model):
    with pytest.raises(HxError, match="not found"):
        ExecutionPlan.load(str(tmp_path / "nope.json"), 3)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(HxError, match="not valid JSON"):
        ExecutionPlan.load(str(tmp_path / "bad.json"), 3)
    with pytest.raises(HxError, match="the model has 3"):
        ExecutionPlan.uniform(5).validate(tiny_model.spec)
    with pytest.raises(HxError, match="unknown ops"):
        ExecutionPlan.uniform(3, ("ATTN",))
