"""hx.distributed: pipeline stages in two processes joined by jax.distributed (a localhost
coordinator, gloo between the CPU processes), against the same plan in one process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_two_processes_give_one_process_outputs(tmp_path):
    """A tiny model in two stages, one per process, under stream-all (weights streamed, KV
    caches and attention on the host): each process's prefill logits equal the one-process
    pipeline's and one accelerator's (the same programs on the same numbers: within 1e-5, here
    exactly), the same greedy tokens, and each process's accelerator peak that stage's peak in
    one process."""
    out = tmp_path / "pp.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "pp_processes.py"),
                             "--plans", "stream-all", "--decode", "2", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["process"] for r in rows] == [0, 1]
    for r in rows:
        assert r["vs_one_process"] <= 1e-5 and r["vs_one_accelerator"] <= 1e-5, r
        assert r["tokens_equal"], r
        assert r["peaks"] == [r["one_process_peaks"][r["process"]]], r


def test_a_process_takes_part_in_every_crossing_even_between_others():
    """Four stages over three processes (0, 1, 1, 2), seen from process 0: it owns stage 0
    only, yet calls the collective at every boundary between processes and for the logits
    (every process must, in the same order) -- giving its own array at the first, zeros
    (None) at the others -- and never at the boundary inside process 1."""
    from types import SimpleNamespace

    from hx.models.spec import PRESETS
    from hx.pipeline import Pipeline, Stage

    def stage(owner, mine):
        device = SimpleNamespace(process_index=owner)
        return Stage(range(1), PRESETS["smollm2-135m"].pipeline_stage(range(1), False, False),
                     None, SimpleNamespace(accelerator=SimpleNamespace(device=device)),
                     object() if mine else None)

    calls = []
    pipe = Pipeline.__new__(Pipeline)  # only _cross is exercised
    pipe._broadcast = lambda a, shape, dtype: calls.append((a, shape, dtype)) or a
    stages = [stage(0, True), stage(1, False), stage(1, False), stage(2, False)]
    for source, target in zip(stages, stages[1:] + [None]):
        pipe._cross(source, target, ["x"], 2, 3)
    x = ((2, 3, 576), "float32")  # the residual stream x (B, T, D) of a middle stage
    assert calls == [("x", *x), (None, *x), (None, *x)]
