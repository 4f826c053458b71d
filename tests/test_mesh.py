"""Tensor parallelism priced on one accelerator's machinery (planner/mesh.py): the shard's
bytes against the whole model's, the host's share, the collectives against their formula."""

import math

import pytest

from hx.devices import ACCELERATOR, HOST, discover
from hx.memory import check_fits
from hx.models.spec import EMBED, HEAD, LAYER_OPS, PRESETS, SCORE
from hx.planner import policies
from hx.errors import HxError
from hx.planner import hardware
from hx.planner.hardware import hardware_profile, tensor_parallel_profile
from hx.planner.grid import Grid, Scenario, run_grid
from hx.plan import stage_layers
from hx.planner.layouts import Layout, price, split_hardware
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
    """Llama-2-7B at batch 4 over 2 GPUs of 2 GiB: a priced policy plans a shard within one
    GPU's memory and half the host's; with every layer resident, Llama-2-70B's step on 16
    GPUs is shorter than on 8 (half the bytes each), all-reduces included."""
    spec, profile = PRESETS["llama2-7b"].replace(dtype="float16"), hardware_profile("a10g")
    workload = Workload(4, 128, 160, new_tokens=32)
    view = tensor_parallel(profile, 2, LINK)
    devices = discover(accelerator_memory=2 * 2**30, host_memory=view.host_memory)
    plan = policies.build("min-max", spec.shard(2), devices, workload, profile=view)
    check_fits(plan, spec.shard(2), devices, workload)
    assert plan.weights != policies.all_accelerator(spec.n_layers).weights  # it offloads
    spec = PRESETS["llama2-70b"].replace(dtype="float16")
    steps = [predict(policies.all_accelerator(spec.n_layers), spec.shard(tp),
                     tensor_parallel(profile, tp, LINK), "decode", 4, 1, 544, 528).seconds
             for tp in (8, 16)]
    assert steps[1] < steps[0]


def test_stages_cut_the_layers_evenly_and_in_order():
    assert stage_layers(80, 3) == [range(0, 27), range(27, 54), range(54, 80)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(HxError, match="1 to 2 stages"):
        stage_layers(2, 3)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_stages_hold_the_model_once_but_a_tied_table_at_both_ends(pp):
    """Llama-2-70B (untied): the stages' weights sum to the model's; SmolLM2 (tied): the last
    stage holds its own copy of the table, as the first's is on another device."""
    for name, extra in (("llama2-70b", 0), ("smollm2-135m", 1)):
        spec = PRESETS[name]
        cuts = stage_layers(spec.n_layers, pp)
        parts = [spec.pipeline_stage(r, s == 0, s == pp - 1) for s, r in enumerate(cuts)]
        table = spec.vocab_size * spec.d_model * spec.dtype_bytes
        assert sum(p.weight_bytes for p in parts) == spec.weight_bytes + extra * table
        assert [(p.embeds, p.heads) for p in parts] == [(s == 0, s == pp - 1)
                                                        for s in range(pp)]
    assert spec.pipeline_stage(range(spec.n_layers), True, True) is spec


@pytest.mark.parametrize("micro", [1, 4])
def test_a_pipeline_step_is_its_slowest_stage_plus_the_others_fill(micro):
    """GPipe's fill: N micro-batches in flight wait for each other stage once per
    micro-batch's share; one micro-batch runs the stages in turn."""
    spec = PRESETS["llama2-7b"].replace(dtype="float16")
    workload = Workload(4, 128, 136, new_tokens=8, micro_batches=micro)
    run = price(spec, "4xa10g", Layout(2, 2, "all-accelerator"), workload)
    steps = [s.run.tpot_s for s in run.stages]
    link = hardware.machine("4xa10g").interconnect
    hop = link.latency + 4 * spec.d_model * spec.dtype_bytes / link.bandwidth
    assert len(steps) == 2 and [s.layers for s in run.stages] == stage_layers(32, 2)
    assert run.tpot_s == pytest.approx(max(steps) + min(steps) / micro + hop, rel=1e-12)
    assert run.total_s == pytest.approx(run.ttft_s + 7 * run.tpot_s, rel=1e-12)
    with pytest.raises(HxError, match="takes 8 GPUs"):
        price(spec, "4xa10g", Layout(4, 2), workload)


def test_a_grid_prices_a_machines_layouts_beside_one_gpu():
    grid = Grid(models=("llama2-7b:2L",), hardware=("4xa10g", "4xa10g:tp2", "4xa10g:pp2"),
                policies=("all-accelerator",), budgets=(1.0,),
                scenarios=(Scenario("b4", 4, 128, 8),), dtype="bfloat16")
    one, tp, pp = run_grid(grid)
    spec = PRESETS["llama2-7b"].replace(n_layers=2, dtype="bfloat16", name="Llama-2-7B:2L")
    two_gpus = price(spec, "4xa10g", Layout(2, 1, "all-accelerator"), Scenario(
        "b4", 4, 128, 8).workload())
    assert tp.tokens_per_s == pytest.approx(two_gpus.tokens_per_s, rel=1e-12)
    assert tp.accelerator_bytes < one.accelerator_bytes  # each GPU holds half the weights
    assert pp.tokens_per_s and pp.error is None and one.error is None
    assert split_hardware("8xh100:tp2xpp4") == ("8xh100", 2, 4)
    assert split_hardware("t4") == ("t4", 1, 1)
    with pytest.raises(HxError, match="tpA, ppB or tpAxppB"):
        split_hardware("4xa10g:2x2")
