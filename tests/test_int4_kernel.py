"""torch's CPU int4 kernel as an XLA FFI custom call (``host_compute.int4_kernel``): its packed
weights are the format's, element for element, and its products are bfloat16-class against
float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hx.host_compute import int4_kernel
from hx.models.formats import FORMATS, quantize, unpack

pytestmark = pytest.mark.skipif(int4_kernel.unavailable() is not None,
                                reason=str(int4_kernel.unavailable()))


def held_matrix(fmt_name: str, shape, seed: int = 0):
    """A random (N, K) matrix quantized into ``fmt_name``: (held arrays, codes (N, K), the
    exact float64 matrix they encode)."""
    fmt = FORMATS[fmt_name]
    w = np.random.default_rng(seed).standard_normal(shape, np.float32) * 0.05
    held = quantize(w, fmt)
    codes = unpack(held["codes"], fmt).reshape(shape)
    scale = held["scale"].astype(np.float64)[..., None]
    groups = codes.reshape(shape[0], -1, fmt.group).astype(np.float64) - fmt.zero
    exact = groups * scale + (held["offset"].astype(np.float64)[..., None]
                              if fmt.asymmetric else 0)
    return held, codes, exact.reshape(shape), fmt


@pytest.mark.parametrize("fmt_name", ["q4_1", "int4", "q4_0"])
def test_an_identity_product_reads_back_every_weight(fmt_name):
    """x = I (K x K) gives W^T: every weight at its place, equal to the format's value with its
    scale and zero rounded to bfloat16 (torch's formula (code - 8) * scale + zero), within one
    bfloat16 rounding of the output."""
    N, K = 128, 256
    held, codes, exact, fmt = held_matrix(fmt_name, (N, K))
    w, sz = int4_kernel.pack(codes, held["scale"], held.get("offset"), fmt.zero)
    y = jax.jit(lambda x, w, sz: int4_kernel.matmul(x, w, sz, fmt.group))(
        jnp.eye(K, dtype=jnp.bfloat16), jnp.asarray(w), jnp.asarray(sz))
    s, z = (sz[..., i].astype(np.float64).T for i in (0, 1))  # (N, K / g)
    q = codes.reshape(N, -1, fmt.group).astype(np.float64)
    want = ((q - 8) * s[..., None] + z[..., None]).reshape(N, K)
    got = np.asarray(y, np.float64).T
    assert np.all(np.abs(got - want) <= np.abs(want) * 2 ** -8 + 1e-12)
    assert np.abs(want - exact).max() <= np.abs(exact).max() * 2 ** -7  # bf16 scale and zero


def test_products_are_bfloat16_class_against_float64():
    """A (3, 576) x (1536, 576)^T product, SmolLM2's MLP1 shape in Q4_1, chained with XLA ops
    in one jitted program: within 1e-2 of float64 over the exact weights and the bfloat16
    activations (the kernel's own inputs), relative to the largest output."""
    held, codes, exact, fmt = held_matrix("q4_1", (1536, 576), seed=1)
    w, sz = int4_kernel.pack(codes, held["scale"], held["offset"], fmt.zero)
    x = np.random.default_rng(2).standard_normal((3, 576), np.float32)

    @jax.jit
    def step(x, w, sz):
        h = (x * 2.0).astype(jnp.bfloat16)
        return int4_kernel.matmul(h, w, sz, fmt.group).astype(jnp.float32) + 1.0

    y = np.asarray(step(x, jnp.asarray(w), jnp.asarray(sz)), np.float64) - 1.0
    xb = np.asarray(jnp.asarray(x * 2.0).astype(jnp.bfloat16), np.float64)
    ref = xb @ exact.T
    assert np.abs(y - ref).max() <= 1e-2 * np.abs(ref).max()


def test_only_whole_row_blocks_and_torchs_groups_are_eligible():
    assert int4_kernel.eligible(1536, 576, 32, 4)
    assert int4_kernel.eligible(11008, 4096, 64, 4)
    assert not int4_kernel.eligible(1536, 576, 32, 8)  # 8-bit codes
    assert not int4_kernel.eligible(1000, 576, 32, 4)  # rows not a multiple of 64
    assert not int4_kernel.eligible(1536, 576, 48, 4)  # a group torch does not take
