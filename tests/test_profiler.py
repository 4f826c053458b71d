"""The profiler: the quick profile a command measures when none is saved (every figure there,
kept apart from the default, calibrated), the link fit and the JSON round trip -- what holds
however loaded the machine is. Whether each figure matches a direct measurement on this
machine now is a benchmark's: ``scripts/bench_profile_stability.py``."""

import dataclasses
import math
import os

import pytest

from conftest import TINY
from hx.measure import profiler, timing
from hx.measure.calibrate import SCALE_BATCHES, refine
from hx.measure.links import fit_line
from hx.planner.profile import HardwareProfile, load_default


def test_fit_line():
    # 1 ms + bytes / 10 GB/s through two sizes
    assert fit_line(10**7, 2e-3, 4 * 10**7, 5e-3) == pytest.approx((1e10, 1e-3))
    # noise making the small copy the slower one: no negative latency, the large copy's rate
    assert fit_line(10**7, 6e-3, 4 * 10**7, 5e-3) == (4 * 10**7 / 5e-3, 0.0)


@pytest.mark.slow
def test_quick_profile_is_measured_kept_apart_and_calibrates(devices, tmp_path, monkeypatch):
    """A command without a profile measures a quick one, says so in one line and keeps it
    apart from the default (``QUICK_PATH``): the next command that needs a profile loads it,
    saying so, while ``load_default`` (a plain ``hx generate``) still finds none; calibration
    refines it. (How long it takes is a benchmark's: ``scripts/bench_quick_profile.py``, not
    timed here under a loaded suite.)"""
    monkeypatch.setattr("hx.planner.profile.DEFAULT_PATH", str(tmp_path / "profile.json"))
    monkeypatch.setattr(profiler, "QUICK_PATH", str(tmp_path / "quick.json"))
    lines = []
    quick = profiler.load_or_measure(None, devices, lines.append)
    assert len(lines) == 1 and "measured a quick one" in lines[0], lines
    assert str(tmp_path / "quick.json") in lines[0] and "hx profile" in lines[0], lines
    assert os.listdir(tmp_path) == ["quick.json"] and load_default(None) is None
    assert quick.quick and "quick" in quick.name
    assert quick.emulated == devices.accelerator.emulated and quick.model_error == 0
    for side in (quick.accelerator, quick.host):
        assert [m for m, _ in side.matmul] == list(timing.QUICK.matmul_rows)
        assert all(rate > 0 for _, rate in side.matmul + side.matmul_low + side.attention)
        assert side.memory_bandwidth > 0 and side.launch_seconds(1) >= 0
    assert quick.h2d_bandwidth > 0 and quick.d2h_bandwidth > 0 and quick.transfer_latency > 0
    assert quick.round_trip > 0 and quick.disk_read_bandwidth > 0
    # bfloat16 rates on the accelerator, where a bf16 model's ops run; the host computes float32
    assert [m for m, _ in quick.accelerator.matmul_low] == list(timing.QUICK.matmul_rows)
    assert quick.host.matmul_low == ()
    # ggml's products per layout the host holds a GGUF's blocks in, to the rows each takes
    from hx.host_compute import ggml_kernel
    if ggml_kernel.unavailable() is None:
        most = dict(ggml_kernel.KERNEL_ROWS)
        assert {"q4_0", "q4_1", "q8_0"} <= {layout for layout, _ in quick.host.ggml_matmul}
        for layout, curve in quick.host.ggml_matmul:
            assert [m for m, _ in curve] == [m for m in timing.QUICK.matmul_rows
                                             if m < most[layout]] + [most[layout]]
            assert all(rate > 0 for _, rate in curve)
    assert quick.accelerator.ggml_matmul == ()
    # a device switch costs something: the launch fit takes what the transfers leave (>= 0)
    assert quick.accelerator.launch_seconds(1) + quick.transfer_latency > 0
    assert 0 <= quick.contention <= 1
    assert HardwareProfile.load(str(tmp_path / "quick.json")) == quick
    again = []
    assert profiler.load_or_measure(None, devices, again.append) == quick
    assert len(again) == 1 and "using the quick one" in again[0], again

    refined = refine(quick, TINY, profiler._random_params(TINY), devices, (1,))
    for side in (refined.accelerator, refined.host):
        assert [b for b, _ in side.compute_scale] == [1, *SCALE_BATCHES]
        assert all(f >= 0 for _, f in side.compute_scale + side.launch_overhead)
    # the fit is least squares over 8 plans: a broken fit misses by far more
    assert math.isfinite(refined.model_error) and 0 <= refined.model_error < 0.5
    refined.save(str(tmp_path / "p.json"))
    assert HardwareProfile.load(str(tmp_path / "p.json")) == refined


def test_disk_read_probe_leaves_nothing_behind_and_a_missing_disk_is_no_tier(tmp_path):
    """The cold read probe reads a file it writes in the directory given, which it leaves as it
    found it (the file has no name); where no file can be written there is no disk tier (rate 0),
    said in a line, and planning goes on without one."""
    from hx.measure.rates import measure_disk_read

    assert measure_disk_read(str(tmp_path), 8 * timing.MiB, timing.QUICK) > 0
    assert os.listdir(tmp_path) == []
    lines = []
    missing = str(tmp_path / "missing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler.tempfile, "gettempdir", lambda: missing)
        assert profiler.measure_disk(timing.QUICK, lines.append) == 0.0
    assert "cannot write a file in " + missing in lines[-1], lines


def test_new_fields_round_trip_and_old_files_load(tmp_path):
    from profiles import gpu_like

    base = gpu_like()
    profile = dataclasses.replace(
        base, h2d_latency=1e-5, d2h_latency=2e-5, quick=True, round_trip=3e-4,
        accelerator=dataclasses.replace(base.accelerator, matmul_low=((1, 2e12), (64, 3e13)),
                                        dequantize=(("int4", ((1024, 1e-11),)),),
                                        dequantize_low=(("int4", ((1024, 2e-11),
                                                                  (2**24, 3e-11))),
                                                        ("q8_0", ((1024, 0.0),)))),
        host=dataclasses.replace(base.host, int4_matmul=((1, 5e10), (64, 2e11)),
                                 ggml_matmul=(("q4_0 repacked", ((1, 9e10), (512, 1.5e11))),
                                              ("q8_0", ((1, 4e10),)))))
    profile.save(str(tmp_path / "p.json"))
    assert HardwareProfile.load(str(tmp_path / "p.json")) == profile
    old = base.to_json()
    for name in ("h2d_latency", "d2h_latency", "quick", "round_trip"):
        del old[name]
    del old["accelerator"]["matmul_low"], old["accelerator"]["dequantize"]
    old["matmul_dtype"] = "float32"  # a field older files have: ignored
    loaded = HardwareProfile.from_json(old)
    assert loaded == base and not loaded.quick and loaded.accelerator.matmul_low == ()
    assert loaded.accelerator.dequantize == () and loaded.host.int4_matmul == ()
    assert loaded.host.ggml_matmul == ()
