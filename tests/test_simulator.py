"""The simulator and hardware profiles: invariants of the replayed schedule."""

import dataclasses
import math

import pytest

from hx.errors import HxError
from hx.models.spec import GGML, PRESETS, TORCH_INT4
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.cost import dequantized_weights, op_cost
from hx.planner.profile import HardwareProfile
from hx.planner.simulator import Task, op_seconds, predict, run_tasks

from profiles import gpu_like

SPEC = PRESETS["smollm2-135m"]
B, SLOTS, CONTEXT = 4, 256, 200


def test_profile_json_round_trip(tmp_path):
    profile = dataclasses.replace(gpu_like(), accelerator=dataclasses.replace(
        gpu_like().accelerator, compute_scale=((1, 0.9), (16, 1.2))))
    profile.save(str(tmp_path / "p.json"))
    assert HardwareProfile.load(str(tmp_path / "p.json")) == profile
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(HxError, match="malformed"):
        HardwareProfile.load(str(tmp_path / "bad.json"))
    with pytest.raises(HxError, match="hx profile"):
        HardwareProfile.load(str(tmp_path / "missing.json"))


def test_one_segment_step_is_launch_plus_ops():
    profile = gpu_like()
    plan = policies.all_accelerator(SPEC.n_layers)
    ops = sum(op_seconds(SPEC, profile, "accelerator", op, B, 1, SLOTS, CONTEXT)
              for _, op, _ in plan.decode.sequence())
    got = predict(plan, SPEC, profile, "decode", B, 1, SLOTS, CONTEXT).seconds
    assert got == pytest.approx(profile.accelerator.launch_seconds(B) + ops + 1e-5, rel=1e-3)
    # a matmul op at a constant-rate point takes flops / rate
    mlp1 = op_cost(SPEC, "MLP1", 1024, 1, SLOTS)
    assert op_seconds(SPEC, profile, "accelerator", "MLP1", 1024, 1, SLOTS, CONTEXT) == \
        pytest.approx(mlp1.flops / 6e13)


def test_streaming_is_copy_bound_and_free_with_an_infinite_link():
    profile = gpu_like()
    stream = policies.stream_all(SPEC.n_layers)
    streamed = sum(SPEC.op_weight_bytes(op) for layer, op, home in stream.weights.sequence()
                   if home == "streamed")
    t = predict(stream, SPEC, profile, "decode", B, 1, SLOTS, CONTEXT)
    assert t.seconds >= streamed / profile.h2d_bandwidth
    assert t.seconds >= max(t.busy.values())
    # free link, no dispatch costs: streaming costs nothing over residency
    free = dataclasses.replace(profile.accelerator, launch_overhead=())
    fast = dataclasses.replace(profile, h2d_bandwidth=1e30, sync_overhead=0.0, accelerator=free,
                               host=dataclasses.replace(profile.host, launch_overhead=()))
    resident_twin = ExecutionPlan(stream.prefill, stream.decode,
                                  ExecutionPlan.from_placement(stream.decode).weights, stream.kv)
    assert predict(stream, SPEC, fast, "decode", B, 1, SLOTS, CONTEXT).seconds == pytest.approx(
        predict(resident_twin, SPEC, fast, "decode", B, 1, SLOTS, CONTEXT).seconds, rel=0.05)


def test_contention_and_transfers_only_slow_things_down():
    profile = gpu_like()
    stream = policies.stream_all(SPEC.n_layers)
    times = [predict(stream, SPEC, dataclasses.replace(profile, contention=c), "decode", B, 1,
                     SLOTS, CONTEXT).seconds for c in (0.0, 0.5, 1.0)]
    assert times == sorted(times) and times[0] < times[-1]
    mixed = ExecutionPlan.uniform(SPEC.n_layers, ("SCORE",))
    slow_link = dataclasses.replace(profile, transfer_latency=1e-3)
    extra = (predict(mixed, SPEC, slow_link, "decode", B, 1, SLOTS, CONTEXT).seconds
             - predict(mixed, SPEC, profile, "decode", B, 1, SLOTS, CONTEXT).seconds)
    # per layer q, k, v go to the host and o comes back: two transfers on the critical path
    assert extra == pytest.approx(2 * SPEC.n_layers * (1e-3 - 1e-5), rel=0.05)


def test_compute_contention_slows_only_overlapping_computation():
    """Two independent computations, 2 s on the accelerator and 1 s on the host, beside a
    0.5 s copy: each compute contention c slows both while they overlap (the host's second
    at 1 / (1 + c) speed: done at 1 + c s), never the copy, and never a lone computation."""
    for c in (0.0, 0.5, 1.0):
        tasks = [Task("accelerator", "a", 2.0), Task("host", "h", 1.0), Task("H2D", "w", 0.5)]
        makespan = run_tasks(tasks, contention=0.0, compute_contention=c)
        assert tasks[1].end == pytest.approx(1.0 + c)
        assert tasks[2].end == pytest.approx(0.5)
        # the accelerator did 1 / (1 + c) s of work per second while the host ran
        assert makespan == pytest.approx(1.0 + c + 2.0 - 1.0)
    lone = [Task("accelerator", "a", 2.0), Task("host", "h", 1.0, deps=(0,))]
    assert run_tasks(lone, contention=0.0, compute_contention=1.0) == pytest.approx(3.0)


def test_accelerator_ops_of_a_16_bit_model_are_priced_at_the_low_precision_rates():
    """A bf16/f16 model's accelerator ops multiply at ``matmul_low``; its host ops at the
    rate of the dtype the host holds their weights in (``models.spec.host_dtype``: bf16 as
    is, f16 as float32); every op of a float32 model at ``matmul``; without a low curve,
    ``matmul``."""
    base = gpu_like()

    def tenfold(side):
        return dataclasses.replace(side, matmul_low=tuple((m, 10 * r) for m, r in side.matmul))

    fast = dataclasses.replace(base, accelerator=tenfold(base.accelerator),
                               host=tenfold(base.host))
    f32 = PRESETS["llama2-7b"].replace(n_layers=2)
    for dtype in ("bfloat16", "float16"):
        low = f32.replace(dtype=dtype)
        for op in ("Q", "MLP1", "HEAD"):
            def seconds(spec, device, profile=fast):
                return op_seconds(spec, profile, device, op, 4, 1, 256, 256)

            assert seconds(low, "accelerator") == pytest.approx(seconds(f32, "accelerator") / 10)
            host_low = dtype == "bfloat16"
            assert seconds(low, "host") == pytest.approx(seconds(f32, "host")
                                                         / (10 if host_low else 1))
            assert seconds(low, "accelerator", base) == seconds(f32, "accelerator", base)


def test_host_ops_under_the_int4_kernel_are_priced_at_its_rate():
    """A host op whose 4-bit matrices torch's int4 kernel multiplies (``host_matmul``
    torch-int4) costs its FLOPs at the profile's ``int4_matmul`` curve with no decompression;
    unmeasured, at the bfloat16 matmul rate. Accelerator ops, 8-bit matrices (the kernel takes
    none) and XLA's host path keep the product plus decompression."""
    base = gpu_like()
    kernel = dataclasses.replace(base, host=dataclasses.replace(
        base.host, int4_matmul=((1, 4e10), (256, 8e11))))
    spec = PRESETS["llama2-7b"].replace(n_layers=2, dtype="bfloat16", weight_format="int4",
                                        host_matmul=TORCH_INT4)
    xla = spec.replace(host_matmul="xla")

    def seconds(s, device, profile=kernel, op="MLP1", batch=4):
        return op_seconds(s, profile, device, op, batch, 1, 256, 256)

    flops = op_cost(spec, "MLP1", 4, 1, 256).flops
    assert seconds(spec, "host") == pytest.approx(flops / (4e10 + (8e11 - 4e10) * math.log(4)
                                                           / math.log(256)))
    assert seconds(spec, "host", base) == pytest.approx(base.host.matmul_seconds(
        flops, 4, "bfloat16"))
    assert seconds(xla, "host") == pytest.approx(base.host.matmul_seconds(flops, 4, "bfloat16")
                                                 + sum(base.host.dequantize_seconds(f, n, "bfloat16")
                                                       for f, n in dequantized_weights(xla, "MLP1")))
    assert seconds(spec, "accelerator") == seconds(xla, "accelerator")
    int8 = spec.replace(weight_format="int8")
    assert seconds(int8, "host") == seconds(int8.replace(host_matmul="xla"), "host")


def test_host_ops_over_gguf_blocks_are_priced_at_ggml_s_rates():
    """A host op whose matrices the host holds in a GGUF's blocks (``host_matmul`` ggml) costs
    each matrix's FLOPs at the profile's ``ggml_matmul`` curve of its layout -- repacked q4_0
    for a projection whose rows only multiply, where measured -- with no decompression, up to
    the rows that layout's kernel takes; past them, or unmeasured, the product plus the
    decompression XLA runs. Accelerator ops keep theirs."""
    base = gpu_like()
    repacked, plain = ((1, 6e10), (512, 1.2e11)), ((1, 3e10), (64, 9e10))
    ggml = dataclasses.replace(base, host=dataclasses.replace(
        base.host, ggml_matmul=(("q4_0", plain), ("q4_0 repacked", repacked))))
    spec = PRESETS["llama2-7b"].replace(n_layers=2, weight_format="q4_0", host_matmul=GGML)
    xla = spec.replace(host_matmul="xla")

    def seconds(s, device, profile=ggml, batch=4, op="MLP1"):
        return op_seconds(s, profile, device, op, batch, 1, 256, 256)

    flops = op_cost(spec, "MLP1", 4, 1, 256).flops
    rate = 6e10 + (1.2e11 - 6e10) * math.log(4) / math.log(512)
    assert seconds(spec, "host") == pytest.approx(flops / rate)
    unrepacked = dataclasses.replace(ggml, host=dataclasses.replace(
        ggml.host, ggml_matmul=(("q4_0", plain),)))
    assert seconds(spec, "host", unrepacked) == pytest.approx(
        flops / (3e10 + (9e10 - 3e10) * math.log(4) / math.log(64)))
    # 128 rows: past the file layout's 64, within the repacked layout's 512
    assert seconds(spec, "host", batch=128) == pytest.approx(
        op_cost(spec, "MLP1", 128, 1, 256).flops / _interp(repacked, 128))
    for profile, batch in ((unrepacked, 128), (base, 4)):
        assert seconds(spec, "host", profile, batch) == seconds(xla, "host", profile, batch)
    assert seconds(spec, "accelerator") == seconds(xla, "accelerator")


def _interp(curve, x):
    (x0, y0), (x1, y1) = curve
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def test_a_compressed_matrix_costs_its_product_plus_its_decompression():
    """An op over int4 weights: the dense product's seconds plus each matrix's decompression,
    per weight at the measured curve's value for its size (bf16's on a bf16 model's
    accelerator); a format not measured (the host here) is one memory pass reading the codes
    and writing the dtype the host holds (bf16 for a bf16 model: ``host_dtype``). EMBED and
    SCORE decompress nothing; a tied compressed table is HEAD's matrix."""
    base = gpu_like()
    small, large = 576 * 1536, 4096 * 11008
    curve = ((small, 1e-12), (large, 4e-12))  # per weight, interpolated in log size
    acc = dataclasses.replace(base.accelerator, dequantize=(("int4", ((1, 9e-12),)),),
                              dequantize_low=(("int4", curve),))
    measured = dataclasses.replace(base, accelerator=acc)
    dense = PRESETS["llama2-7b"].replace(n_layers=2, dtype="bfloat16")
    int4 = dense.replace(weight_format="int4")
    assert dequantized_weights(int4, "MLP1") == (("int4", large), ("int4", large))
    assert dequantized_weights(int4, "EMBED") == dequantized_weights(dense, "MLP1") == ()

    def seconds(spec, device, op="MLP1", profile=measured):
        return op_seconds(spec, profile, device, op, 4, 1, 256, 256)

    assert seconds(int4, "accelerator") == pytest.approx(seconds(dense, "accelerator")
                                                         + 2 * large * 4e-12)
    middle = 4096 * 4096  # Q's matrix: between the curve's points
    share = (math.log(middle) - math.log(small)) / (math.log(large) - math.log(small))
    assert seconds(int4, "accelerator", "Q") == pytest.approx(
        seconds(dense, "accelerator", "Q") + middle * (1e-12 + share * 3e-12))
    assert seconds(int4, "accelerator", "SCORE") == seconds(dense, "accelerator", "SCORE")
    host = seconds(int4, "host") - seconds(dense, "host")
    assert host == pytest.approx(2 * large * (0.5 + 2) / base.host.memory_bandwidth)
    tied = PRESETS["smollm2-135m"].replace(embedding_format="q8_0")
    assert dequantized_weights(tied, "HEAD") == (("q8_0", 49152 * 576),)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_bytes_moved_in_a_step_are_the_plans(micro_batches):
    """Stream-all decode: H2D carries every streamed weight once per step (whatever the number
    of micro-batches) plus, per micro-batch, the embedded x (twice: layer 0's Q/K/V and, after
    the host SCORE, its OUT residual -- the executor does not hold a copied-in activation
    across a host excursion) and each layer's attention output o; D2H carries each layer's q,
    k and v -- counted from the plan, not the schedule."""
    from hx.models.tensors import activation_bytes

    profile = gpu_like()
    plan = policies.stream_all(SPEC.n_layers)
    tasks = predict(plan, SPEC, profile, "decode", B, 1, SLOTS, CONTEXT, micro_batches).tasks
    moved = {r: sum(t.nbytes for t in tasks if t.resource == r) for r in ("H2D", "D2H")}
    streamed = sum(SPEC.op_weight_bytes(op) for _, op, home in plan.weights.sequence()
                   if home == "streamed")
    act = {n: activation_bytes(SPEC, n, B, 1) for n in ("x", "q", "k", "v", "o")}
    L, N = SPEC.n_layers, micro_batches
    assert moved["H2D"] == streamed + N * (2 * act["x"] + L * act["o"])
    assert moved["D2H"] == N * L * (act["q"] + act["k"] + act["v"])


def test_a_disk_kv_read_moves_the_positions_written_before_the_step():
    """A KV cache on disk is read, per micro-batch, for the positions written before the step:
    not the step's own (computed in it), nor the host kernel's padding of the prefix to
    64-slot blocks (read from host memory). Decode at 200 of 256 slots in use reads 199
    positions (256 before); a first prefill chunk none, the second the first's."""
    from hx.models.tensors import kv_bytes
    from hx.plan import DISK
    from hx.planner.patterns import Pattern, layer_plan

    spec = SPEC.replace(n_layers=2)
    plan = layer_plan(spec, [Pattern(DISK, ("host",) * 6)] * 2, "host", "KV on disk")
    profile = dataclasses.replace(gpu_like(), disk_read_bandwidth=2e9)

    def read(phase, tokens, context, micro_batches=1):
        tasks = predict(plan, spec, profile, phase, B, tokens, SLOTS, context,
                        micro_batches).tasks
        return sum(t.nbytes for t in tasks if t.name.startswith("read KV"))

    assert read("decode", 1, CONTEXT, 2) == 2 * 2 * kv_bytes(spec, B, CONTEXT - 1)
    assert read("prefill", 64, 64) == 0
    assert read("prefill", 64, 128) == 2 * kv_bytes(spec, B, 64)
