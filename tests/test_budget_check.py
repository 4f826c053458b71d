"""Real runs peak at their check: a sample of the (dtype x mode x policy x budget) matrix in
which every dtype, mode, policy and budget appears (``scripts/bench_memory_matrix.py`` runs all
of it), and the run that once broke its budget."""

import dataclasses

import pytest

from hx.budget_check import MODES, check_run
from hx.models.loader import Model
from hx.planner import policies

from profiles import gpu_like

DTYPES = ("float32", "bfloat16", "float16")
BUDGETS = (0.25, 0.5, 1.2)
# policy i runs dtype i, mode i + 1 and budget i + 2 (mod 3): each value of each axis appears
SAMPLE = [(policy, DTYPES[i % 3], MODES[(i + 1) % 3], BUDGETS[(i + 2) % 3])
          for i, policy in enumerate(policies.POLICIES)]


@pytest.mark.parametrize("policy,dtype,mode,fraction", SAMPLE)
def test_a_run_peaks_at_its_check_and_never_over(tiny_model, policy, dtype, mode, fraction):
    model = dataclasses.replace(tiny_model, spec=tiny_model.spec.replace(dtype=dtype))
    run = check_run(model, mode, policy, fraction, (40, 23, 57, 9, 31), 4, gpu_like())
    assert run.outcome in ("exact", "below", "refused"), run
    if run.outcome == "refused":  # only a policy may refuse, with the minimum budget
        assert run.detail.startswith("policy:") and "minimum feasible budget" in run.detail
    if mode != "throughput" and run.outcome != "refused":
        assert run.outcome == "exact", run  # a batch's run reaches its check's peak moment


def test_the_default_policy_in_bfloat16_at_450_mib_runs_within_its_budget(smollm):
    """`hx generate -p Hi --dtype bfloat16 --accelerator-memory 450MiB` raised BudgetExceeded:
    the check sized a segment's XLA temporaries by a three-layer proxy, which on XLA:CPU holds
    float32 copies of three layers' bfloat16 weights where the run's segment holds thirty."""
    model = Model(smollm.spec.replace(dtype="bfloat16"), smollm.params, smollm.tokenizer,
                  smollm.source)
    run = check_run(model, "one prompt", "auto", 450 * 2**20 / model.spec.weight_bytes, (1,),
                    2, None)
    assert run.outcome == "exact" and run.peak <= 450 * 2**20, run
