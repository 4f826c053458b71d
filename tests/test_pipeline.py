"""hx.pipeline: a model cut into pipeline stages -- the stages' models, plans and devices --
and one stage's pass-through ends against the whole model on one device."""

import dataclasses

import jax
import numpy as np
import pytest

from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.executor import Executor
from hx.models.layers import Step
from hx.models.decoder import init_params
from hx.models.spec import EMBED, HEAD, LAYER_OPS, PRESETS, SCORE, ModelSpec
from hx.models.tensors import activation_shape
from hx.pipeline import Pipeline, check_stages, stage_devices, stage_params, with_budgets
from hx.plan import ExecutionPlan, Placement, stage_layers
from hx.planner import policies
from hx.workload import Workload

TINY = ModelSpec(name="tiny", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 d_ff=96, vocab_size=256, context_length=128, tie_embeddings=True)


def _odd_host_kv(n: int) -> ExecutionPlan:
    return ExecutionPlan.from_placement(Placement(ACCELERATOR, tuple(
        tuple(HOST if op == SCORE and i % 2 else ACCELERATOR for op in LAYER_OPS)
        for i in range(n)), HOST), name="kv-host-odd")


@pytest.mark.parametrize("pp", [2, 3])
def test_a_plan_cut_into_stages_joins_back_into_itself(pp):
    """``ExecutionPlan.stage`` then ``joined`` is the identity; a middle stage's EMBED and
    HEAD run where its first and last ops do."""
    for plan in (_odd_host_kv(12), policies.stream_all(12).with_recompute(3),
                 policies.layer_split(12, 5)):
        cuts = stage_layers(12, pp)
        parts = [plan.stage(r, s == 0, s == pp - 1) for s, r in enumerate(cuts)]
        assert ExecutionPlan.joined(parts, plan.name) == plan
        middle = parts[1] if pp == 3 else parts[0]
        layers = cuts[1] if pp == 3 else cuts[0]
        assert middle.n_layers == len(layers)
        assert middle.decode.head == plan.decode.get(layers.stop - 1, "MLP2")
        if pp == 3:
            assert middle.decode.embed == plan.decode.get(layers.start, "Q")


def test_a_stage_passes_the_residual_stream_through_its_ends():
    """A middle stage's spec holds no table; its input (``tokens``) and output (``logits``)
    are x (B, T, D) in the model's dtype; the stages' weights are the model's, the tied table
    once more."""
    spec = PRESETS["smollm2-135m"]
    middle = spec.pipeline_stage(range(10, 20), False, False)
    assert middle.op_weight_shapes(EMBED) == {} and middle.op_weight_shapes(HEAD) == {}
    assert activation_shape(middle, "tokens", 2, 5) == ((2, 5, spec.d_model), spec.dtype)
    assert activation_shape(middle, "logits", 2, 5) == ((2, 5, spec.d_model), spec.dtype)
    last = spec.pipeline_stage(range(20, 30), False, True)
    assert activation_shape(last, "logits", 2, 5) == ((2, spec.vocab_size), "float32")


def _two_accelerators():
    """Devices whose accelerator group is two devices (this process has one emulated
    accelerator: the host's device stands in as the second; the suite's several-device runs
    are subprocesses, tests/test_sharding.py)."""
    devices = discover()
    acc = devices.accelerator
    return dataclasses.replace(devices, accelerator=dataclasses.replace(
        acc, group=(acc.device, devices.host.device)))


def test_stage_devices_split_the_accelerators_and_the_host():
    devices = _two_accelerators()
    one, two = stage_devices(devices, 2)
    assert (one.accelerator.device, two.accelerator.device) == devices.accelerator.group
    assert one.accelerator.group == two.accelerator.group == ()
    assert (two.accelerator.capacity, one.host.capacity) == (
        devices.accelerator.capacity, devices.host.capacity // 2)
    assert stage_devices(devices, 1)[0].accelerator.group == devices.accelerator.group
    with pytest.raises(HxError, match="equal groups"):
        stage_devices(devices, 3)


def test_each_stage_is_checked_against_its_own_budget():
    """A budget that holds the second stage's layers and HEAD but not the first stage's,
    which adds EMBED's table: the check names the first stage's plan."""
    spec = TINY.replace(tie_embeddings=False)
    plan, workload = ExecutionPlan.all_accelerator(4), Workload(1, 8, 16)
    free = [discover(), discover()]
    need = [e.accelerator for e in check_stages(spec, plan, free, workload)]
    assert need[0] > 0 and need[1] > 0
    tight = with_budgets(free, [need[0] - 1, need[1]])
    with pytest.raises(HxError, match=r"layers 0-1\].*over by 1 bytes"):
        check_stages(spec, plan, tight, workload)


def test_pipeline_logits_equal_one_executor_with_host_kv_and_streamed_weights():
    """Two stages under stream-all (weights streamed, KV caches and attention on the host)
    against the same plan on one accelerator: prefill and two decode steps' logits agree to
    float32 rounding (the stages run the same programs on the same numbers: exactly equal
    here), and the caches come back per layer, each on its home (both stages on this
    process's one emulated accelerator: the crossing between devices is test_sharding's,
    test_cli's and test_distributed's)."""
    params = jax.tree.map(np.asarray, init_params(TINY, seed=3))
    params[HEAD]["embedding"] = params[EMBED]["embedding"]
    devices = discover()
    tokens = np.array([[5, 9, 13, 200, 7, 7], [0, 0, 1, 2, 3, 4]], np.int32)
    kv_start = np.array([0, 2], np.int32)
    prefill = Step(np.maximum(np.arange(6, dtype=np.int32)[None] - kv_start[:, None], 0),
                   np.int32(0), kv_start)
    plan = policies.stream_all(4)
    outs = []
    for runner in (Executor(TINY, params, plan, discover()),
                   Pipeline(TINY, params, plan, [devices, devices])):
        caches, step, current, got = runner.new_cache(2, 12), prefill, tokens, []
        for i in range(3):
            logits, caches = runner.run("prefill" if i == 0 else "decode", current, step,
                                        caches)
            got.append(np.asarray(logits))
            current = np.argmax(got[-1], -1).astype(np.int32)[:, None]
            step = Step(np.asarray(prefill.positions[:, -1:]) + i + 1, np.int32(6 + i),
                        kv_start)
        outs.append((got, caches))
    (want, _), (got, caches) = outs
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * np.abs(a).max())
    assert len(caches) == 4
    for layer, cache in enumerate(caches):
        want_home = (devices.accelerator.device if plan.kv[layer] == ACCELERATOR
                     else devices.host.device)
        assert cache["k"].devices() == {want_home}, layer


def test_stage_params_renumber_the_layers():
    params = {EMBED: {"e": 1}, HEAD: {"h": 2}, **{f"layer_{i}": {"i": i} for i in range(4)}}
    assert stage_params(params, range(2, 4), False, True) == {
        EMBED: {}, "layer_0": {"i": 2}, "layer_1": {"i": 3}, HEAD: {"h": 2}}
