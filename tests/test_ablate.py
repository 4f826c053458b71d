"""The ablation measures every feasible policy on the executor and records why the others do
not fit (tiny model, a GPU-like profile for the predictions)."""

from conftest import TINY
from hx.measure.ablate import ablate
from hx.measure.calibrate import predicted_decode
from hx.planner import policies
from hx.planner.policies import BASELINES
from profiles import gpu_like


def test_ablation_rows(tiny_model, monkeypatch):
    """... and one executor (with its accelerator weights) lives at a time: a GPU's memory
    pool holds one run's budget, not one per policy."""
    import weakref

    from hx.measure import ablate as module

    live, most = weakref.WeakSet(), []

    class Counted(module.Executor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            live.add(self)
            most.append(len(live))

    monkeypatch.setattr(module, "Executor", Counted)
    profile = gpu_like()
    rows = ablate(TINY, tiny_model.params, profile, (0.3, 2.0), ((1, 1),),
                  ("cpsat",) + BASELINES, runs=2, steps=2, context=16)
    assert most and max(most) == 1
    assert len(rows) == 2 * (1 + len(BASELINES))
    for row in rows:
        if row.error is not None:  # only a plan that does not fit goes unmeasured
            assert "minimum feasible budget" in row.error and not row.runs_s
            continue
        assert len(row.runs_s) == 2 and row.measured_s > 0 and row.tokens_per_s > 0
        assert row.accelerator_bytes <= row.budget_bytes
    fits = {(r.budget_fraction, r.policy): r for r in rows}
    assert fits[(0.3, "all-accelerator")].error is not None
    whole = fits[(2.0, "all-accelerator")]
    assert whole.error is None
    assert whole.predicted_s == predicted_decode(policies.all_accelerator(TINY.n_layers), TINY,
                                                 profile, 1, steps=2, context=16)


def test_a_block_of_micro_batches_is_predicted_and_measured_as_a_block(tiny_model):
    """``(2, 3)``: a block of three micro-batches of two rows (``Executor.run_block``), its
    prediction the simulator's for that block and its tokens/s six rows' per step."""
    profile = gpu_like()
    (row,) = ablate(TINY, tiny_model.params, profile, (2.0,), ((2, 3),), ("all-accelerator",),
                    runs=1, steps=2, context=16)
    plan = policies.all_accelerator(TINY.n_layers)
    assert (row.batch, row.micro_batches) == (2, 3) and row.measured_s > 0
    assert row.predicted_s == predicted_decode(plan, TINY, profile, 2, steps=2, context=16,
                                               micro_batches=3)
    assert row.predicted_s > predicted_decode(plan, TINY, profile, 2, steps=2, context=16)
    assert row.tokens_per_s == 6 / row.measured_s
    assert row.within == (abs(row.predicted_s / row.measured_s - 1) <= 0.15)
