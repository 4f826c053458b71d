"""Placing a Mixture of Experts' routed experts one by one (``hx.planner.experts``): activity
profiles, CP-SAT's placement against kTransformers' and Fiddler's rules and llama.cpp's
``--cpu-moe``, on Qwen3-30B-A3B's shapes with a GPU-like profile (nothing runs)."""

import json

import numpy as np
import pytest

from hx.devices import discover
from hx.errors import HxError
from hx.memory import estimate
from hx.models.spec import preset
from hx.planner import policies
from hx.planner.experts import ExpertActivity, ExpertCosts, hot_experts
from hx.planner.simulator import predict_run
from hx.workload import Workload

from profiles import LARGE_HOST, gpu_like

SPEC = preset("qwen3-30b-a3b:4L").replace(dtype="bfloat16", weight_format="q4_0")


def test_activity_profiles_sum_to_k_per_layer(tmp_path):
    """Each layer's shares sum to k, none above 1: uniform k/X each; Zipf skewed (its top
    expert over ten times its median) and reproducible by seed; a trace's counts scaled; a
    trace of another shape refused with the shape it needs."""
    k, X = SPEC.moe.top_k, SPEC.moe.routed
    for activity in (ExpertActivity.uniform(SPEC), ExpertActivity.zipf(SPEC, 1.0, seed=3)):
        shares = np.asarray(activity.shares)
        assert shares.shape == (4, X) and np.allclose(shares.sum(1), k)
        assert shares.max() <= 1
    zipf = np.asarray(ExpertActivity.zipf(SPEC, 1.0, seed=3).shares)
    assert (zipf.max(1) > 10 * np.median(zipf, 1)).all()
    assert ExpertActivity.zipf(SPEC, 1.0, seed=3) == ExpertActivity.zipf(SPEC, 1.0, seed=3)
    counts = [[e + 1 for e in range(X)]] * 4
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"layers": counts}))
    traced = np.asarray(ExpertActivity.from_trace(str(path), SPEC).shares)
    assert np.allclose(traced.sum(1), k) and traced[0, -1] == pytest.approx(X * traced[0, 0])
    path.write_text(json.dumps({"layers": counts[:3]}))
    with pytest.raises(HxError, match="4 layers of 128 experts"):
        ExpertActivity.from_trace(str(path), SPEC)


def test_hot_experts_take_the_hottest_within_the_bytes():
    """kTransformers' rule keeps the hottest (layer, expert) pairs the bytes hold, Fiddler's
    the same count of each layer's hottest; the rest on the host."""
    activity = ExpertActivity.zipf(SPEC, 1.2, seed=1)
    shares = np.asarray(activity.shares)
    one = ExpertCosts.price(SPEC, gpu_like(), Workload.for_prompts(1, 64, 8, SPEC),
                            activity).nbytes
    for per_layer in (False, True):
        homes = hot_experts(SPEC, activity, 40 * one, per_layer)
        resident = np.array([[h == "resident" for h in row] for row in homes.layers])
        assert resident.sum() == 40
        assert set(h for row in homes.layers for h in row) == {"resident", "host"}
        if per_layer:
            assert (resident.sum(1) == 10).all()
            for layer in range(4):  # each layer's ten hottest
                assert resident[layer, np.argsort(-shares[layer])[:10]].all()
        else:  # no expert left on the host is hotter than one kept
            assert shares[resident].min() >= shares[~resident].max()


@pytest.mark.parametrize("skew", [None, 1.2])
def test_cpsat_places_experts_no_slower_than_the_rules_and_within_the_budgets(skew):
    """Twelve layers at a quarter of the model's bytes on the accelerator (a GPU-like profile,
    64-token prompt, 32 new tokens): CP-SAT's experts-one-by-one plan fits the budgets (its estimate
    within them) and its predicted run is no longer than ``cpu-moe``'s, kTransformers' or
    Fiddler's under the same activity; with a skewed router the experts it keeps resident
    take 1.5 times the picks their number would under a uniform one (the rest are streamed
    or on the host, whichever the profile prices lower)."""
    spec = preset("qwen3-30b-a3b:12L").replace(dtype="bfloat16", weight_format="q4_0")
    work = Workload.for_prompts(1, 64, 32, spec)
    devices = discover(accelerator_memory=int(0.25 * spec.weight_bytes),
                       host_memory=LARGE_HOST)
    activity = (ExpertActivity.uniform(spec) if skew is None
                else ExpertActivity.zipf(spec, skew, seed=0))
    profile = gpu_like()
    runs = {}
    for name in ("cpsat", "cpu-moe", "ktransformers", "fiddler"):
        plan = policies.build(name, spec, devices, work, profile=profile, activity=activity,
                              time_limit_s=2.0)
        assert estimate(plan, spec, work).accelerator <= devices.accelerator.capacity
        runs[name] = predict_run(plan, spec, profile, work).total_s
        if name == "cpsat":
            homes = np.array(plan.experts.layers)
    assert runs["cpsat"] <= 1.001 * min(runs.values())
    resident = homes == "resident"
    assert resident.any()
    if skew is not None:
        shares = np.asarray(activity.shares)
        assert shares[resident].sum() / shares.sum() > 1.5 * resident.mean()


@pytest.mark.parametrize("rest", ["host", "streamed"])
def test_the_simulator_prices_the_activity_it_is_given(rest):
    """A decode step of two Qwen3-30B-A3B layers, experts 0-63 resident, the rest on the host
    or streamed (a GPU-like profile whose host has the development VM's ggml rates; q4_0
    experts, which the host multiplies by ggml). The
    uniform activity given prices as none given (a random router's); a router that sends
    every row to resident experts leaves the rest no work (the host's products or the copies
    of streamed experts: only what a layer pays to have them) and one that sends every row to
    the others costs more than uniform (the step's time too; the resident-only step's is no
    longer, the host's work overlapping the accelerator's)."""
    import dataclasses

    from hx.planner.hardware import VM_GGML
    from hx.planner.simulator import predict

    spec = preset("qwen3-30b-a3b:2L").replace(dtype="bfloat16", weight_format="q4_0",
                                               host_matmul="ggml")
    plan = policies.resident_experts(spec, 64, rest)
    profile, X, k = gpu_like(), spec.moe.routed, spec.moe.top_k
    profile = dataclasses.replace(profile, host=dataclasses.replace(profile.host,
                                                                    ggml_matmul=VM_GGML))

    def step(shares):
        activity = None if shares is None else ExpertActivity(((tuple(shares),) * 2))
        tasks = predict(plan, spec, profile, "decode", 1, 1, 64, 32, activity=activity).tasks
        return sum(t.duration for t in tasks if "EXPERTS:" in t.name or t.name.startswith(
            "experts")), predict(plan, spec, profile, "decode", 1, 1, 64, 32,
                                 activity=activity).seconds

    hot = np.zeros(X)
    uniform, none = step([k / X] * X), step(None)
    assert uniform == pytest.approx(none, rel=1e-12)
    hot[:k] = 1.0
    resident_only = step(hot)
    hot[:] = 0.0
    hot[X - k:] = 1.0
    elsewhere = step(hot)
    assert resident_only[0] < uniform[0] < elsewhere[0]
    assert resident_only[1] <= uniform[1] < elsewhere[1]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_expert_trace_counts_the_experts_transformers_routes_to(name, tmp_path):
    """``hx expert-trace`` over a prompts file, on a tiny random checkpoint transformers
    writes: each layer's count of the prompts' tokens routed to each expert equals the top k
    of transformers' router probabilities over the same prompts, and the file reads back as
    the activity those counts say (count / tokens a share)."""
    import torch
    from typer.testing import CliRunner

    import hx
    from hx.cli import bench, experts, generate, planning, simulate  # noqa: F401  (commands)
    from hx.cli.common import app

    from hf_families import PROMPTS, write_checkpoint

    ref = write_checkpoint(name, str(tmp_path / "ckpt"))
    model = hx.load(str(tmp_path / "ckpt"), dtype="float32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    trace = tmp_path / "trace.json"
    result = CliRunner().invoke(app, ["expert-trace", "-m", str(tmp_path / "ckpt"), "--dtype",
                                      "float32", "--prompts", str(prompts), "-o", str(trace)])
    assert result.exit_code == 0, result.output
    got = np.asarray(json.loads(trace.read_text())["layers"])
    want = np.zeros_like(got)
    tokens = 0
    for text in PROMPTS:
        ids = model.tokenizer.encode(text)
        tokens += len(ids)
        with torch.no_grad():
            out = ref(torch.tensor([ids]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            picks = torch.topk(torch.softmax(logits.float(), -1), ref.config.num_experts_per_tok)
            np.add.at(want[layer], picks.indices.flatten().numpy(), 1)
    assert (got == want).all() and (got.sum(axis=1) == tokens * model.spec.moe.top_k).all()
    shares = np.asarray(ExpertActivity.from_trace(str(trace), model.spec).shares)
    assert np.allclose(shares, got / tokens)


def test_routed_pairs_by_device_are_transformers_routing(tmp_path):
    """``Executor.routed`` (what ``hx generate`` reports): on a tiny Qwen3-MoE whose experts 0
    and 1 are resident and 2 and 3 on the host, a 32-token prompt (one prefill chunk, no
    padding) and up to 6 greedy tokens: the pairs counted on each side equal the top k of
    transformers' router over the tokens the run fed (the prompt and those generated before
    the last, or before the end of text); under cpu-moe every pair is MLP2's on the host,
    rows x k x layers."""
    import torch

    import hx
    from hx.generate import Engine
    from hx.sampling import SamplingParams

    from hf_families import write_checkpoint

    ref = write_checkpoint("qwen3_moe", str(tmp_path))
    model = hx.load(str(tmp_path), dtype="float32")
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog!!!!!!!!!!")[:32]
    assert len(ids) == 32
    spec = model.spec
    engine = Engine(model, policies.resident_experts(spec, 2, "host"), discover())
    out = engine.generate_ids([ids], SamplingParams(max_new_tokens=6))[0].token_ids
    fed = ids + (out[:-1] if len(out) == 6 else out)  # an end-of-text token was not fed
    with torch.no_grad():
        logits = ref(torch.tensor([fed]), output_router_logits=True).router_logits
    want = {"resident": 0, "host": 0}
    for layer in logits:
        picks = torch.topk(torch.softmax(layer.float(), -1), spec.moe.top_k).indices.flatten()
        want["resident"] += int((picks < 2).sum())
        want["host"] += int((picks >= 2).sum())
    assert dict(engine.executor.routed.counts) == {("accelerator", "resident"): want["resident"],
                                                   ("host", "host"): want["host"]}
    engine = Engine(model, policies.cpu_moe(spec), discover())
    engine.generate_ids([ids], SamplingParams(max_new_tokens=6))
    assert dict(engine.executor.routed.counts) == {
        ("host", "host"): len(fed) * spec.moe.top_k * spec.n_layers}


def test_disk_homed_experts_are_read_then_copied_and_kept_where_the_host_has_no_room():
    """Experts on disk (``resident-experts:64:disk``: MoE-Infinity's and HOBBIT's SSD tier) on
    Qwen3-30B-A3B's shapes with a GPU-like profile reading 2 GB/s from disk: a decode step
    copies what it routes to as the streamed experts do, each read first -- uniform routing
    of one row, 64 x 8/128 = 4 expected of a layer's 64, 4 x one expert / 2 GB/s more a
    layer -- and a profile without a disk tier cannot price it. CP-SAT's placement keeps
    experts on disk only where the host cannot hold them: with a host budget of 100 experts
    (and room for 200 on the accelerator, the buffer a prefill chunk stages a layer's
    streamed and disk-homed experts into among them) it puts the rest on disk and fits both
    budgets;
    without a host budget, or without a disk in the profile, it keeps none there (the
    latter raising where nothing else fits)."""
    import dataclasses

    from hx.plan import DISK, HOST, RESIDENT, STREAMED
    from hx.planner.experts import cpsat_experts
    from hx.planner.simulator import predict
    from hx.schedule import routed_expert_bytes

    one, bandwidth = routed_expert_bytes(SPEC), 2e9
    profile = dataclasses.replace(gpu_like(), disk_read_bandwidth=bandwidth)

    def experts_in(rest, on=profile):
        tasks = predict(policies.resident_experts(SPEC, 64, rest), SPEC, on, "decode", 1, 1,
                        64, 32).tasks
        return [t.duration for t in tasks if t.name.startswith("experts")]

    streamed, disk = experts_in(STREAMED), experts_in(DISK)
    assert len(disk) == SPEC.n_layers
    for s, d in zip(streamed, disk):
        assert d - s == pytest.approx(4 * one / bandwidth, rel=1e-9)
    with pytest.raises(HxError, match="no disk tier"):
        experts_in(DISK, gpu_like())
    work = Workload.for_prompts(1, 64, 8, SPEC)
    activity = ExpertActivity.zipf(SPEC, 1.2, seed=0)
    homes = np.array(cpsat_experts(SPEC, profile, work, activity, 200 * one, 100 * one,
                                   time_limit_s=2.0).layers)
    held = {home: int((homes == home).sum()) for home in (RESIDENT, STREAMED, HOST, DISK)}
    assert held[DISK] > 0 and held[STREAMED] + held[HOST] <= 100 and held[RESIDENT] <= 200
    assert sum(held.values()) == 4 * 128
    unbounded = np.array(cpsat_experts(SPEC, profile, work, activity, 200 * one, None,
                                       time_limit_s=2.0).layers)
    assert not (unbounded == DISK).any()
    with pytest.raises(HxError, match="no disk"):
        cpsat_experts(SPEC, gpu_like(), work, activity, 200 * one, 100 * one, time_limit_s=2.0)
