"""CP-SAT planner and baseline policies (pure Python: shapes, a fixed profile, no model)."""

import functools

import pytest

from hx.devices import ACCELERATOR, discover
from hx.errors import HxError
from hx.memory import check_fits
from hx.models.spec import PRESETS, ModelSpec
from hx.planner import policies
from hx.planner.cpsat import plan_cpsat, solve
from hx.planner.simulator import predict
from hx.workload import Workload

from profiles import LARGE_HOST, gpu_like

FRACTIONS = (0.01, 0.03, 0.06, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.2)  # barely feasible .. fits


def workload(spec, batch=1):
    return Workload.for_prompts(batch, 128, 128, spec)


@pytest.mark.slow
@pytest.mark.parametrize("model,fractions", [("smollm2-135m", FRACTIONS[::3]),
                                             ("llama2-70b", FRACTIONS[1::4])])
def test_cpsat_proves_optimality_at_every_budget(model, fractions):
    """Four and three budgets, between them barely feasible to fitting (CI time)."""
    spec, profile = PRESETS[model], gpu_like()
    w = workload(spec)
    previous = None
    for fraction in fractions:
        devices = discover(accelerator_memory=int(spec.weight_bytes * fraction),
                           host_memory=LARGE_HOST)
        result = plan_cpsat(spec, profile, devices, w, time_limit_s=5.0)
        assert result.status == "OPTIMAL" and result.gap == pytest.approx(0.0, abs=1e-9)
        assert result.chosen_s == pytest.approx(result.objective_s)  # model_error 0
        result.plan.validate(spec)
        check_fits(result.plan, spec, devices, w)
        if previous is not None:  # more memory never makes the optimum slower
            assert result.objective_s <= previous + 1e-9
        previous = result.objective_s


def test_cpsat_is_deterministic():
    spec = PRESETS["smollm2-135m"]
    devices = discover(accelerator_memory=int(spec.weight_bytes * 0.3))
    a = plan_cpsat(spec, gpu_like(), devices, workload(spec), seed=3)
    b = plan_cpsat(spec, gpu_like(), devices, workload(spec), seed=3)
    assert a.plan == b.plan and a.objective_s == b.objective_s


def test_a_warm_start_changes_where_the_search_starts_not_its_optimum():
    """A hint from a larger budget (a solution that does not fit here): the same proven
    optimum as the cold solve, and the plan fits."""
    spec, profile = PRESETS["llama2-7b"], gpu_like()
    w = workload(spec)

    def at(fraction, hint=None):
        devices = discover(accelerator_memory=int(spec.weight_bytes * fraction),
                           host_memory=LARGE_HOST)
        return devices, solve(spec, profile, devices, w, 1.0, tolerance=0, hint=hint)

    _, roomy = at(0.5)
    devices, cold = at(0.1)
    assert roomy.counts != cold.counts  # the hint is a plan that does not fit at 0.1
    _, warm = at(0.1, roomy.hint)
    assert warm.status == "OPTIMAL"
    assert warm.objective_s == pytest.approx(cold.objective_s, rel=1e-9)
    check_fits(warm.plan, spec, devices, w)


def switches(plan) -> int:
    devices = [device for _, _, device in plan.decode.sequence()]
    return sum(a != b for a, b in zip(devices, devices[1:]))


TOLERANCE = 0.05


@pytest.mark.parametrize("batch,whole_run", [(1, True), (16, False)])
def test_tolerance_trades_predicted_time_for_fewer_device_switches(batch, whole_run):
    """The second solve never adds switches, and stays within the tolerance of the optimum,
    with either objective (each at one batch: CI time)."""
    spec, profile = PRESETS["smollm2-135m"], gpu_like()
    w = workload(spec, batch)
    for fraction in (0.2, 0.4, 0.7):
        devices = discover(accelerator_memory=int(spec.weight_bytes * fraction),
                           host_memory=LARGE_HOST)
        exact = solve(spec, profile, devices, w, whole_run=whole_run)  # gpu_like: error 0
        simple = solve(spec, profile, devices, w, tolerance=TOLERANCE, whole_run=whole_run)
        assert exact.chosen_s == pytest.approx(exact.objective_s)
        assert simple.objective_s == pytest.approx(exact.objective_s)
        assert switches(simple.plan) <= switches(exact.plan)
        assert simple.chosen_s <= exact.objective_s * (1 + TOLERANCE) + 1e-7


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.6])
@pytest.mark.parametrize("batch", [1, 16])
def test_cpsat_beats_every_baseline_in_prediction(fraction, batch):
    """On a GPU-like profile the CP-SAT plan's simulated step is no slower than any feasible
    baseline's, up to 5 % (CP-SAT sums per-layer pattern costs, the simulator replays the whole
    plan)."""
    spec, profile = PRESETS["smollm2-135m"], gpu_like()
    w = workload(spec, batch)
    devices = discover(accelerator_memory=int(spec.weight_bytes * fraction))

    def step(plan):
        return predict(plan, spec, profile, "decode", batch, 1, w.cache_slots,
                       w.decode_context).seconds

    best = step(policies.build("cpsat", spec, devices, w, profile=profile))
    for name in ("all-accelerator", "stream-all", "layer-split", "min-max", "flexgen-lp",
                 "all-host"):
        try:
            plan = policies.build(name, spec, devices, w, profile=profile)
        except HxError as e:
            assert "minimum feasible budget" in str(e)
            continue
        assert best <= step(plan) * 1.05, name


@pytest.mark.parametrize("batch", [1, 16])
def test_cpsat_runs_as_fast_as_all_accelerator_where_the_model_fits(batch):
    """With room for EMBED's table, the plan gathers on the accelerator too (the pattern
    model prices EMBED after a host layer; ``cpsat.embed_on_accelerator``), and no plan is
    predicted faster than having everything there."""
    from hx.planner.simulator import predict_run

    spec, profile = PRESETS["smollm2-135m"], gpu_like()
    w = workload(spec, batch)
    devices = discover(accelerator_memory=int(spec.weight_bytes * 2))
    plan = plan_cpsat(spec, profile, devices, w).plan
    every = policies.build("all-accelerator", spec, devices, w)
    assert plan.decode.embed == ACCELERATOR
    assert predict_run(plan, spec, profile, w).total_s <= \
        predict_run(every, spec, profile, w).total_s * (1 + 1e-9)


def test_no_policy_returns_a_plan_that_does_not_fit():
    """At SmolLM2's shapes, down to a zero budget (tests/test_budgets.py does 7B and 70B)."""
    spec, profile = PRESETS["smollm2-135m"], gpu_like()
    for batch, fractions in ((1, (0.0, 1.3)), (16, (0.02, 0.8))):
        w = workload(spec, batch)
        for fraction in fractions:
            devices = discover(accelerator_memory=int(spec.weight_bytes * fraction),
                           host_memory=LARGE_HOST)
            for name in policies.POLICIES:
                try:
                    plan = policies.build(name, spec, devices, w, profile=profile)
                except HxError as e:
                    assert "minimum feasible budget" in str(e), (name, str(e))
                    continue
                plan.validate(spec)
                check_fits(plan, spec, devices, w)


def test_minimum_feasible_budget_is_stated_and_is_feasible():
    """With a host budget too small for all-host, CP-SAT reports the smallest accelerator
    budget that admits a plan, and that budget does admit one."""
    spec, profile = PRESETS["smollm2-135m"], gpu_like()
    w = workload(spec)
    host = int(spec.weight_bytes * 0.5)
    with pytest.raises(HxError, match="minimum feasible budget is") as info:
        plan_cpsat(spec, profile, discover(accelerator_memory=10_000_000, host_memory=host), w)
    minimum = int(str(info.value).split("minimum feasible budget is ")[1].split()[0])
    assert minimum > 10_000_000
    result = plan_cpsat(spec, profile, discover(accelerator_memory=minimum, host_memory=host), w)
    check_fits(result.plan, spec, discover(accelerator_memory=minimum, host_memory=host), w)


def test_reserved_activations_the_plan_leaves_unused_are_reclaimed():
    """The activation reserve is sized before the plan is known (every activation on the
    accelerator): at SmolLM2's shapes, 4 x 16 rows and 15 % of its weights' bytes, the
    first plan uses a fraction of it. Solving again with the unused room gives a plan that
    still fits and a predicted run shorter than the first plan's, never longer."""
    from hx.planner.cpsat import _fitted, plan_with_reserve
    from hx.planner.simulator import predict_run

    spec, profile = PRESETS["smollm2-135m"], gpu_like()
    w = Workload(16, 256, 320, 4, new_tokens=32)
    devices = discover(accelerator_memory=int(spec.weight_bytes * 0.15))
    first = _fitted(spec, profile, devices, devices, w, 32, 2.0, 0, None, False, 32)
    result = plan_with_reserve(spec, profile, devices, w, 32, 2.0, 0, None)
    check_fits(result.plan, spec, devices, w)
    first_s, reclaimed_s = (predict_run(r.plan, spec, profile, w).total_s
                            for r in (first, result))
    assert reclaimed_s < 0.9 * first_s


def test_pattern_price_is_a_layer_of_a_deep_stack():
    """A pattern's marginal decode seconds equal a layer's share of a deep stack of it: the
    pattern two-minus-one layers mispriced by 26 % (``marginal_seconds``), and another."""
    from hx.planner.patterns import Pattern, layer_plan, marginal_seconds
    from hx.planner.hardware import hardware_profile
    from hx.plan import RESIDENT

    spec = PRESETS["opt-30b"].replace(dtype="float16")
    profile = hardware_profile("a10g")
    w = Workload(16, 512, 576, 4, new_tokens=32)
    args = (w.batch, 1, w.cache_slots, w.decode_context, w.micro_batches)

    def step(pattern, n):
        shapes = spec.replace(n_layers=n)
        return predict(layer_plan(shapes, [pattern] * n, RESIDENT, "p"), shapes, profile,
                       "decode", *args).seconds

    for pattern in (Pattern("accelerator", ("streamed",) * 5 + ("host",)),
                    Pattern("host", ("streamed",) * 6)):
        deep = (step(pattern, 8) - step(pattern, 4)) / 4
        assert marginal_seconds(spec, profile, pattern, "decode", *args) == \
            pytest.approx(deep, rel=0.01)


def test_pattern_prices_do_not_depend_on_what_was_priced_before():
    """Pricing keeps op seconds per step shape (``simulator.step_memo``), activation and
    weight sizes, segments and pattern stacks: a pattern priced after others at other
    batches, contexts and phases costs what it costs priced first (every cache cleared)."""
    from hx import schedule, segments
    from hx.planner import patterns, simulator

    profile = gpu_like()
    spec = PRESETS["smollm2-135m"]
    kept = (simulator.step_memo, schedule.activation_sizes, schedule.weight_sizes,
            schedule.compile_schedule, segments.segments_of, patterns.stack_plan,
            patterns.stack_shapes)
    pattern = patterns.Pattern("host", ("resident", "streamed", "streamed", "host",
                                        "streamed", "resident"))
    prices = [functools.partial(patterns.price_pattern, spec, profile, pattern, w, context)
              for w, context in ((Workload(4, 64, 256), 100), (Workload(8, 64, 256), 200),
                                 (Workload(4, 64, 512), 300), (Workload(4, 64, 512), 100))]
    prices += [functools.partial(patterns.marginal_seconds, spec, profile, pattern, "prefill",
                                 4, tokens, 256, context, 1)
               for tokens, context in ((1, 100), (32, 100), (32, 64))]
    warm = [price() for price in prices]
    for price, seen in zip(prices, warm):
        for cache in kept:
            cache.cache_clear()
        assert price() == seen


def test_choose_block_serves_many_rows_per_streamed_layer():
    """On a GPU-like profile with weights streamed, the chosen block fits, its rate is the
    formula's for the plan at that block and its join group, joins are grouped (a prefill
    streams the weights whatever its rows), and it beats one row at a time (a streamed layer
    then serves one sequence) by more than 3x."""
    from hx.planner.simulator import predict_prefill
    from hx.planner.throughput import JOIN_ROWS, choose_block

    spec = PRESETS["llama2-7b"].replace(n_layers=4)
    devices = discover(accelerator_memory=int(spec.weight_bytes * 0.4),  # two staged layers
                       host_memory=LARGE_HOST)
    profile = gpu_like()

    def place(w):
        return policies.build("stream-all", spec, devices, w)

    choice = choose_block(spec, profile, 200, 300.0, 100.0, 512, 64, place)
    w = choice.workload
    assert w.batch * w.micro_batches > 1 and w.spare_rows in (w.batch, JOIN_ROWS)
    check_fits(choice.plan, spec, devices, w)
    step = predict(choice.plan, spec, profile, "decode", w.batch, 1, 512, 350,
                   w.micro_batches).seconds
    joins = choice.plan.with_prefill_chunk(choice.plan.prefill_chunk or 64)  # 64-token chunks
    k = choice.join_min
    assert 1 < k <= w.spare_rows
    prefill = predict_prefill(joins, spec, profile, k, 320, 512)
    rows = w.batch * w.micro_batches
    assert choice.tokens_per_s == pytest.approx(1 / (step / (rows - (k - 1) / 2)
                                                     + prefill / (k * 100)))
    one = choose_block(spec, profile, 1, 300.0, 100.0, 512, 64, place)
    assert one.workload.batch * one.workload.micro_batches == 1
    assert choice.tokens_per_s > 3 * one.tokens_per_s


def test_choose_block_caps_join_groups_to_fit_more_rows():
    """Where a join group of B prompts does not fit beside B rows' prefill activations, the
    block keeps many rows and prefills fewer prompts at a time: the chosen block fits, the
    same block with joins of B does not, and the rate beats the best block whose joins are
    B rows (what the search could reach before join groups were capped)."""
    from hx.planner.throughput import choose_block

    spec = PRESETS["llama2-7b"].replace(n_layers=4)
    devices = discover(accelerator_memory=int(spec.weight_bytes * 0.3))
    profile = gpu_like()

    def place(w):
        return policies.build("stream-all", spec, devices, w)

    choice = choose_block(spec, profile, 256, 300.0, 100.0, 512, 64, place)
    w = choice.workload
    assert w.spare_rows < w.batch
    check_fits(choice.plan, spec, devices, w)
    with pytest.raises(HxError, match="does not fit"):
        place(Workload(w.batch, w.prompt_tokens, w.cache_slots, w.micro_batches, w.batch))

    def uncapped(w):
        if w.spare_rows < w.batch:
            raise HxError("uncapped search")
        return place(w)

    assert choice.tokens_per_s > 2 * choose_block(spec, profile, 256, 300.0, 100.0, 512, 64,
                                                  uncapped).tokens_per_s


# Llama-2-7B's proportions at a size that compiles in seconds, its prompt of 512 tokens
# prefilled in 8 rows beside caches of 4,096 slots (34 MB a layer): the activations CP-SAT
# reserves before it knows the plan (every activation on the accelerator, twice) exceed a
# 70 MB budget at every chunk, where stream-all needs 63 MB in all at 256 tokens
# (``memory.estimate``); 200 MB of host memory hold its float16 weights and KV caches
# (183 MB), not the float32 copies of host ops beside them (215 MB: ``weight_dtype``)
RESERVE_SPEC = ModelSpec(name="reserve", n_layers=4, d_model=512, n_heads=4, n_kv_heads=2,
                         head_dim=128, d_ff=1408, vocab_size=8192, context_length=4096,
                         dtype="float16", tie_embeddings=False)
RESERVE_WORKLOAD = Workload(8, 512, 4096, 1, new_tokens=32)
RESERVE_BUDGET, RESERVE_HOST = 70_000_000, 200_000_000


def test_cpsat_solves_and_fits_at_chunks_whose_reserve_exceeds_the_budget():
    """At 256 tokens the reserve (526 MB) exceeds the 70 MB budget and host memory is short
    of a plan all on the host: no plan is found under the reserve; given a reference plan
    (``plan_cpsat``'s best so far) the model reserves that plan's exact activations at 256
    instead, and its plan fits in chunks of 256 tokens or more. ``fit_chunk`` adds 256 to the
    policies' chunks (None, 512, 128, 32): stream-all fits in chunks of 256 tokens, not in
    one of 512, where the policies take 128."""
    from hx.planner.cpsat import fit_chunk, plan_with_reserve
    from hx.planner.fitting import fit_prefill_chunk

    spec, w, profile = RESERVE_SPEC, RESERVE_WORKLOAD, gpu_like()
    devices = discover(accelerator_memory=RESERVE_BUDGET, host_memory=RESERVE_HOST)
    reference = policies.stream_all(spec.n_layers)
    assert fit_prefill_chunk(reference, spec, devices, w).prefill_chunk == 128
    assert fit_chunk(reference, spec, devices, w).prefill_chunk == 256
    with pytest.raises(HxError, match="no plan fits"):
        plan_with_reserve(spec, profile, devices, w, 256, 1.0, 0, None)
    result = plan_with_reserve(spec, profile, devices, w, 256, 1.0, 0, None,
                               reference=reference)
    assert (result.plan.prefill_chunk or w.prompt_tokens) >= 256
    check_fits(result.plan, spec, devices, w)
