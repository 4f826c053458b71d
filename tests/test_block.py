"""The zig-zag block schedule: N micro-batches through each segment, weights staged once."""

import numpy as np
import pytest

from hx.devices import ACCELERATOR, discover
from hx.executor import Executor
from hx.memory import estimate
from hx.models.layers import Step
from hx.planner import policies
from hx.planner.simulator import predict
from hx.schedule import LAUNCH, STAGE, WAIT, compile_schedule, dry_run
from hx.workload import Workload

from conftest import force_numpy_attention
from plans import acceptance_plans
from profiles import gpu_like

PLANS = acceptance_plans(3, splits=(1, 2))
B, T, S, N, DECODE_STEPS = 2, 8, 32, 3, 3


def micro_inputs(spec, m):
    """Prefill and decode (tokens, Step) of micro-batch ``m``: its own tokens and padding."""
    rng = np.random.default_rng(m)
    kv_start = np.array([m % 3, 0], np.int32)
    out = [(rng.integers(0, spec.vocab_size, (B, T), dtype=np.int32),
            Step(np.maximum(np.arange(T, dtype=np.int32)[None] - kv_start[:, None], 0),
                 np.int32(0), kv_start))]
    for i in range(1, DECODE_STEPS + 1):
        out.append((rng.integers(0, spec.vocab_size, (B, 1), dtype=np.int32),
                    Step((T - kv_start + i - 1)[:, None].astype(np.int32),
                         np.int32(T + i - 1), kv_start)))
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_block_schedule_stages_each_segment_once_for_all_micro_batches(tiny_model, name):
    plan = PLANS[name]
    for phase in ("prefill", "decode"):
        one = compile_schedule(plan, tiny_model.spec, phase, B, T, S)
        block = compile_schedule(plan, tiny_model.spec, phase, B, T, S, micro_batches=N)
        stages = [i.segment for i in block.instructions if i.kind == STAGE]
        assert stages == [i.segment for i in one.instructions if i.kind == STAGE]
        launches = [(i.segment, i.micro) for i in block.instructions if i.kind == LAUNCH]
        # zig-zag: every micro-batch passes segment i before segment i + 1 starts
        assert launches == [(s, m) for s in range(len(block.segments)) for m in range(N)]
        for ins in block.instructions:  # a staged segment is waited for after its last launch
            if ins.kind == WAIT:
                done = [k for k, (s, _) in enumerate(launches) if s == ins.segment]
                assert block.instructions.index(ins) > [
                    j for j, x in enumerate(block.instructions) if x.kind == LAUNCH][done[-1]]
        sizes = lambda *a: 1000  # noqa: E731
        assert dry_run(compile_schedule(plan, tiny_model.spec, phase, B, T, S, sizes, N)).peak \
            >= dry_run(compile_schedule(plan, tiny_model.spec, phase, B, T, S, sizes)).peak


@pytest.mark.parametrize("name, numpy_attention", [(name, False) for name in PLANS]
                         + [("alternating", True), ("stream-all", True)])
def test_a_block_computes_what_its_micro_batches_compute_alone(tiny_model, name,
                                                               numpy_attention, monkeypatch):
    """Every micro-batch's logits equal a run of it alone (the same executables), and the
    accountant's peak equals the estimate of the block's workload -- also with host
    attention in numpy, whose host segments run on the host stream in a block."""
    if numpy_attention:
        force_numpy_attention(monkeypatch)
    plan, spec = PLANS[name], tiny_model.spec
    need = estimate(plan, spec, Workload(B, T, S, N)).accelerator
    ex = Executor(spec, tiny_model.params, plan, discover(accelerator_memory=need))
    inputs = [micro_inputs(spec, m) for m in range(N)]
    alone = []
    for m in range(N):
        caches, out = ex.new_cache(B, S), []
        for k, (tokens, step) in enumerate(inputs[m]):
            logits, caches = ex.run("prefill" if k == 0 else "decode", tokens, step, caches)
            out.append(np.asarray(logits))
        ex.release_cache()
        alone.append(out)
    ex.accountant.peak = 0
    caches = [ex.new_cache(B, S, micro=m) for m in range(N)]
    for k in range(DECODE_STEPS + 1):
        logits, caches = ex.run_block("prefill" if k == 0 else "decode",
                                      [inputs[m][k][0] for m in range(N)],
                                      [inputs[m][k][1] for m in range(N)], caches)
        for m in range(N):
            np.testing.assert_array_equal(np.asarray(logits[m]), alone[m][k])
    ex.release_cache()
    assert ex.accountant.in_use == sum(v for k, v in ex.accountant.by_owner().items()
                                       if k == "weights")
    assert ex.accountant.peak == need
    if ACCELERATOR in plan.kv:
        assert need > estimate(plan, spec, Workload(B, T, S)).accelerator


def test_a_block_amortises_streamed_weights_in_the_simulator(tiny_model):
    """Stream-all: a block of N moves each layer's weights once, so it takes much less than N
    single steps; a plan with nothing to stream does N times the accelerator work."""
    profile, spec = gpu_like(), tiny_model.spec.replace(n_layers=8, d_model=1024, d_ff=4096,
                                                        n_heads=16, n_kv_heads=8, head_dim=64)
    stream = policies.stream_all(8)
    one = predict(stream, spec, profile, "decode", B, 1, S, micro_batches=1)
    block = predict(stream, spec, profile, "decode", B, 1, S, micro_batches=4)
    h2d = lambda p: sum(t.duration for t in p.tasks if t.name.startswith("weights"))  # noqa
    assert h2d(block) == pytest.approx(h2d(one))
    assert block.seconds < 4 * one.seconds * 0.7
    resident = policies.all_accelerator(8)
    one = predict(resident, spec, profile, "decode", B, 1, S)
    block = predict(resident, spec, profile, "decode", B, 1, S, micro_batches=4)
    # four times the accelerator work, less only what overlaps (EMBED on the host)
    assert 4 * one.busy[ACCELERATOR] <= block.seconds <= 4 * one.seconds
