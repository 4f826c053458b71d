"""The profiler and calibration run end to end on this machine and give a usable profile
(the rates vary run to run here, so only invariants are asserted)."""

import math

from conftest import TINY
from hx.planner.calibrate import refine
from hx.planner.profile import HardwareProfile
from hx.planner.profiler import measure


def test_measure_then_refine(tiny_model, devices, tmp_path):
    measured = measure(devices, launch=False)
    for side in (measured.accelerator, measured.host):
        ms = [m for m, _ in side.matmul]
        assert ms == sorted(ms) and all(rate > 0 for _, rate in side.matmul)
        assert side.memory_bandwidth > 0 and all(rate > 0 for _, rate in side.attention)
    assert measured.h2d_bandwidth > 0 and measured.d2h_bandwidth > 0
    assert 0 <= measured.contention <= 1 and measured.model_error == 0
    assert measured.emulated == devices.accelerator.emulated

    lines = []
    refined = refine(measured, TINY, tiny_model.params, devices, (1, 4), lines.append)
    for side in (refined.accelerator, refined.host):
        assert [b for b, _ in side.compute_scale] == [1, 4]
        assert [b for b, _ in side.launch_overhead] == [1, 4]
        assert all(f >= 0 for _, f in side.compute_scale + side.launch_overhead)
    assert refined.transfer_latency >= 0 and 0 <= refined.contention <= 1
    # the fit is least squares over 8 plans x 2 batches: a broken fit misses by far more
    assert math.isfinite(refined.model_error) and 0 <= refined.model_error < 0.5, lines
    refined.save(str(tmp_path / "p.json"))
    assert HardwareProfile.load(str(tmp_path / "p.json")) == refined
