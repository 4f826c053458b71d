"""The profile fits recover a known profile from decode steps it predicts (no timing)."""

import dataclasses

import pytest

from hx.measure.calibrate import (BLOCK, SCALE_BATCHES, block_plan, calibration_plans, fit,
                                  predicted_decode)
from hx.models.spec import PRESETS
from hx.planner import policies
from plans import alternating, kv_host_odd
from profiles import gpu_like

BATCHES = (1, 16)


def with_sides(profile, **fields):
    return dataclasses.replace(
        profile, accelerator=dataclasses.replace(profile.accelerator, **fields),
        host=dataclasses.replace(profile.host, **fields))


def test_fits_recover_the_profile_that_produced_the_steps():
    """Steps predicted under a known profile: the fits find its compute scales, the cost of a
    device switch (a launch and a transfer: only their sum is identifiable from these plans),
    contention and sync overhead, and predict held-out plans too. The compute scale at the
    batches only the one-segment plans were seen at (``SCALE_BATCHES``) is found too, where
    interpolating the others' would miss (truth x0.5 at batch 4 between x1.3 and x0.8)."""
    spec = PRESETS["smollm2-135m"]
    n = spec.n_layers
    truth = dataclasses.replace(
        with_sides(gpu_like(), launch_overhead=((1, 3e-5), (16, 9e-5)),
                   compute_scale=((1, 1.3), (4, 0.5), (16, 0.8), (64, 1.1))),
        contention=0.3, sync_overhead=4e-4, transfer_latency=2.5e-5, compute_contention=0.6)
    seen = {(p, b): predicted_decode(p, spec, truth, b)
            for p in calibration_plans(n) for b in BATCHES} | {
        (p, b): predicted_decode(p, spec, truth, b)
        for p in calibration_plans(n)[:2] for b in SCALE_BATCHES}  # the one-segment plans
    batch, micro = BLOCK
    block_seen = predicted_decode(block_plan(n), spec, truth, batch, micro_batches=micro)
    start = dataclasses.replace(with_sides(truth, launch_overhead=(), compute_scale=()),
                                contention=0.0, sync_overhead=0.0, transfer_latency=1e-3,
                                compute_contention=0.0)
    fitted = fit(start, spec, seen, BATCHES, block_seen=block_seen)
    for side in ("accelerator", "host"):
        assert [x for x, _ in fitted.device(side).compute_scale] == sorted(
            BATCHES + SCALE_BATCHES)
    for b in BATCHES + SCALE_BATCHES:
        for side in ("accelerator", "host"):
            assert fitted.device(side).scale(b) == pytest.approx(truth.device(side).scale(b),
                                                                 rel=0.05)

        def switch(profile):
            return profile.accelerator.launch_seconds(b) + profile.transfer_latency
        assert switch(fitted) == pytest.approx(switch(truth), rel=0.05)
    assert fitted.contention == pytest.approx(0.3, abs=0.1 + 1e-9)  # a step of its grid
    assert fitted.sync_overhead == pytest.approx(4e-4)
    # the block step moves ~0.45 % per 0.1 of compute contention, and it also sees the split of
    # a switch between launch and transfer latency, which the earlier fit cannot tell apart
    # (only their sum): one grid step either way absorbs that split
    assert fitted.compute_contention == pytest.approx(0.6, abs=0.1 + 1e-9)
    assert fitted.model_error < 0.01
    held_out = [policies.layer_split(n, n // 3), kv_host_odd(n), alternating(n)]
    for p in held_out:
        for b in BATCHES:
            assert predicted_decode(p, spec, fitted, b) == pytest.approx(
                predicted_decode(p, spec, truth, b), rel=0.05)
