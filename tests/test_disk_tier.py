"""The disk tier runs (``hx.disk``): weights homed on disk are read each step from a mapped file
-- the checkpoint's own, or a spill file written once -- and give exactly the logits of the same
plan with those weights in host memory; their pages leave the resident set after each step."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from hx import disk as disk_module
from hx import executor as executor_module
from hx.devices import discover
from hx.errors import HxError
from hx.executor import Executor
from hx.memory import disk_weight_bytes, estimate
from hx.models.mapped import PAGE, is_mapped, resident_bytes
from hx.models.random_weights import random_params
from hx.models.safetensors_loader import load_safetensors_dir, write_hf_folder
from hx.models.spec import ModelSpec
from hx.plan import DISK, STREAMED, ExecutionPlan, WeightHomes
from hx.schedule import read_buffer_bytes
from hx.planner import policies
from hx.workload import Workload

from conftest import TINY
from steps import left_padded_steps

# matrices of 256 KiB to 2 MiB in bfloat16, large beside the pages around a tensor's ends
SPEC = ModelSpec(name="disk", n_layers=4, d_model=512, n_heads=4, n_kv_heads=2, head_dim=128,
                 d_ff=2048, vocab_size=1024, context_length=256, rope_theta=10000.0,
                 norm_eps=1e-5, tie_embeddings=False)
B, T, S, DECODE_STEPS = 2, 8, 32, 3
FAULT_AROUND = 64 << 10  # Linux maps up to this much of a file's cached pages around a fault


def rehome(plan: ExecutionPlan, home, name: str) -> ExecutionPlan:
    """``plan`` with each weight home h of op ``op`` of layer ``layer`` (None: EMBED, HEAD)
    replaced by ``home(layer, op, h)``."""
    w = plan.weights
    rows = tuple(tuple(home(i, op, h) for op, h in zip(WeightHomes.OPS, row))
                 for i, row in enumerate(w.layers))
    return dataclasses.replace(plan, weights=WeightHomes(
        home(None, "EMBED", w.embed), rows, home(None, "HEAD", w.head)), name=name)


def on_disk(plan: ExecutionPlan, layers, head: bool = False) -> ExecutionPlan:
    """``plan`` with the weights of the accelerator ops of ``layers`` (and HEAD's when
    ``head``) on disk."""
    def home(layer, op, h):
        moved = layer in layers if layer is not None else head and op == "HEAD"
        return DISK if moved and plan.decode.get(layer, op) == "accelerator" else h

    return rehome(plan, home, f"{plan.name}+disk")


def in_memory(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with its disk-homed weights streamed from host memory instead."""
    return rehome(plan, lambda layer, op, h: STREAMED if h == DISK else h, "in-memory")


PLANS = {"stream-all": on_disk(policies.stream_all(4), {0, 1, 3}, head=True),
         "all-accelerator": on_disk(policies.all_accelerator(4), {1})}


def write_checkpoint(path, spec: ModelSpec, shards: int = 2) -> None:
    """A Hugging Face folder of ``spec``'s shapes with random weights, in ``shards`` files."""
    params = random_params(spec, seed=3)
    write_hf_folder(str(path), spec, shards, lambda layers: params)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bfloat16 checkpoint folder of ``SPEC``'s shapes."""
    path = tmp_path_factory.mktemp("bf16")
    write_checkpoint(path, SPEC.replace(dtype="bfloat16"))
    return str(path)


def steps():
    return left_padded_steps(T, DECODE_STEPS)


def run(ex: Executor, micro_batches: int = 1, after_step=None) -> list[np.ndarray]:
    """Logits of a prefill and ``DECODE_STEPS`` decode steps of a block of micro-batches,
    each with its own tokens; ``after_step()`` is called after each step."""
    rng = np.random.default_rng(0)
    caches = [ex.new_cache(B, S, micro=m) for m in range(micro_batches)]
    out = []
    for i, step in enumerate(steps()):
        tokens = [rng.integers(0, SPEC.vocab_size, (B, T if i == 0 else 1), dtype=np.int32)
                  for _ in range(micro_batches)]
        logits, caches = ex.run_block("prefill" if i == 0 else "decode", tokens,
                                      [step] * micro_batches, caches)
        out += [np.asarray(x) for x in logits]
        if after_step is not None:
            after_step()
    ex.release_cache()
    return out


def disk_leaves(ex: Executor) -> list[np.ndarray]:
    """The distinct arrays the executor reads from disk."""
    leaves = {}
    for phase, segments in ex._params.items():
        for trees, on_disk in zip(segments, ex._on_disk[phase]):
            for tree, disk in zip(trees, on_disk):
                leaves.update({id(x): x for x in jax.tree.leaves(tree) if disk})
    return list(leaves.values())


@pytest.mark.parametrize("plan_name", PLANS)
@pytest.mark.parametrize("source", ["checkpoint", "converted", "random-int8"])
def test_disk_plan_gives_the_host_plans_logits(source, plan_name, checkpoint, tmp_path):
    """The same plan with some layers' weights on disk instead of in host memory gives the
    very same logits, in a block of two micro-batches too: read from the checkpoint's own
    file where the loader holds its tensors as stored (bfloat16 as bfloat16), else from a
    spill file written once (float32 loaded as bfloat16; random int8 weights) that leaves no
    named file behind."""
    if source == "checkpoint":
        spec, params = load_safetensors_dir(checkpoint, "bfloat16")
    elif source == "converted":
        write_checkpoint(tmp_path, SPEC)  # float32 on disk
        spec, params = load_safetensors_dir(str(tmp_path), "bfloat16")
    else:
        spec = SPEC.replace(weight_format="int8")
        params = random_params(spec, seed=3)
    disk_plan = PLANS[plan_name]
    spill = tmp_path / "spill"
    spill.mkdir()
    devices = discover()
    memory = Executor(spec, params, in_memory(disk_plan), devices)
    disk = Executor(spec, params, disk_plan, devices, spill_dir=str(spill))
    on_disk_bytes = estimate(disk_plan, spec, Workload(B, T, S)).disk
    assert on_disk_bytes > 0 and all(is_mapped(x) for x in disk_leaves(disk))
    assert disk.spilled_bytes == (0 if source == "checkpoint" else on_disk_bytes)
    assert os.listdir(spill) == []  # the spill file has no name: nothing to clean up
    for micro_batches in (1, 2):
        for a, b in zip(run(memory, micro_batches), run(disk, micro_batches)):
            np.testing.assert_array_equal(a, b)
    assert disk.accountant.peak == memory.accountant.peak  # the same stages, bytes and all


@pytest.mark.parametrize("source", ["checkpoint", "spill"])
def test_disk_pages_are_released_after_each_step(source, checkpoint, tmp_path, monkeypatch):
    """Each step reads every disk-homed tensor in full (its pages are in the resident set when
    the read releases them), and releases it again once its segment has run (on this CPU
    accelerator an aligned view -- a spill file's -- is read by the stage itself); at most the
    two segments of the stage double buffer are resident at once -- what the estimate counts
    (``schedule.read_buffer_bytes``: here a Q/K/V segment and an OUT/MLP one, not twice the
    larger) -- and after each step none are -- but for the pages the kernel maps around a
    faulting page and those a tensor shares with its neighbours in the file."""
    if source == "checkpoint":
        spec, params = load_safetensors_dir(checkpoint, "bfloat16")
    else:
        spec = SPEC.replace(dtype="bfloat16")
        params = random_params(spec, seed=3)
    ex = Executor(spec, params, PLANS["stream-all"], discover(), spill_dir=str(tmp_path))
    leaves = disk_leaves(ex)
    slack = len(leaves) * (2 * FAULT_AROUND + 2 * PAGE)
    buffers = read_buffer_bytes(ex.plan, spec)
    largest = max(sum(x.nbytes for x in jax.tree.leaves(trees))
                  for segments in ex._params.values() for trees in segments)
    assert largest < buffers < 2 * largest
    released = {"read": [], "wait": []}  # (resident bytes of the tensor, its bytes)
    at_release, after_step = [], []

    def spy(module, when):
        real = module.release

        def release(leaf):
            released[when].append((resident_bytes(leaf), leaf.nbytes))
            at_release.append(sum(resident_bytes(x) for x in leaves))
            real(leaf)

        monkeypatch.setattr(module, "release", release)

    spy(disk_module, "read")
    spy(executor_module, "wait")
    run(ex, after_step=lambda: after_step.append(sum(resident_bytes(x) for x in leaves)))
    total = sum(x.nbytes for x in leaves)
    for when, calls in released.items():  # each tensor, each step
        assert len(calls) == len(leaves) * (1 + DECODE_STEPS), when
    read_at = released["read" if source == "checkpoint" else "wait"]
    big = [(r, n) for r, n in read_at if n >= 16 * PAGE]
    assert big and all(r >= n - 2 * PAGE for r, n in big)  # read in full before release
    assert max(at_release) <= buffers + slack < total
    assert len(after_step) == 1 + DECODE_STEPS and max(after_step) <= slack < total / 4


def test_read_buffers_are_the_largest_two_consecutive_disk_reads():
    """The host's disk read buffers peak at two consecutive disk-reading segments: stream-all
    with layers 0, 1, 3 on disk reads each layer's Q/K/V segment, then its OUT/MLP1/MLP2
    segment, so one of each; one disk-reading segment (layer 1 of all-accelerator) pairs with
    its own read in the next step. The estimate's host bytes carry exactly that."""
    qkv, rest = (sum(SPEC.op_weight_bytes(op) for op in ops)
                 for ops in (("Q", "K", "V"), ("OUT", "MLP1", "MLP2")))
    assert read_buffer_bytes(PLANS["stream-all"], SPEC) == qkv + rest < 2 * rest
    assert read_buffer_bytes(PLANS["all-accelerator"], SPEC) == 2 * (qkv + rest)
    work = Workload(B, T, S)
    for plan in PLANS.values():
        assert (estimate(plan, SPEC, work, sizing="unsized").host
                - estimate(in_memory(plan), SPEC, work, sizing="unsized").host
                == read_buffer_bytes(plan, SPEC) - disk_weight_bytes(plan, SPEC))


def test_disk_plan_without_a_file_or_spill_dir_is_refused():
    params = random_params(SPEC, seed=3)
    with pytest.raises(HxError, match="spill_dir"):
        Executor(SPEC, params, PLANS["stream-all"], discover())


def test_hx_generate_runs_a_disk_plan(tmp_path, tokenizer):
    """``hx generate --plan`` with weights on disk, from a float32 checkpoint held as bfloat16
    (so spilled, to the default temp directory), prints the in-memory plan's greedy text."""
    spec = SPEC.replace(vocab_size=TINY.vocab_size, d_model=128, d_ff=256, head_dim=32)
    write_checkpoint(tmp_path, spec)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    texts = []
    for plan in (in_memory(PLANS["stream-all"]), PLANS["stream-all"]):
        plan.save(str(tmp_path / "plan.json"))
        result = subprocess.run(
            [sys.executable, "-m", "hx", "generate", "-m", str(tmp_path), "--dtype", "bfloat16",
             "--plan", str(tmp_path / "plan.json"), "-p", "The capital of France is",
             "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout)
    assert texts[0] == texts[1] and texts[0].strip()
