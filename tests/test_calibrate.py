"""The profile fits recover a known profile from decode steps it predicts (no timing)."""

import dataclasses

import pytest

from hx.models.spec import PRESETS
from hx.planner import policies
from hx.planner.calibrate import (FIT_PASSES, dispatch_plans, fit_compute, fit_launch,
                                  fit_streaming, predicted_decode)
from profiles import gpu_like

BATCHES = (1, 16)


def with_sides(profile, **fields):
    return dataclasses.replace(
        profile, accelerator=dataclasses.replace(profile.accelerator, **fields),
        host=dataclasses.replace(profile.host, **fields))


def test_fits_recover_the_profile_that_produced_the_steps():
    spec = PRESETS["smollm2-135m"]
    n = spec.n_layers
    truth = dataclasses.replace(
        with_sides(gpu_like(), launch_overhead=((1, 3e-5), (16, 9e-5)),
                   compute_scale=((1, 1.3), (16, 0.8))),
        contention=0.3, sync_overhead=4e-4)
    plans = ([policies.all_accelerator(n), policies.all_host(n), policies.stream_all(n)]
             + dispatch_plans(n))
    seen = {(p, b): predicted_decode(p, spec, truth, b) for p in plans for b in BATCHES}
    start = dataclasses.replace(with_sides(truth, launch_overhead=(), compute_scale=()),
                                contention=0.0, sync_overhead=0.0)
    fitted = start
    for _ in range(FIT_PASSES):
        fitted = fit_compute(fitted, spec, seen, BATCHES, lambda message: None)
        fitted = fit_launch(fitted, spec, seen, BATCHES, lambda message: None)
    fitted = fit_streaming(fitted, spec, seen, BATCHES, lambda message: None)
    for b in BATCHES:
        assert fitted.accelerator.launch_seconds(b) == pytest.approx(
            truth.accelerator.launch_seconds(b),
                                                             rel=0.1)
        for side in ("accelerator", "host"):
            assert fitted.device(side).scale(b) == pytest.approx(truth.device(side).scale(b),
                                                                 rel=0.1)
    assert fitted.contention == pytest.approx(0.3)
    assert fitted.sync_overhead == pytest.approx(4e-4)
    for p in plans:  # and the fitted profile predicts every observed step
        for b in BATCHES:
            assert predicted_decode(p, spec, fitted, b) == pytest.approx(seen[(p, b)], rel=0.05)
