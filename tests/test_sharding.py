"""Tensor parallelism's split of the model's arrays (models/sharding.py): the padded shapes
agree with what the planner prices (ModelSpec.shard), and the split model's logits equal the
model's on one device (a process with five XLA CPU devices)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hx.errors import HxError
from hx.models.sharding import TP_AXIS, cache_partition, padded_spec, partition
from hx.models.spec import PRESETS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model,tp", [("smollm2-135m", 2), ("smollm2-135m", 4),
                                      ("llama2-70b", 8), ("llama2-7b", 4), ("qwen2.5-7b", 4)])
def test_each_device_holds_what_the_planner_prices(model, tp):
    """Where tp divides the (padded) KV heads; fewer KV heads than devices is a known
    difference (module docstring of models/sharding.py)."""
    spec = PRESETS[model]
    wide = padded_spec(spec, tp)
    shard = spec.shard(tp)
    assert (wide.n_heads // tp, wide.n_kv_heads // tp, wide.d_ff // tp) == (
        shard.n_heads, shard.n_kv_heads, shard.d_ff)
    assert wide.n_heads // wide.n_kv_heads == spec.n_heads // spec.n_kv_heads  # groups kept


def test_which_axis_each_array_splits():
    spec = PRESETS["llama2-7b"]
    assert partition(spec, "layer_0/Q/wq/kernel", (8, 16, 64), 4) == (TP_AXIS, None, None)
    assert partition(spec, "layer_0/OUT/wo/kernel", (64, 8, 16), 4) == (None, TP_AXIS, None)
    assert partition(spec, "layer_3/MLP2/w_down/kernel", (64, 96), 4) == (None, TP_AXIS)
    assert partition(spec, "layer_0/Q/attn_norm/scale", (64,), 4) == (None,)
    assert partition(spec, "EMBED/embedding", (49152, 64), 4) == (TP_AXIS, None)
    assert partition(spec, "EMBED/embedding", (49153, 64), 4) == (None, None)  # whole, not split
    assert cache_partition((2, 32, 4, 16), 4) == (None, None, TP_AXIS, None)
    assert cache_partition((2, 32, 8, 16), 16) == (None, None, None, None)  # copies
    opt = PRESETS["opt-6.7b"]  # fc1's bias splits with fc1, fc2's stays whole
    assert partition(opt, "layer_0/MLP1/w_up/bias", (96,), 4) == (TP_AXIS,)
    assert partition(opt, "layer_0/MLP2/w_down/bias", (64,), 4) == (None,)
    # a compressed matrix's arrays split on the matrix's own axis: groups where its last was
    assert partition(spec, "layer_0/MLP2/w_down/kernel/codes", (64, 4, 32), 2) == (
        None, TP_AXIS, None)
    assert partition(spec, "layer_0/Q/wq/kernel/scale", (8, 16, 2), 2) == (TP_AXIS, None, None)
    assert partition(spec, "layer_0/Q/attn_norm/scale", (64,), 2) == (None,)
    int4 = PRESETS["llama2-7b"].replace(weight_format="int4", d_ff=11000)
    assert padded_spec(int4, 2).d_ff == 11008  # F padded by whole groups of 64 per device
    with pytest.raises(HxError, match="--host-matmul xla"):
        padded_spec(int4.replace(host_matmul="torch-int4"), 2)


@pytest.mark.slow
def test_split_logits_equal_one_devices(tmp_path):
    """A tiny model with 3 KV heads (padded to 4 for tp 2 and 4) and 4 layers, its matrices
    int8 (compressed matrices split as dense ones; the script runs dense ones too), in a
    process with five XLA CPU devices: the single-jit model split over the mesh, then hx's executor
    under stream-all (weights streamed, KV caches and attention on the host; the script also
    runs all-on-accelerator and KV on the host in odd layers) over 4 accelerators in tensor
    parallel and in 2 pipeline stages of 2: each accelerator's budget its part's own
    estimate. Logits within 1e-5 of one accelerator's, the same greedy tokens, and every
    accelerator's peak exactly its estimate (the dry run of its shard or stage)."""
    out = tmp_path / "mesh.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "mesh_exactness.py"),
                             "--executor", "--layouts", "tp4,tp2xpp2", "--plans",
                             "stream-all", "--weights", "int8", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(out.read_text())
    assert [r["tp"] for r in found["rows"]] == [2, 4]
    for r in found["rows"]:
        assert r["max_rel_logit_diff"] <= 1e-5 and r["greedy_equal"]
        # every split leaf divides evenly; the copies are the norms and the per-output-row
        # scales of row-parallel matrices (their contracted axis is the split one)
        assert r["device_bytes"] == r["split_share"]
        assert r["replicated_bytes"] < 0.05 * r["whole_over_tp"] * r["tp"]
    runs = found["executor"]
    assert [(r["plan"], r["tp"], r["pp"], len(r["peaks"])) for r in runs] == [
        ("stream-all", 4, 1, 1), ("stream-all", 2, 2, 2)]
    for r in runs:
        assert r["max_rel_logit_diff"] <= 1e-5 and r["greedy_equal"], r
        assert r["peaks"] == r["budgets"], r
        # stream-all's peak is its largest staged op: the last stage's LM head, as on one;
        # split 4 ways, under half of it (measured: 0.31 of it dense, 0.44 int8, whose
        # decompressed chunk of the table and per-row scales are held beside the codes)
        assert max(r["peaks"]) <= r["one_accelerator_peak"] * (0.5 if r["tp"] == 4 else 1), r
    # 2 stages of 2: each accelerator holds less than one accelerator (dense, the first stage
    # less than the second, which has HEAD; int8 more, 173 KB against 165: not yet explained)
    assert max(runs[1]["peaks"]) < runs[1]["one_accelerator_peak"]
