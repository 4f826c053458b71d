"""torch's CPU int4 kernel as an XLA FFI custom call (``host_compute.int4_kernel``): its packed
weights are the format's, element for element, its products are bfloat16-class against
float64, and host ops under ``host_matmul`` torch-int4 hold their matrices in its layout, as
many bytes as the estimate counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.host_compute import int4_kernel
from hx.memory import held_weight_bytes
from hx.models.formats import FORMATS, Format, quantize, unpack
from hx.models.compressed import GroupMatrix, Int4Packed, product, unpack_rows
from hx.models.decoder import init_params
from hx.models.loader import Model, resolve_host_matmul
from hx.models.spec import TORCH_INT4, ModelSpec
from hx.plan import ExecutionPlan

from numpy_reference import logits_np

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
    bfloat16 rounding of the output; hx's decoding of torch's layout
    (``models.compressed.Int4Packed``) gives the codes and those values."""
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
    np.testing.assert_array_equal(unpack_rows(w, int4_kernel.row_block()), codes)
    held = Int4Packed(jnp.asarray(w), jnp.asarray(sz), fmt, int4_kernel.row_block())
    decoded = jax.jit(lambda h: h.decompress(jnp.float32))(held)
    np.testing.assert_allclose(np.asarray(decoded), want, rtol=1e-6, atol=1e-7)
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


def test_only_whole_row_blocks_and_torchs_groups_have_the_layout():
    """``Format.int4pack_arrays``: the kernel's arrays where it can take the matrix, the same
    bytes as the format's own for an asymmetric format; None elsewhere."""
    int4, q4_1 = FORMATS["int4"], FORMATS["q4_1"]
    assert int4.int4pack_arrays((11008, 4096)) == {
        "packed": ((11008, 2048), "uint8"), "sz": ((64, 11008, 2), "bfloat16")}
    assert q4_1.int4pack_arrays((9, 64, 576))["packed"] == ((576, 288), "uint8")  # (H, E, D)
    packed = q4_1.int4pack_arrays((1536, 576))
    assert sum(np.prod(s) * (1 if d == "uint8" else 2) for s, d in packed.values()) \
        == q4_1.nbytes((1536, 576))
    assert FORMATS["q8_0"].int4pack_arrays((1536, 576)) is None  # 8-bit codes
    assert q4_1.int4pack_arrays((1000, 576)) is None  # rows not whole blocks of 64
    assert Format("g48", 4, 48, True).int4pack_arrays((1536, 576)) is None  # torch's groups


@pytest.mark.parametrize("fmt_name", ["q4_1", "q4_0"])
def test_int4pack_of_a_held_matrix_keeps_its_layout(fmt_name):
    """``int4pack`` of a (H, E, D) matrix as the format holds it multiplies as the flat
    (H * E, D) matrix its codes encode."""
    shape = (3, 64, 256)
    held, _, exact, fmt = held_matrix(fmt_name, (192, 256), seed=3)
    held3 = GroupMatrix.from_parts(fmt, held).map(lambda a: a.reshape(3, 64, *a.shape[1:]))
    packed = int4_kernel.int4pack(held3, (192, 256))
    assert held3.shape == shape and packed.shape == (192, 256)
    x = np.random.default_rng(4).standard_normal((2, 256), np.float32)
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    y = jax.jit(lambda x, w, sz: int4_kernel.matmul(x, w, sz, fmt.group))(
        xb, jnp.asarray(packed.packed), jnp.asarray(packed.sz))
    ref = np.asarray(xb, np.float64) @ exact.T
    assert np.abs(np.asarray(y, np.float64) - ref).max() <= 1e-2 * np.abs(ref).max()


# heads of 64 and an FFN of 128: every projection has whole row blocks of 64 (K and V: one head)
WIDE = ModelSpec(name="wide", n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64,
                 d_ff=128, vocab_size=49152, context_length=128, tie_embeddings=True,
                 dtype="bfloat16")


def wide_model(tokenizer, fmt_name: str, host_matmul: str) -> Model:
    spec = WIDE.replace(weight_format=fmt_name, embedding_format="q8_0", host_matmul=host_matmul)
    return Model(spec, int4_kernel.int4pack_params(spec, init_params(spec, seed=4)), tokenizer,
                 fmt_name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", ["q4_1", "int4", "q4_0"])
def test_host_ops_multiply_in_the_kernels_layout_within_bfloat16_of_float64(
        fmt_name, tokenizer, devices):
    """Under ``host_matmul`` torch-int4 the 4-bit projection matrices are held in torch's layout
    only, exactly the bytes the estimate counts, also by a plan with MLP1 and MLP2 on the
    accelerator in prefill (which decompresses that layout) and on the host in decode; the
    logits stay within
    bfloat16's rounding (``test_dtypes``' bound) of float64 over the matrices' decoded values,
    for a prompt the kernel multiplies and one past ``KERNEL_ROWS``, whose matrices are
    decompressed from the kernel's layout for XLA's product."""
    model = wide_model(tokenizer, fmt_name, TORCH_INT4)
    rng = np.random.default_rng(5)
    short, long = ([int(t) for t in rng.integers(0, 49152, n)]
                   for n in (6, int4_kernel.KERNEL_ROWS + 8))  # the kernel; XLA past its rows
    expected = {len(t): logits_np(model.spec, model.params, t)[-1] for t in (short, long)}
    mixed = ExecutionPlan.from_placement(ExecutionPlan.all_accelerator(2).prefill,
                                         ExecutionPlan.uniform(2, ("MLP1", "MLP2")).decode)
    for plan in (ExecutionPlan.all_host(2), mixed):
        engine = Engine(model, plan, devices)
        leaves = {}  # id -> (op, path, bytes): a buffer placed for two ops (the tied embedding) once
        for phase, segs in engine.executor.segments.items():
            for seg, trees in zip(segs, engine.executor._params[phase]):
                for (_, op), tree in zip(seg.ops, trees):
                    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                        leaves[id(leaf)] = (op, "/".join(k.key for k in path), leaf.nbytes)
        assert sum(b for *_, b in leaves.values()) == sum(held_weight_bytes(plan, model.spec))
        assert any(p.endswith("/packed") for _, p, _ in leaves.values())
        assert not any("kernel/codes" in p for _, p, _ in leaves.values())  # one layout
        for tokens in (short, long):
            got = engine.last_logits([tokens])[0]
            want = expected[len(tokens)]
            assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max(), (plan.name, tokens)


def test_auto_chooses_the_kernel_for_bfloat16_4_bit_matrices(tokenizer):
    """``resolve_host_matmul``: torch-int4 for a bfloat16 model with 4-bit matrices in no GGUF
    block format (those go to ggml where it is built), xla for a float32 one (the kernel
    rounds activations to bfloat16) and for 8-bit matrices."""
    spec = WIDE.replace(weight_format="int4")
    assert resolve_host_matmul(spec).host_matmul == TORCH_INT4
    assert resolve_host_matmul(spec.replace(dtype="float32")).host_matmul == "xla"
    assert resolve_host_matmul(spec.replace(weight_format="int8")).host_matmul == "xla"
    assert resolve_host_matmul(spec, "xla").host_matmul == "xla"
    with pytest.raises(HxError, match="unknown host matmul"):
        resolve_host_matmul(spec, "cublas")


def test_decompressing_the_layout_waits_so_temporaries_do_not_grow_with_depth():
    """``Int4Packed.decompress`` with ``after``: a chain of 8 decompress-then-multiply steps
    over (1536 x 576) matrices needs no more XLA temporaries than one (each matrix, its codes,
    scales and zeros made right before its product; letting the scales or the unpacking run
    early grew them by 110 KB a matrix)."""
    n, k = 1536, 576

    def chain(x, held):
        for matrix in held:
            x = (x + product(matrix, x, jnp.bfloat16, after=x)[:, :k]).astype(jnp.bfloat16)
        return x

    def temps(depth: int) -> int:
        held = [Int4Packed(jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
                           jax.ShapeDtypeStruct((k // 32, n, 2), jnp.bfloat16),
                           FORMATS["q4_1"], int4_kernel.row_block())] * depth
        x = jax.ShapeDtypeStruct((2, k), jnp.bfloat16)
        return jax.jit(chain).lower(x, held).compile().memory_analysis().temp_size_in_bytes

    assert temps(8) <= temps(1) + 4096
