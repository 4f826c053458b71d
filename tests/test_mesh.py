"""Tensor parallelism priced on one accelerator's machinery (planner/mesh.py): the shard's
bytes against the whole model's, the host's share, the collectives against their formula."""

import math

import pytest

from hx.devices import ACCELERATOR, HOST, discover
from hx.memory import check_fits
from hx.models.spec import EMBED, HEAD, LAYER_OPS, PRESETS, SCORE
from hx.planner.cpsat import plan_cpsat
from hx.errors import HxError
from hx.planner.hardware import hardware_profile, tensor_parallel_profile
from hx.planner.mesh import Interconnect, allreduce_seconds, tensor_parallel
from hx.planner.simulator import op_seconds, predict
from hx.workload import Workload

LINK = Interconnect(bandwidth=20e9, latency=30e-6, source="test")
WEIGHTED = [op for op in LAYER_OPS if op != SCORE]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_shards_hold_the_model_once_norms_on_every_device(tp):
    """Llama-2-70B (8 KV heads) splits evenly: tp shards of each op hold its bytes, but for
    the RMSNorm scales (D each), which every shard holds."""
    spec = PRESETS["llama2-70b"]
    shard = spec.shard(tp)
    norm = spec.d_model * spec.dtype_bytes
    for op in WEIGHTED + [EMBED, HEAD]:
        copies = norm * (tp - 1) if op in ("Q", "MLP1", HEAD) else 0
        assert tp * shard.op_weight_bytes(op) == spec.op_weight_bytes(op) + copies, op
    assert tp * shard.n_kv_heads == spec.n_kv_heads and tp * shard.d_ff == spec.d_ff


def test_uneven_heads_are_padded_per_device_and_grouping_kept():
    spec = PRESETS["smollm2-135m"]  # 9 query heads over 3 KV heads
    two, four = spec.shard(2), spec.shard(4)
    assert (two.n_kv_heads, two.n_heads) == (2, 6)  # 4 KV heads in all, groups of 3 kept
    assert (four.n_kv_heads, four.n_heads) == (1, 3)
    assert spec.shard(1) is spec
    with pytest.raises(ValueError, match="1 or more"):
        spec.shard(0)


@pytest.mark.parametrize("op", ["Q", "MLP1", "MLP2", HEAD])
def test_a_host_op_of_a_shard_takes_the_whole_ops_time(op):
    """The host computes a host-placed op once for the group: 1/tp of it at 1/tp of the
    host's rates is the whole op at its rates."""
    spec, profile = PRESETS["llama2-7b"], hardware_profile("a10g")
    view = tensor_parallel(profile, 4, LINK)
    whole = op_seconds(spec, profile, HOST, op, 4, 1, 512, 256)
    assert op_seconds(spec.shard(4), view, HOST, op, 4, 1, 512, 256) == pytest.approx(
        whole, rel=1e-9)


def test_row_split_ops_end_in_a_ring_all_reduce():
    spec, profile = PRESETS["llama2-7b"], hardware_profile("a10g")
    view, shard = tensor_parallel(profile, 4, LINK), spec.shard(4)
    nbytes = 16 * 1 * spec.d_model * spec.dtype_bytes
    ring = LINK.latency + 2 * 3 / 4 * nbytes / LINK.bandwidth
    assert allreduce_seconds(view, nbytes) == pytest.approx(ring)
    alone = tensor_parallel(profile, 4, Interconnect(math.inf, 0.0, "free"))
    for op in ("OUT", "MLP2", "Q", "MLP1"):
        extra = (op_seconds(shard, view, ACCELERATOR, op, 16, 1, 512, 256)
                 - op_seconds(shard, alone, ACCELERATOR, op, 16, 1, 512, 256))
        assert extra == pytest.approx(ring if op in ("OUT", "MLP2") else 0.0, abs=1e-12)
    assert allreduce_seconds(profile, nbytes) == 0.0  # one accelerator


def test_links_share_the_hosts_memory_bandwidth():
    profile = hardware_profile("a10g")
    view = tensor_parallel(profile, 4, LINK)
    assert view.h2d_bandwidth == min(profile.h2d_bandwidth,
                                     profile.host.memory_bandwidth / 4)
    assert view.host_memory == profile.host_memory // 4
    assert tensor_parallel(profile, 1, None) is profile
    with pytest.raises(ValueError, match="interconnect"):
        tensor_parallel(profile, 2, None)
    with pytest.raises(HxError, match="'a10g' has 1"):
        tensor_parallel_profile("a10g", 2)
    assert tensor_parallel_profile("4xa10g", 4).tensor_parallel == 4


def test_a_tensor_parallel_plan_fits_each_device_and_resident_steps_shrink():
    """Llama-2-70B at batch 4 on 4 A10G-class GPUs: CP-SAT plans a shard within one GPU's
    memory and a quarter of the host's; with every layer resident on 8 GPUs the step is
    shorter than on 4 (half the bytes each), all-reduces included."""
    spec, profile = PRESETS["llama2-70b"].replace(dtype="float16"), hardware_profile("a10g")
    workload = Workload(4, 512, 544, new_tokens=32)
    view = tensor_parallel(profile, 4, LINK)
    devices = discover(accelerator_memory=profile.accelerator_memory,
                       host_memory=view.host_memory)
    plan = plan_cpsat(spec.shard(4), view, devices, workload, time_limit_s=2.0).plan
    check_fits(plan, spec.shard(4), devices, workload)
    from hx.planner import policies

    steps = []
    for tp in (8, 16):
        shard, tp_view = spec.shard(tp), tensor_parallel(profile, tp, LINK)
        resident = policies.build("all-accelerator", shard, discover(), workload)
        steps.append(predict(resident, shard, tp_view, "decode", 4, 1, 544, 528).seconds)
    assert steps[1] < steps[0]
