"""Op FLOPs of the cost model against XLA's own cost analysis of the jitted ops."""

import jax
import numpy as np
import pytest

from hx.executor import op_params
from hx.models.layers import Step
from hx.models.decoder import apply_op, init_params
from hx.models.tensors import OPS
from hx.models.spec import EXPERT_OPS, PRESETS
from hx.models.tensors import activation_bytes
from hx.planner.cost import op_cost

SPEC = PRESETS["smollm2-135m"].replace(n_layers=1)


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, init_params(SPEC))


@pytest.mark.parametrize("B, T, S", [(1, 1, 64), (4, 16, 128)])
@pytest.mark.parametrize("op", [op for op in OPS if op != "EMBED" and op not in EXPERT_OPS])
def test_flops_match_xla(params, op, B, T, S):
    s = SPEC
    shapes = {"x": (B, T, s.d_model), "h": (B, T, s.d_model),
              "q": (B, T, s.n_heads, s.head_dim), "o": (B, T, s.n_heads, s.head_dim),
              "k": (B, T, s.n_kv_heads, s.head_dim), "v": (B, T, s.n_kv_heads, s.head_dim),
              "a": (B, T, s.d_ff)}
    acts = {n: np.zeros(shapes[n], np.float32) for n in OPS[op].reads}
    cache = {n: np.zeros((B, S, s.n_kv_heads, s.head_dim), np.float32) for n in ("k", "v")}
    step = Step(np.zeros((B, T), np.int32), np.int32(0), np.zeros((B,), np.int32))
    f = jax.jit(lambda p, a, c, st: apply_op(s, op, p, a, st, c if OPS[op].uses_cache else None))
    xla = f.lower(op_params(params, 0, op), acts, cache, step).compile().cost_analysis()
    ours = op_cost(s, op, B, T, S)
    assert ours.flops == pytest.approx(xla["flops"], rel=0.05)
    assert ours.weight_bytes <= xla["bytes accessed"]


def test_weight_and_activation_bytes():
    assert op_cost(SPEC, "MLP1", 1, 1, 1).weight_bytes == 4 * (2 * 576 * 1536 + 576)
    assert op_cost(SPEC, "HEAD", 3, 1, 1).rows == 3
    assert activation_bytes(SPEC, "q", 2, 5) == 2 * 5 * 9 * 64 * 4
    assert activation_bytes(SPEC, "logits", 2, 5) == 2 * 49152 * 4


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_routed_experts_are_the_expected_distinct_experts_of_uniform_routing(rows):
    """``routed_experts`` against a sampled uniform router (each row k distinct experts of X,
    8 000 draws, seeded): the mean count of distinct experts run within 1 % and the rows
    per run expert their pairs over that count; a part of the layer's experts runs those of
    its experts some row picks (each k / X), and the activity given instead where given."""
    from hx.models.spec import MoeShape
    from hx.planner.cost import routed_experts

    X, k, draws = 64, 8, []
    rng = np.random.default_rng(rows)
    for _ in range(8):  # 1 000 draws at a time
        picks = np.argpartition(rng.random((1000, rows, X)), k, axis=-1)[..., :k]
        hit = np.zeros((1000, X), bool)
        hit[np.arange(1000)[:, None], picks.reshape(1000, -1)] = True
        draws += list(hit.sum(-1))
    run, each = routed_experts(MoeShape(X, k, 32), rows)
    assert abs(run - np.mean(draws)) <= 0.01 * np.mean(draws)
    assert each * run == pytest.approx(rows * k)
    part, each_part = routed_experts(MoeShape(4, k, 32, of=X), rows)
    assert part == pytest.approx(4 * np.mean(draws) / X, rel=0.01)  # 4 of the X, alike
    assert part * each_part == pytest.approx(rows * 4 * k / X)
    hot, _ = routed_experts(MoeShape(4, k, 32, of=X, picks=(1.0, 1.0, 0.0, 0.0)), rows)
    assert hot == pytest.approx(2.0)  # two picked by every row, two by none
