"""ExecutionPlan as data: builders, JSON round trip, validation."""

import json

import pytest

from hx.devices import ACCELERATOR, HOST
from hx.errors import HxError
from hx.models.spec import LAYER_OPS
from hx.plan import ExecutionPlan

from test_executor import alternating


def test_uniform_builders():
    plan = ExecutionPlan.uniform(4, ("SCORE", "MLP1"))
    assert plan.decode.device(2, "SCORE") == HOST and plan.decode.device(2, "Q") == ACCELERATOR
    assert plan.kv == (HOST,) * 4
    assert all(d == HOST for _, _, d in ExecutionPlan.all_host(4).prefill.sequence())
    assert all(d == ACCELERATOR for _, _, d in ExecutionPlan.all_accelerator(4).decode.sequence())


@pytest.mark.parametrize("plan", [ExecutionPlan.uniform(3, ("SCORE",)), alternating(3)])
def test_json_round_trip(tmp_path, plan):
    plan.save(tmp_path / "p.json")
    assert ExecutionPlan.load(str(tmp_path / "p.json"), 3) == plan
    assert ExecutionPlan.from_json(json.loads(json.dumps(plan.to_json())), 3) == plan


def test_shorthand_json():
    plan = ExecutionPlan.from_json({"decode": {"layers": {"MLP1": "host"}}, "kv": "host"}, 2)
    assert plan.prefill == plan.decode
    assert [plan.decode.device(1, op) for op in LAYER_OPS].count(HOST) == 1
    assert plan.kv == (HOST, HOST)


@pytest.mark.parametrize("data, match", [
    ({"decode": {"layers": {"MLP3": "host"}}}, "unknown ops"),
    ({"decode": {"layers": {"MLP1": "gpu"}}}, "device 'gpu'"),
    ({"decode": {"layers": [{}] * 2}}, "has 2 layers"),
    ({"decode": {}, "kv": ["host"]}, "KV homes"),
    ([1, 2], "JSON object"),
])
def test_malformed_plans(data, match):
    with pytest.raises(HxError, match=match):
        ExecutionPlan.from_json(data, 3)


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
