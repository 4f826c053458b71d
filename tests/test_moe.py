"""Mixture-of-Experts layers beyond the families' checks against transformers
(``tests/test_families.py``): the host's experts product -- ggml's ``mul_mat_id`` over a GGUF's
own blocks, llama.cpp's MoE graph -- against a float64 computation over the decoded weights, and
the MoE model path that takes it (a quantized MoE GGUF on the host) against XLA's every-expert
path over the same weights; llama.cpp's ``--cpu-moe`` as a plan, by the bytes it moves.
"""

import dataclasses

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from hx.host_compute import ggml_kernel
from hx.models.compressed import GGUFBlocks
from hx.models.gguf_loader import group_of_blocks

pytestmark = pytest.mark.skipif(ggml_kernel.unavailable() is not None,
                                reason=str(ggml_kernel.unavailable()))


def stacked(rng, kind, X, out, inner, repack):
    """(GGUFBlocks of X stacked random (out, inner) matrices in ``kind``, their float64)."""
    blocks = quantize(rng.standard_normal((X * out, inner)).astype(np.float32), kind)
    ref = dequantize(blocks, kind).astype(np.float64).reshape(X, out, inner)
    held = GGUFBlocks.from_group(group_of_blocks(blocks, kind.name, (X * out, inner)),
                                 (X * out, inner))
    return (ggml_kernel.repacked(held) if repack else held), ref


def silu(a):
    return a / (1 + np.exp(-a))


def q8_0_rounded(rows: np.ndarray) -> np.ndarray:
    """float64 of ``rows`` (M, K) rounded to Q8_0 blocks, as ggml rounds activations before
    a quantized product."""
    rows = np.asarray(rows, np.float32)
    return dequantize(quantize(rows, Q.Q8_0), Q.Q8_0).astype(np.float64)


def clamped_swiglu(gate, up, alpha, limit):
    """gpt-oss's expert activation in float64 (transformers' ``GptOssExperts._apply_gate``)."""
    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return (up + 1) * gate / (1 + np.exp(-alpha * gate))


@pytest.mark.parametrize("kind,repack", [(Q.Q4_0, False), (Q.Q4_0, True), (Q.Q8_0, False)])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_experts_match_float64_over_the_decoded_blocks(kind, repack, rows, gpt_oss):
    """Each row's k experts (ids with repeats across rows, an expert no row picks), weighted
    and summed: float64 over the decoded blocks, with x and the inner activations rounded to
    Q8_0 as ggml rounds them before its products (``q8_0_rounded``), within 1e-5 of the
    largest (float32 sums); a row given another expert is off by its whole output.
    ``gpt_oss``: each product adds its expert's bias and the activation is the clamped SwiGLU
    (clamped at 1, so that it acts here)."""
    from hx.models.spec import ClampedSwiGLU, SwiGLU

    if repack and "q4_0" not in ggml_kernel.repacked_formats():
        pytest.skip("ggml repacks no format hx reads on this CPU")
    rng = np.random.default_rng(rows * 10 + int(kind) + repack)
    X, k, D, F = 6, 2, 64, 96
    gate, g = stacked(rng, kind, X, F, D, repack)
    up, u = stacked(rng, kind, X, F, D, repack)
    down, d = stacked(rng, kind, X, D, F, repack)
    x = rng.standard_normal((rows, D)).astype(np.float32)
    ids = np.stack([rng.choice(X - 1, k, replace=False) for _ in range(rows)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (rows, k)).astype(np.float32)
    biases = tuple(rng.standard_normal((X, n)).astype(np.float32) for n in (F, F, D)
                   ) if gpt_oss else ()
    bg, bu, bd = (b.astype(np.float64) for b in biases) if gpt_oss else (np.zeros((X, 1)),) * 3
    activation = ClampedSwiGLU(1.702, 1.0) if gpt_oss else SwiGLU()

    def act(a, b):
        return clamped_swiglu(a, b, 1.702, 1.0) if gpt_oss else silu(a) * b

    want, xr = np.zeros((rows, D)), q8_0_rounded(x)
    for m in range(rows):
        for j in range(k):
            e = ids[m, j]
            inner = act(g[e] @ xr[m] + bg[e], u[e] @ xr[m] + bu[e])
            want[m] += w[m, j] * (d[e] @ q8_0_rounded(inner[None])[0] + bd[e])
    got = np.asarray(jax.jit(ggml_kernel.experts, static_argnums=7)(
        x, ids, w, gate, up, down, biases, activation))
    assert got.shape == (rows, D) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 5])
def test_slots_weighted_zero_read_no_expert(kind, rows):
    """A part of a layer's experts gets each row's k largest weights of its own experts, some
    0 (the row routed elsewhere). Those slots' expert has NaN scales in every block: had ggml
    read it, the output would be NaN (0 x NaN); it equals float64 over the routed slots alone,
    a row with none of them 0, and a step routing no row to the part is all zeros."""
    rng = np.random.default_rng(rows + int(kind))
    X, k, D, F, unread = 6, 3, 64, 96, 5
    size, scale_at = (18, 0) if kind == Q.Q4_0 else (34, 0)

    def poisoned(out, inner):
        blocks = quantize(rng.standard_normal((X * out, inner)).astype(np.float32), kind)
        ref = dequantize(blocks, kind).astype(np.float64).reshape(X, out, inner)
        mine = blocks[unread * out:].reshape(out, -1, size)
        mine[..., scale_at:scale_at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        return GGUFBlocks.from_group(group_of_blocks(blocks, kind.name, (X * out, inner)),
                                     (X * out, inner)), ref

    (gate, g), (up, u), (down, d) = poisoned(F, D), poisoned(F, D), poisoned(D, F)
    x = rng.standard_normal((rows, D)).astype(np.float32)
    ids = np.stack([rng.choice(unread, k, replace=False) for _ in range(rows)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (rows, k)).astype(np.float32)
    ids[:, -1], w[:, -1] = unread, 0.0  # every row's last slot: weighted 0, the poisoned expert
    if rows > 1:
        ids[1], w[1] = unread, 0.0  # a row routed to none of the part's experts
    want = np.zeros((rows, D))
    for m in range(rows):
        for j in range(k):
            if w[m, j]:
                e, xm = ids[m, j], x[m].astype(np.float64)
                want[m] += w[m, j] * d[e] @ (silu(g[e] @ xm) * (u[e] @ xm))
    run = jax.jit(ggml_kernel.experts)
    got = np.asarray(run(x, ids, w, gate, up, down))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    if rows > 1:
        assert not got[1].any()
    none = np.asarray(run(x, ids, np.zeros_like(w), gate, up, down))
    assert not none.any()


def assert_ggml_experts_agree_with_xla(model, seed: int) -> None:
    """Each MoE layer's MLP2 with the routed experts multiplied by ggml (``HOST_PRODUCTS``)
    gives XLA's every-expert sums over the same blocks within ggml's rounding of the
    activations (0.8-0.9e-2 of the largest for Qwen3-MoE; 3e-2)."""
    from hx.host_compute import products
    from hx.models.decoder import apply_op
    from hx.models.layers import Step

    ggml = products.HOST_PRODUCTS
    xla = dataclasses.replace(ggml, experts=None)
    rng = np.random.default_rng(seed)
    x = jax.numpy.asarray(rng.standard_normal((2, 9, model.spec.d_model)), np.float32)
    step = Step(np.zeros((2, 9), np.int32), np.int32(0), np.zeros(2, np.int32))
    for layer in range(model.spec.n_layers):
        spec, params = model.spec.layer_spec(layer), model.params[f"layer_{layer}"]
        a = apply_op(spec, "MLP1", params["MLP1"], {"x": x}, step)[0]["a"]
        y = [np.asarray(jax.jit(lambda p, a, x, used=used: apply_op(
            spec, "MLP2", p, {"a": a, "x": x}, step, products=used)[0]["x"])(
                params["MLP2"], a, x)) - np.asarray(x) for used in (ggml, xla)]
        assert np.abs(y[0] - y[1]).max() <= 3e-2 * np.abs(y[1]).max(), layer


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q8_0])
def test_a_quantized_moe_gguf_runs_its_experts_with_ggml_on_the_host(tmp_path, kind):
    """Qwen3-MoE's tiny checkpoint as a quantized GGUF (its router F32, as llama-quantize
    leaves it), held in the file's blocks. Each layer's MLP2 on the host with the routed
    experts multiplied by ggml's ``mul_mat_id`` (each row by its own k) gives XLA's
    every-expert sums over the same blocks within ggml's rounding of the activations (0.8-0.9e-2
    of the largest here; 3e-2); and an all-host run's layers are one ggml graph each step
    (``host_compute.ggml_layer``, whose MoE part ``tests/test_ggml_layer.py`` checks)."""
    import hx
    from hx.host_compute import ggml_layer
    from hx.models.spec import LAYER_OPS

    from hf_families import CONFIGS, write_checkpoint, write_gguf

    directory = str(tmp_path / "ckpt")
    config = ("qwen3_moe", dict(CONFIGS["qwen3_moe"][1], moe_intermediate_size=64))
    ref = write_checkpoint("qwen3_moe", directory, config=config)
    path = str(tmp_path / "moe.gguf")
    write_gguf(directory, path, ref.config.vocab_size, kind)
    model = hx.load(path, dtype="float32")
    assert model.spec.moe is not None and model.spec.weight_format == kind.name.lower()
    assert_ggml_experts_agree_with_xla(model, int(kind))
    spec = model.spec
    layers = [[model.params[f"layer_{i}"][op] for op in LAYER_OPS]
              for i in range(spec.n_layers)]  # an all-host run's layers: one ggml graph
    assert all(ggml_layer.runs(spec, layer, 1, {"k": 0, "v": 0}) for layer in layers)


def test_gpt_oss_experts_run_with_ggml_on_the_host_biases_and_clamp_included(tmp_path,
                                                                          monkeypatch):
    """gpt-oss's tiny checkpoint held in q4_0: its experts' biases and clamped SwiGLU go into
    ggml's graph (``add_id``, ``swiglu_oai``: ``ggml_kernel.experts``, whose exact sums
    ``test_experts_match_float64_over_the_decoded_blocks`` checks), which agrees with XLA's
    loop over the same blocks as Qwen3-MoE's does (the clamp at 1 acts here)."""
    import hx
    from hx.host_compute import products

    from hf_families import CONFIGS, write_checkpoint

    model_type, config = CONFIGS["gpt_oss"]
    write_checkpoint("gpt_oss", str(tmp_path), config=(
        model_type, dict(config, head_dim=32, intermediate_size=64)))
    model = hx.load(str(tmp_path), dtype="float32", weights="q4_0")
    assert model.spec.host_matmul == "ggml" and model.spec.moe.expert_bias
    calls, ggml = [], products.HOST_PRODUCTS
    monkeypatch.setattr(products, "HOST_PRODUCTS", dataclasses.replace(
        ggml, experts=lambda *a: calls.append(a[6:]) or ggml.experts(*a)))
    assert_ggml_experts_agree_with_xla(model, 7)
    assert len(calls) == model.spec.n_layers
    assert all(len(biases) == 3 and activation == model.spec.moe.activation
               for biases, activation in calls)


def test_cpu_moe_leaves_the_experts_bytes_on_the_host():
    """llama.cpp's ``--cpu-moe`` as a plan (Qwen3-30B-A3B's shapes, 4 layers): the
    accelerator's weights are ``n-cpu-moe:0``'s (every op on the accelerator but EMBED's
    table, as llama.cpp keeps it) less exactly the routed experts' bytes, which the host holds
    (the router, attention and the LM head stay); ``n-cpu-moe:2`` less half of them; a dense
    model and an N past the layers are refused."""
    from hx.errors import HxError
    from hx.memory import estimate
    from hx.models.spec import preset
    from hx.planner import policies
    from hx.workload import Workload

    spec = preset("qwen3-30b-a3b:4L").replace(dtype="bfloat16", weight_format="q4_0")
    work = Workload.for_prompts(1, 16, 8, spec)
    experts = spec.op_weight_bytes("MLP2")
    full = estimate(policies.cpu_moe(spec, 0), spec, work)
    for plan, layers in ((policies.cpu_moe(spec), 4), (policies.cpu_moe(spec, 2), 2)):
        need = estimate(plan, spec, work)
        assert full.weights - need.weights == layers * experts, plan.name
        assert need.host - full.host == layers * experts, plan.name
        assert all(plan.decode.get(i, "MLP2") == "host" for i in range(layers))
        assert all(plan.decode.get(i, op) == "accelerator" for i in range(4)
                   for op in ("Q", "MLP1"))
    with pytest.raises(HxError, match="no experts"):
        policies.cpu_moe(preset("llama2-7b:2L"))
    with pytest.raises(HxError, match="n-cpu-moe"):
        policies.cpu_moe(spec, 5)


def test_experts_placed_one_by_one_hold_their_bytes_at_their_homes():
    """``resident-experts:64:host``, ``:streamed`` and ``:disk`` on Qwen3-30B-A3B's shapes (4
    layers, q4_0): beside ``n-cpu-moe:0`` (the same plan with each layer's experts MLP2's,
    resident), the accelerator holds exactly half the routed experts' bytes fewer, plus the
    resident half's ids (int32); the host (or the streamed experts' pinned host memory)
    holds that half, and on disk no memory does; a decode step of one row sizes each layer's
    copy of the streamed (or disk-homed) experts its routing picks at the most it can (k = 8
    experts), and copies none whole. A plan's expert homes round-trip through JSON, and
    homes for a dense model, for another count of experts or naming an expert twice are
    refused."""
    from hx.errors import HxError
    from hx.memory import disk_weight_bytes, estimate
    from hx.models.spec import preset
    from hx.plan import ExecutionPlan
    from hx.planner import policies
    from hx.schedule import EXPERTS_IN, STAGE, compile_schedule
    from hx.workload import Workload

    spec = preset("qwen3-30b-a3b:4L").replace(dtype="bfloat16", weight_format="q4_0")
    work = Workload.for_prompts(1, 16, 8, spec)
    experts = spec.op_weight_bytes("MLP2")
    ids = 64 * 4  # a part's expert ids, int32
    whole = estimate(policies.cpu_moe(spec, 0), spec, work)
    for rest in ("host", "streamed", "disk"):
        plan = policies.resident_experts(spec, 64, rest)
        need = estimate(plan, spec, work)
        on_disk = 4 * (experts // 2 + ids) if rest == "disk" else 0
        assert whole.weights - need.weights == 4 * (experts // 2 - ids), rest
        assert need.host - whole.host == 4 * (experts // 2 + ids) - on_disk, rest
        assert disk_weight_bytes(plan, spec) == on_disk
        copies = [(ins.kind, ins.nbytes) for ins in compile_schedule(
            plan, spec, "decode", 1, 1, 64).instructions if ins.kind in (STAGE, EXPERTS_IN)]
        one = (experts // 2 + ids) // 64  # an expert and its id
        assert copies == ([] if rest == "host" else [(EXPERTS_IN, 8 * one)] * 4), rest
        assert ExecutionPlan.from_json(plan.to_json(), 4) == plan
    with pytest.raises(HxError, match="not a Mixture of Experts"):
        plan.validate(preset("llama2-7b:4L"))
    with pytest.raises(HxError, match="128 a layer"):
        policies.resident_experts(preset("olmoe-1b-7b:4L"), 8).validate(spec)
    data = plan.to_json()
    data["experts"][0]["host"] = [0]
    with pytest.raises(HxError, match="once"):
        ExecutionPlan.from_json(data, 4)


@pytest.mark.parametrize("rest", ["streamed", "host", "disk"])
def test_a_run_with_experts_placed_one_by_one_peaks_at_its_estimate(tmp_path, monkeypatch,
                                                                     rest):
    """Qwen2-MoE's tiny checkpoint (a shared expert: it stays MLP2's) under
    ``resident-experts:2`` with the other two experts streamed, on disk or on the host; the
    tokens equal all-accelerator's (tests/test_families.py checks the logits against
    transformers). On the host the run's accelerator peak equals the exact estimate of its
    schedule. Streamed, each decode step copies in, per layer, just the streamed experts
    its rows route to (``route`` read back the router's output first), each one expert's
    held bytes and id: at least one of the two (three rows, k = 2 of 4, route to some) and
    never one of the resident pair; the estimate sizes the most a step can route to, so
    the peak is at most it. On disk the same copies read every byte from the spill file
    (the checkpoint's experts are converted when loaded), and each step ends by releasing
    the mapped pages of every tensor it copied, once per copy (the resident set that leaves
    is measured in tests/test_disk_tier.py, on tensors large enough that the pages the
    kernel maps around a fault do not hide it)."""
    import hx
    from hx.devices import discover
    from hx.generate import Engine
    from hx.memory import EXACT, estimate
    from hx import executor as executor_module
    from hx.models.mapped import is_mapped
    from hx.planner import policies
    from hx.sampling import SamplingParams
    from hx.timeline import H2D, Timeline
    from hx.workload import Workload

    from hf_families import PROMPTS, write_checkpoint

    write_checkpoint("qwen2_moe", str(tmp_path))
    model = hx.load(str(tmp_path), dtype="float32")
    spec, devices = model.spec, discover()
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=4, stop_ids=())
    want = [c.token_ids for c in Engine(model, policies.all_accelerator(spec.n_layers),
                                        devices).generate_ids(prompts, params)]
    plan = policies.resident_experts(spec, 2, rest)
    timeline = Timeline()
    engine = Engine(model, plan, devices, timeline=timeline, spill_dir=str(tmp_path))
    work = Workload.for_prompts(len(prompts), max(map(len, prompts)), 4, spec)
    need = estimate(plan.with_prefill_chunk(engine.plan.prefill_chunk), spec, work,
                    engine.executor.programs, EXACT)
    released, real = [], executor_module.release
    monkeypatch.setattr(executor_module, "release", lambda a: (released.append(id(a)), real(a)))
    assert [c.token_ids for c in engine.generate_ids(prompts, params)] == want
    timeline.wait()
    one = spec.expert_part("EXPERTS:streamed", 1).op_weight_bytes("EXPERTS:streamed")
    assert engine.executor.spilled_bytes == (2 * spec.n_layers * one if rest == "disk" else 0)
    read = 1 if rest == "disk" else 0  # the share of a copy read from disk
    for events in timeline.steps("decode"):
        copies = [e.args for e in events if e.resource == H2D and e.name.startswith("experts")]
        assert not [e for e in events if e.name.startswith("weights")]  # none copied whole
        if rest == "host":
            assert copies == []
            continue
        assert len(copies) == spec.n_layers
        for args in copies:
            assert args["bytes"] == one * len(args["experts"])
            assert args["disk_bytes"] == read * args["bytes"]
            assert set(args["experts"]) <= {2, 3} and args["experts"]
    for events in timeline.steps("prefill"):  # 64 rows x k = 2 route past 4 x 2 experts
        whole = [e.args for e in events if e.name.endswith("(whole)")]
        assert not [e for e in events if e.name.startswith("route")]
        assert whole == ([] if rest == "host" else
                         [{"bytes": 2 * one, "disk_bytes": 2 * one * read, "layers": [layer],
                           "experts": [2, 3]} for layer in range(spec.n_layers)])
    if rest == "disk":
        experts = [e for params in engine.executor._params["decode"] for p in params
                   if isinstance(p, tuple) for e in p]
        assert len(experts) == 2 * spec.n_layers
        assert all(is_mapped(leaf) for e in experts for leaf in jax.tree.leaves(e))
        per_expert = len(jax.tree.leaves(experts[0]))
        leaves = {id(leaf) for e in experts for leaf in jax.tree.leaves(e)}
        copied = sum(len(e.args["experts"]) for e in timeline.events
                     if e.resource == H2D and e.name.startswith("experts"))
        assert set(released) == leaves and len(released) == copied * per_expert
    if rest == "host":
        assert engine.accountant.peak == need.accelerator
    else:
        assert engine.accountant.peak <= need.accelerator


def test_a_prefill_chunk_stages_the_streamed_experts_whole_ahead_of_their_layer():
    """Qwen3-30B-A3B's shapes (4 layers, q4_0) under ``resident-experts:64:streamed``: a
    prefill chunk of 64 rows routes 512 times, 8 a streamed expert (past
    ``WHOLE_PART_ROUTINGS``), so each layer's 64 streamed experts are staged whole -- one
    stage of 64 experts' bytes, no ``route`` -- the first before the step's first launch,
    each next one as soon as the previous layer's have run (a ``wait`` on them: one buffer),
    before the ops between launch; the simulator prices a stage as 64 copies. A decode step
    of one row still reads its routing back and copies 8."""
    from hx.models.spec import preset
    from hx.planner import policies
    from hx.planner.simulator import stage_seconds
    from hx.schedule import (EXPERTS_IN, LAUNCH, ROUTE, STAGE, WAIT, compile_schedule,
                             routed_expert_bytes)

    from profiles import gpu_like

    spec = preset("qwen3-30b-a3b:4L").replace(dtype="bfloat16", weight_format="q4_0")
    plan = policies.resident_experts(spec, 64, "streamed")
    one = routed_expert_bytes(spec)
    prefill = compile_schedule(plan, spec, "prefill", 1, 64, 64)
    out = prefill.instructions
    parts = sorted(i for i, seg in enumerate(prefill.segments) if seg.routes)
    first = {(ins.kind, ins.segment): n for n, ins in reversed(list(enumerate(out)))}
    assert not [ins for ins in out if ins.kind in (ROUTE, EXPERTS_IN)]
    assert [out[first[(STAGE, j)]].nbytes for j in parts] == [64 * one] * 4
    assert first[(STAGE, parts[0])] < min(n for n, ins in enumerate(out) if ins.kind == LAUNCH)
    for previous, j in zip(parts, parts[1:]):
        assert (first[(LAUNCH, previous)] < first[(WAIT, previous)] < first[(STAGE, j)]
                < first[(LAUNCH, previous + 1)] < first[(LAUNCH, j)])
    profile = gpu_like()
    seg = prefill.segments[parts[0]]
    assert stage_seconds(profile, seg, 64 * one) == pytest.approx(
        64 * profile.h2d_latency + 64 * one / profile.h2d_bandwidth)
    decode = compile_schedule(plan, spec, "decode", 1, 1, 64)
    assert [(ins.kind, ins.nbytes) for ins in decode.instructions
            if ins.kind in (STAGE, EXPERTS_IN)] == [(EXPERTS_IN, 8 * one)] * 4
    assert len([ins for ins in decode.instructions if ins.kind == ROUTE]) == 4


def test_two_whole_part_buffers_stage_a_layer_ahead(monkeypatch):
    """``WHOLE_PART_BUFFERS`` = 2 (not the default: CP-SAT's placements do not choose it yet):
    the first two layers' streamed parts staged before the first launch, each next one once
    the part two layers back has run; the estimate holds one more part (64 experts' bytes)
    and the simulator predicts a shorter prefill on the gpu_like profile."""
    from hx import schedule
    from hx.memory import estimate
    from hx.models.spec import preset
    from hx.planner import policies
    from hx.planner.simulator import predict_run
    from hx.schedule import LAUNCH, STAGE, WAIT, compile_schedule, routed_expert_bytes
    from hx.workload import Workload

    from profiles import gpu_like

    spec = preset("qwen3-30b-a3b:4L").replace(dtype="bfloat16", weight_format="q4_0")
    plan = policies.resident_experts(spec, 64, "streamed").with_prefill_chunk(64)
    work = Workload.for_prompts(1, 64, 4, spec)

    def planned():
        compile_schedule.cache_clear()
        estimate.cache_clear()
        return (compile_schedule(plan, spec, "prefill", 1, 64, 68), estimate(plan, spec, work),
                predict_run(plan, spec, gpu_like(), work).ttft_s)

    _, one_need, one_ttft = planned()
    monkeypatch.setattr(schedule, "WHOLE_PART_BUFFERS", 2)
    prefill, two_need, two_ttft = planned()
    out = prefill.instructions
    parts = sorted(i for i, seg in enumerate(prefill.segments) if seg.routes)
    first = {(ins.kind, ins.segment): n for n, ins in reversed(list(enumerate(out)))}
    start = min(n for n, ins in enumerate(out) if ins.kind == LAUNCH)
    assert first[(STAGE, parts[0])] < start and first[(STAGE, parts[1])] < start
    for back, j in zip(parts, parts[2:]):
        assert first[(LAUNCH, back)] < first[(WAIT, back)] < first[(STAGE, j)] < first[(LAUNCH, j)]
        assert first[(STAGE, j)] < first[(LAUNCH, j - 1)]  # ahead of the layer before
    assert two_need.accelerator - one_need.accelerator == 64 * routed_expert_bytes(spec)
    assert two_ttft < one_ttft
    monkeypatch.undo()
    compile_schedule.cache_clear()
    estimate.cache_clear()


def test_routed_picks_the_experts_some_row_routes_to():
    """``routed_experts.routed`` over routing weights (rows, X), 0 off each row's k: the
    indices into a part's ids of the experts with a nonzero weight in some row, in the
    part's order; an expert no row picks is left."""
    from hx.routed_experts import routed

    weights = np.zeros((3, 8), np.float32)
    weights[0, [1, 6]] = 0.5
    weights[1, [6, 2]] = (0.7, 0.3)
    weights[2, [1, 2]] = (0.9, 0.1)
    assert routed(weights, (6, 0, 2, 7)) == [0, 2]
    assert routed(weights.reshape(1, 3, 8), (7, 1)) == [1]
    assert routed(weights, (0, 3)) == []


@pytest.mark.parametrize("fmt", ["dense", "int8", "q4_0", "q4_1"])
def test_gathered_experts_equal_every_expert_and_float64(fmt):
    """MLP2 of a tiny Qwen3-MoE layer (X = 8, k = 2) in each weight format on XLA: at one
    row (2 < 8 (row, expert) products: each row's k experts gathered, ``models.moe.gathers``)
    and at 8 rows (every expert run, weighted 0 off the k) the row's output equals a float64
    computation over the decompressed matrices (within float32 rounding: 1e-5 of the
    largest)."""
    from hx.models.compressed import GroupMatrix
    from hx.models.decoder import apply_op, init_params
    from hx.models.layers import Step
    from hx.models.spec import ModelSpec, MoeShape, gathers

    spec = ModelSpec(name="tiny moe", family="qwen3_moe", vocab_size=64, context_length=16,
                     n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=32,
                     moe=MoeShape(8, 2, 32, norm_top_k=True), weight_format=fmt)
    params = init_params(spec, 3)["layer_0"]["MLP2"]
    decoded = {kind: np.asarray(m.decompress(np.float32) if isinstance(m, GroupMatrix) else m,
                                np.float64)
               for kind, m in params["experts"].items()}
    rng = np.random.default_rng(7)
    n = rng.standard_normal(64).astype(np.float32)
    weights = np.zeros(8, np.float32)
    weights[[5, 2]] = (0.75, 0.25)
    want = sum(w * decoded["down_kernel"][e] @ (
        silu(decoded["gate_kernel"][e] @ n) * (decoded["up_kernel"][e] @ n))
               for e, w in ((5, 0.75), (2, 0.25)))
    assert gathers(1, 2, 8) and not gathers(8, 2, 8)
    for rows in (1, 8):
        a = np.tile(np.concatenate([n, weights]), (1, rows, 1))
        x = np.zeros((1, rows, 64), np.float32)
        step = Step(np.zeros((1, rows), np.int32), np.int32(0), np.zeros((1,), np.int32))
        out, _ = apply_op(spec, "MLP2", params, {"a": a, "x": x}, step)
        got = np.asarray(out["x"])[0]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), rows
