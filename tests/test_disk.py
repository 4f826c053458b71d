"""The disk tier: weights and KV caches on NVMe are planned and simulated (FlexGen's OPT-175B
setting); the executor runs disk-homed weights (``test_disk_tier``), not KV caches on disk."""

import pytest

from hx.devices import discover
from hx.errors import HxError
from hx.executor import Executor
from hx.memory import estimate
from hx.models.spec import preset
from hx.plan import DISK, ExecutionPlan
from hx.planner import policies
from hx.planner.hardware import hardware_profile
from hx.planner.simulator import predict
from hx.workload import Workload

SPEC = preset("opt-175b:4L").replace(dtype="float16")
WORKLOAD = Workload(8, 128, 256, 2)


def flexgen_175b():
    t4 = hardware_profile("t4")
    devices = discover(accelerator_memory=t4.accelerator_memory, host_memory=t4.host_memory)
    return policies.build("flexgen:0:50:kv-disk", SPEC, devices, WORKLOAD, profile=t4), t4


def test_disk_reads_are_the_plans_disk_bytes():
    """A decode step reads every disk-homed weight once and, per micro-batch, each disk
    layer's KV cache (the positions written before the step: the step's own is computed); the
    step lasts at least those bytes at disk speed."""
    plan, t4 = flexgen_175b()
    homes = [home for _, _, home in plan.weights.sequence()]
    assert DISK in homes and "streamed" in homes and set(plan.kv) == {DISK}
    context = 192
    step = predict(plan, SPEC, t4, "decode", WORKLOAD.batch, 1, WORKLOAD.cache_slots, context,
                   WORKLOAD.micro_batches)
    read = sum(t.nbytes for t in step.tasks if t.resource == "disk")
    weights = sum(SPEC.op_weight_bytes(op) for _, op, home in plan.weights.sequence()
                  if home == DISK)
    kv_token = 2 * SPEC.n_kv_heads * SPEC.head_dim * SPEC.dtype_bytes  # K and V, per layer
    kv = SPEC.n_layers * WORKLOAD.micro_batches * kv_token * WORKLOAD.batch * (context - 1)
    assert read == weights + kv
    assert step.seconds >= read / t4.disk_read_bandwidth
    need = estimate(plan, SPEC, WORKLOAD)
    assert need.disk == weights + SPEC.n_layers * kv_token * WORKLOAD.rows * \
        WORKLOAD.cache_slots


def test_disk_plans_round_trip_and_are_not_executed():
    plan, _ = flexgen_175b()
    assert ExecutionPlan.from_json(plan.to_json(), SPEC.n_layers) == plan
    with pytest.raises(HxError, match="on disk"):
        Executor(SPEC, {}, plan, discover())


def test_a_profile_without_a_disk_tier_refuses_disk_plans():
    plan, _ = flexgen_175b()
    with pytest.raises(HxError, match="no disk tier"):
        predict(plan, SPEC, hardware_profile("a10g"), "decode", 8, 1, 256, 192, 2)
