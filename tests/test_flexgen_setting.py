"""scripts/flexgen_setting.py: FlexGen's policies placed as FlexGen places them, and its runs
timed and counted as FlexGen's benchmark (``--debug fewer_batch``) times and counts them."""

import sys
from pathlib import Path

import pytest

from hx.models.spec import PRESETS as MODELS
from hx.plan import DISK, RESIDENT, STREAMED, WEIGHTED_OPS
from hx.planner.hardware import hardware_profile
from hx.planner.simulator import RunPrediction, predict_run

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import flexgen_setting as fs  # noqa: E402


def test_flexgen_homes_follow_flexgens_weight_split():
    """FlexGen homes each tensor per sub-layer (attention, MLP) by its midpoint, disk first:
    OPT-30B at 20/80 keeps only OUT on the GPU; OPT-175B at 0/50 puts Q, K and fc1 (half of
    every layer's bytes) on disk."""
    homes = dict(zip(WEIGHTED_OPS, fs.flexgen_homes(MODELS["opt-30b"], 20, 80)))
    assert homes == {"Q": STREAMED, "K": STREAMED, "V": STREAMED, "OUT": RESIDENT,
                     "MLP1": STREAMED, "MLP2": STREAMED}
    spec = MODELS["opt-175b"]
    homes = dict(zip(WEIGHTED_OPS, fs.flexgen_homes(spec, 0, 50)))
    assert [op for op, h in homes.items() if h == DISK] == ["Q", "K", "MLP1"]
    on_disk = sum(spec.op_weight_bytes(op) for op, h in homes.items() if h == DISK)
    assert on_disk / spec.layer_weight_bytes == pytest.approx(0.5, rel=0.01)


def test_decode_is_timed_at_the_first_decode_token():
    """FlexGen's benchmark times token 1 (512 cached slots read), hx prices mid-generation
    (512 + 16); everything else about the workload is the scenario's."""
    scenario = fs.SETTINGS[0][2]
    ours, flexgens = scenario.workload(), fs.flexgen_workload(scenario)
    assert ours.decode_context == 528 and flexgens.decode_context == 512
    assert (flexgens.batch, flexgens.micro_batches, flexgens.cache_slots,
            flexgens.decode_steps) == (ours.batch, ours.micro_batches, ours.cache_slots, 31)


def test_flexgen_counts_decode_as_all_its_sublayers():
    """Generated tokens over prefill + 31 steps, each (L + 1) / L of the simulated one (2L + 2
    sub-layers at the mean sub-layer time)."""
    workload = fs.flexgen_workload(fs.SETTINGS[0][2])  # 48 x 3, 32 generated
    run = RunPrediction(0.0, ttft_s=200.0, tpot_s=10.0, total_s=0.0, utilisation={},
                        decode=None)
    expected = 144 * 32 / (200.0 + 31 * 10.0 * 49 / 48)
    assert fs.flexgen_tokens_per_s(run, workload, 48) == pytest.approx(expected)
    assert fs.flexgen_tokens_per_s(run, workload, 48) < 144 * 32 / (200.0 + 31 * 10.0)


def test_flexgen_prefills_the_whole_prompt_in_one_pass():
    """FlexGen's plan prefills each GPU batch's 512 tokens at once (one chunk), and its
    simulated prefill is faster than hx's smallest chunks would make it (the streamed weights
    cross the link once, not once per chunk)."""
    model, policy, scenario, _ = fs.SETTINGS[0]
    spec, profile = MODELS[model].replace(dtype="float16"), hardware_profile("t4")
    workload = fs.flexgen_workload(scenario)
    plan = fs.flexgen_plan(spec, policy, profile, workload)
    assert plan.prefill_chunk is None
    one_pass = predict_run(plan, spec, profile, workload).ttft_s
    chunked = predict_run(plan.with_prefill_chunk(32), spec, profile, workload).ttft_s
    assert one_pass < chunked


def test_compressed_rows_say_what_hx_lacks():
    rows = fs.compressed_rows()
    assert [(r["model"], r["published_tok_s"]) for r in rows] == [("OPT-30B", 8.38),
                                                                  ("OPT-175B", 1.12)]
    assert all("tokens_per_s" not in r and "compressed KV cache" in r["error"] for r in rows)
