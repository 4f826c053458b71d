"""Sampling strategies against their definitions."""

import jax
import numpy as np
import pytest

from hx.errors import HxError
from hx.sampling import SamplingParams, sample

V = 50


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).standard_normal((4, V)).astype(np.float32) * 2


def draws(logits, params, n=400):
    return np.stack([np.asarray(sample(logits, params, i)) for i in range(n)])  # (n, B)


def test_greedy_is_argmax(logits):
    np.testing.assert_array_equal(sample(logits, SamplingParams(), 0), logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy(logits):
    for p in (SamplingParams(temperature=1.0, top_k=1, seed=3),
              SamplingParams(temperature=1.0, top_p=1e-6, seed=3)):
        assert (draws(logits, p, 20) == logits.argmax(-1)).all()


def test_top_k_support(logits):
    got = draws(logits, SamplingParams(temperature=2.0, top_k=5, seed=1), 200)
    top5 = np.argsort(-logits, axis=-1)[:, :5]
    for row in range(logits.shape[0]):
        assert set(got[:, row]) <= set(top5[row])
        assert len(set(got[:, row])) > 1


def test_top_p_support(logits):
    p = 0.6
    got = draws(logits, SamplingParams(temperature=1.0, top_p=p, seed=2), 200)
    for row in range(logits.shape[0]):
        probs = np.asarray(jax.nn.softmax(logits[row].astype(np.float64)))
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        nucleus = set(order[before < p])
        assert set(got[:, row]) <= nucleus


def test_frequencies_follow_softmax(logits):
    """At temperature T, token frequencies approach softmax(logits / T) (loose 5-sigma bound)."""
    T, n = 1.5, 2000
    got = draws(logits, SamplingParams(temperature=T, seed=7), n)
    for row in range(2):
        probs = np.asarray(jax.nn.softmax(logits[row].astype(np.float64) / T))
        freq = np.bincount(got[:, row], minlength=V) / n
        sigma = np.sqrt(probs * (1 - probs) / n)
        assert (np.abs(freq - probs) <= 5 * sigma + 1e-3).all()


def test_seeded_and_batch_invariant(logits):
    params = SamplingParams(temperature=1.0, seed=11)
    a = draws(logits, params, 30)
    np.testing.assert_array_equal(a, draws(logits, params, 30))
    alone = np.stack([np.asarray(sample(logits[2:3], params, i)) for i in range(30)])[:, 0]
    np.testing.assert_array_equal(a[:, 2], alone)
    assert not np.array_equal(a, draws(logits, SamplingParams(temperature=1.0, seed=12), 30))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0),
                                 dict(top_p=1.5), dict(max_new_tokens=0)])
def test_rejects_bad_parameters(bad):
    with pytest.raises(HxError):
        SamplingParams(**bad)
