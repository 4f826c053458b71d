"""CP-SAT with a disk tier: plans the executor runs (weights on disk, never KV caches), EMBED
and HEAD in any state where host memory is short, their bytes counted as the estimate counts
them (pure Python: shapes, a fixed profile, no model)."""

import dataclasses

import pytest

from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.memory import check_fits
from hx.models.spec import ModelSpec, preset
from hx.models.tensors import weight_dtype
from hx.plan import DISK, RESIDENT, STREAMED
from hx.planner.cpsat import plan_cpsat
from hx.planner.patterns import end_costs, layer_patterns
from hx.workload import Workload

from profiles import gpu_like

# Llama-2-7B's proportions at a size that compiles in seconds: a vocabulary table (EMBED,
# HEAD) of a fifth of the weights each
SPEC = ModelSpec(name="disk-plan", n_layers=4, d_model=512, n_heads=4, n_kv_heads=2,
                 head_dim=128, d_ff=1408, vocab_size=8192, context_length=256,
                 dtype="bfloat16", tie_embeddings=False)
WORKLOAD = Workload.for_prompts(1, 16, 16, SPEC)


def with_disk(read_bandwidth: float = 2e9):
    return dataclasses.replace(gpu_like(), disk_read_bandwidth=read_bandwidth)


def test_patterns_keep_kv_caches_off_the_disk_unless_asked():
    """Disk twins stream weights from disk; only a plan that is simulated (``kv_disk``) may
    keep a KV cache there, which the executor refuses."""
    runnable, simulated = layer_patterns(disk=True), layer_patterns(disk=True, kv_disk=True)
    assert any(DISK in p.ops for p in runnable)
    assert all(p.kv != DISK for p in runnable)
    assert {p for p in simulated if p.kv != DISK} == set(runnable)
    assert any(p.kv == DISK for p in simulated)


@pytest.mark.parametrize("spec", [SPEC, SPEC.replace(dtype="float16"),
                                  preset("smollm2-135m").replace(dtype="bfloat16")],
                         ids=["bf16", "f16", "tied-bf16"])
def test_embed_and_head_bytes_follow_the_held_dtype(spec):
    """EMBED and HEAD hold their tables in the dtype each device holds (the model's, float32 on
    the host for a float16 model: ``models.tensors.weight_dtype``), a tied table once where
    both hold it alike, nothing in memory on disk (read into two buffers instead)."""
    embed, head = ({device: spec.op_weight_bytes(op, weight_dtype(spec, device))
                    for device in (HOST, ACCELERATOR)} for op in ("EMBED", "HEAD"))
    shared = embed if spec.tie_embeddings else {HOST: 0, ACCELERATOR: 0}
    ends = {(e.embed, e.head): e for e in end_costs(spec, with_disk(), WORKLOAD, True)}
    assert ends[HOST, HOST].host == embed[HOST] + head[HOST] - shared[HOST]
    both = ends[RESIDENT, RESIDENT]
    assert both.resident == embed[ACCELERATOR] + head[ACCELERATOR] - shared[ACCELERATOR]
    assert (ends[RESIDENT, HOST].resident, ends[RESIDENT, HOST].host) == (
        embed[ACCELERATOR], head[HOST])
    assert ends[STREAMED, HOST].host == embed[ACCELERATOR] + head[HOST]  # two homes
    disk = ends[DISK, DISK]
    assert (disk.resident, disk.host, disk.read) == (0, 0, spec.op_weight_bytes("HEAD"))
    assert (disk.staged_embed, disk.staged_head) == (embed[ACCELERATOR], head[ACCELERATOR])


def test_cpsat_plans_from_disk_where_host_memory_holds_neither_table_pair():
    """Host memory of 30 % of the weights cannot hold EMBED's and HEAD's tables (20 % each)
    beside the read buffers: the plan keeps weights on disk, at least one table off the
    host, no KV cache on disk, and fits both budgets."""
    devices = discover(accelerator_memory=int(SPEC.weight_bytes * 0.7),
                       host_memory=int(SPEC.weight_bytes * 0.3))
    plan = plan_cpsat(SPEC, with_disk(), devices, WORKLOAD).plan
    assert DISK in {home for _, _, home in plan.weights.sequence()}
    assert DISK not in plan.kv
    assert (plan.weights.embed, plan.weights.head) != (HOST, HOST)
    check_fits(plan, SPEC, devices, WORKLOAD)


def test_a_profile_without_a_disk_rate_is_named_when_nothing_fits():
    devices = discover(accelerator_memory=int(SPEC.weight_bytes * 0.7),
                       host_memory=int(SPEC.weight_bytes * 0.3))
    with pytest.raises(HxError, match="no disk read rate.*hx profile"):
        plan_cpsat(SPEC, with_disk(0.0), devices, WORKLOAD)


def test_auto_without_a_profile_says_to_profile_when_host_memory_is_short():
    """Without a hardware profile ``auto`` falls back to the largest layer split, which keeps
    no weights on disk: where that overflows the host budget the error gives the bytes over
    and says that a profile (its disk rate) lets CP-SAT plan a disk tier; where it fits, the
    same call returns that plan."""
    from hx.planner import policies

    short = discover(accelerator_memory=int(SPEC.weight_bytes * 0.3),
                     host_memory=int(SPEC.weight_bytes * 0.3))
    with pytest.raises(HxError, match=r"host memory budget.*over by \d+ bytes.*hx profile"):
        policies.build("auto", SPEC, short, WORKLOAD, profile=None)
    roomy = discover(accelerator_memory=int(SPEC.weight_bytes * 0.3))
    assert policies.build("auto", SPEC, roomy, WORKLOAD, profile=None).name.startswith(
        "layer-split")
