"""ggml's products over a GGUF's own blocks, called from inside XLA programs, and the model
path that holds a GGUF's matrices in those blocks (``host_matmul`` ggml).

Against float64 products of the decoded weights (``gguf.quants.dequantize``): ggml rounds the
activations to 8 bits per block of 32 (its dot type), as llama.cpp does, so the error is that
rounding's (about 2^-8 of the largest activation of a block, relative), whatever the rows.
"""

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import hx
from hx.devices import discover
from hx.errors import HxError
from hx.generate import Engine
from hx.host_compute import ggml_kernel
from hx.models.compressed import GGUFBlocks, GroupMatrix, unrepack_rows
from hx.models.formats import CENTRED_BLOCKS, GGUF_BLOCKS, get_format, quantize as hx_quantize
from hx.models.gguf_loader import group_of_blocks
from hx.planner import policies

pytestmark = pytest.mark.skipif(ggml_kernel.unavailable() is not None,
                                reason=str(ggml_kernel.unavailable()))


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_products_match_float64_over_the_decoded_blocks(kind, rows):
    rng = np.random.default_rng(int(kind) * 100 + rows)
    N, K = 96, 256
    blocks = quantize(rng.standard_normal((N, K)).astype(np.float32), kind)
    assert blocks.shape == (N, K // 32 * {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}[kind])
    x = rng.standard_normal((rows, K)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(blocks, kind).astype(np.float64).T
    for threads in (1, 2):
        got = np.asarray(jax.jit(ggml_kernel.matmul, static_argnums=(2, 3))(
            x, blocks, int(kind), threads))
        assert got.shape == (rows, N) and got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.skipif("q4_0" not in ggml_kernel.repacked_formats(),
                    reason="ggml repacks no format hx reads on this CPU")
def test_repacked_q4_0_is_the_same_matrix_and_the_same_products():
    """q4_0 in ggml's repacked CPU layout (llama.cpp's default on AVX2: 8 rows interleaved):
    the same bytes moved (``unrepack_rows`` gives the file's back), the same products as the
    file's blocks to float32 rounding, the same matrix decompressed by XLA; a row gather is
    refused."""
    rng = np.random.default_rng(7)
    blocks = quantize(rng.standard_normal((64, 256)).astype(np.float32), Q.Q4_0)
    packed = ggml_kernel.repack(blocks, "q4_0")
    assert packed.shape == blocks.shape and (packed != blocks).mean() > 0.9
    np.testing.assert_array_equal(np.asarray(unrepack_rows(packed, get_format("q4_0"))), blocks)
    assert ggml_kernel.repack(blocks[:60], "q4_0") is None  # ggml interleaves 8 rows
    for rows in (1, 5, 64):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        file = jax.jit(lambda x, w: ggml_kernel.matmul(x, w, int(Q.Q4_0)))(x, blocks)
        ours = jax.jit(lambda x, w: ggml_kernel.matmul(x, w, int(Q.Q4_0), repacked=True))(
            x, packed)
        np.testing.assert_allclose(ours, file, atol=1e-5 * np.abs(file).max(), rtol=0)
    held = GGUFBlocks(packed, get_format("q4_0"), True)
    np.testing.assert_array_equal(np.asarray(held.decompress(np.float32)),
                                  dequantize(blocks, Q.Q4_0))
    with pytest.raises(ValueError, match="interleaved"):
        held.map(lambda a: a[:8])


def q8_0_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (rows, K) float32 as ggml's ``quantize_row_q8_0`` rounds it, per block of 32: its
    bytes q (rows, K / 32, 32) and scales d = max |x| / 127 in float16 (rows, K / 32, 1), x ~
    d q (q = x 127 / max |x| rounded to nearest even, in float32)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    scale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(blocks * scale), (amax / np.float32(127)).astype(np.float16)


@pytest.mark.skipif("q4_0" not in ggml_kernel.repacked_formats(),
                    reason="ggml repacks no format hx reads on this CPU")
@pytest.mark.parametrize("K,rows", [(256, 1), (576, 1), (576, 7), (256, 70), (256, 5)])
def test_repacked_q4_0_products_are_the_exact_integer_products(K, rows):
    """A repacked Q4_0 product runs hx's AVX-512 kernels where the CPU has them
    (``avx512_products.h``; ggml's elsewhere): x rounded to Q8_0 as ggml rounds it, each block's
    integer dot sum(q_x (q_w - 8)) exact, scaled by the two float16 scales -- in float64
    here, in float32 there, so the two agree to float32 rounding, at one row (the GEMV) and
    at 5, 7 and 70 (the GEMM's tiles of 4 rows and 2 groups, the last 1-3 rows in one tile),
    on one thread and two (96 outputs: 6 groups of 8 each)."""
    rng = np.random.default_rng(K + rows)
    N = 96
    blocks = quantize(rng.standard_normal((N, K)).astype(np.float32), Q.Q4_0)
    packed = ggml_kernel.repack(blocks, "q4_0")
    x = rng.standard_normal((rows, K)).astype(np.float32)
    qx, dx = q8_0_rows(x)
    raw = blocks.reshape(N, K // 32, 18)
    dw = raw[..., :2].copy().view(np.float16).astype(np.float64)  # (N, K / 32, 1)
    nibbles = raw[..., 2:].astype(np.int64)
    qw = np.concatenate([nibbles & 15, nibbles >> 4], axis=2) - 8  # (N, K / 32, 32)
    sums = np.einsum("nbi,rbi->rnb", qw, qx.astype(np.int64))  # exact, (rows, N, K / 32)
    want = (sums * dw[None, :, :, 0] * dx[:, None, :, 0].astype(np.float64)).sum(axis=2)
    for threads in (1, 2):
        got = np.asarray(jax.jit(lambda x, w: ggml_kernel.matmul(
            x, w, int(Q.Q4_0), threads, repacked=True))(x, packed))
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("K,rows", [(256, 1), (608, 1), (256, 7), (608, 70)])
def test_q8_0_products_are_the_exact_integer_products(K, rows):
    """A Q8_0 product (the file's layout: SmolLM2's LM head, a Q8_0 file's matrices) runs hx's
    AVX-512 kernels where the CPU has them, the GEMV at one row, the GEMM's tiles of up to 4
    rows of x and 4 of w past it: x rounded to Q8_0 as ggml rounds it, each block's integer
    dot sum(q_x q_w) exact, scaled by the two float16 scales -- agreeing with float64 to
    float32 rounding, on one thread and two, over an odd count of blocks (608 = 19 x 32) too,
    and 42 rows of w (tiles of 4 of them and single rows past those, on each thread)."""
    rng = np.random.default_rng(K + rows)
    N = 42
    blocks = quantize(rng.standard_normal((N, K)).astype(np.float32), Q.Q8_0)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    qx, dx = q8_0_rows(x)
    raw = blocks.reshape(N, K // 32, 34)
    dw = raw[..., :2].copy().view(np.float16).astype(np.float64)
    qw = raw[..., 2:].view(np.int8).astype(np.int64)
    sums = np.einsum("nbi,rbi->rnb", qw, qx.astype(np.int64))
    want = (sums * dw[None, :, :, 0] * dx[:, None, :, 0].astype(np.float64)).sum(axis=2)
    for threads in (1, 2):
        got = np.asarray(jax.jit(lambda x, w: ggml_kernel.matmul(x, w, int(Q.Q8_0), threads))(
            x, blocks))
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_a_row_of_the_wrong_size_is_refused():
    blocks = quantize(np.ones((4, 64), np.float32), Q.Q8_0)
    with pytest.raises(Exception, match="ggml_row_size"):
        jax.block_until_ready(ggml_kernel.matmul(np.ones((1, 32), np.float32), blocks,
                                                 int(Q.Q8_0), 1))


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
def test_blocks_are_the_group_matrix_and_gguf_reads_them(name):
    """A ``GroupMatrix`` in GGUF's blocks (``GGUFBlocks.from_group``) decompresses to the same
    matrix in JAX, and ``gguf``'s own decoder reads the blocks as that matrix: the layout is
    the file's -- a centred q4_1's as q4_0 blocks (its scales and codes) plus each group's
    centre m + 8 d, to float32 rounding."""
    fmt = get_format(name)
    w = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    held = GroupMatrix.from_parts(fmt, hx_quantize(w, fmt))
    blocks = GGUFBlocks.from_group(held, (64, 128))
    arrays = fmt.blocks_arrays((64, 128))
    assert {part: a.shape for part, a in blocks.parts().items()} == {
        part: shape for part, (shape, _) in arrays.items()}
    assert blocks.shape == (64, 128)
    want = np.asarray(held.decompress(np.float32))
    np.testing.assert_array_equal(np.asarray(blocks.decompress(np.float32)), want)
    rows = np.array([5, 0, 63, 5])  # an embedding lookup's gather: a centred row keeps its centres
    np.testing.assert_array_equal(
        np.asarray(blocks.map(lambda a: a[rows]).decompress(np.float32)), want[rows])
    decoded = dequantize(blocks.blocks, Q(GGUF_BLOCKS[blocks.blocks_format.name]))
    if name in CENTRED_BLOCKS:
        assert blocks.centres.dtype == np.float32
        decoded = decoded + np.repeat(blocks.centres.T, fmt.group, axis=1)
        np.testing.assert_allclose(decoded, want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:
        np.testing.assert_array_equal(decoded, want)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_centred_q4_1_multiplies_as_the_files_q4_1(rows):
    """A file's q4_1 held centred (q4_0's kernels plus the centres' part; repacked where
    ggml has q4_0's layout) gives ggml's own q4_1 products to its activations' rounding
    (llama.cpp's q8_1 sums held in float16, hx's in float32) and float64's over the decoded
    weights within the rounding of 8-bit activations; repacked and not, the same to float32
    rounding."""
    rng = np.random.default_rng(rows)
    N, K = 96, 256
    file = quantize(rng.standard_normal((N, K)).astype(np.float32) + 0.3, Q.Q4_1)
    held = GGUFBlocks.from_group(group_of_blocks(file, "Q4_1", (N, K)), (N, K))
    x = rng.standard_normal((rows, K)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(file, Q.Q4_1).astype(np.float64).T
    ggml_q4_1 = np.asarray(jax.jit(lambda x, w: ggml_kernel.matmul(x, w, int(Q.Q4_1)))(x, file))
    got = np.asarray(jax.jit(ggml_kernel.product)(x, held))
    assert got.shape == (rows, N) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    assert np.abs(got - ggml_q4_1).max() <= 1e-2 * np.abs(want).max()
    if ggml_kernel.repacks("q4_1", N):
        packed = ggml_kernel.repacked(held)
        np.testing.assert_allclose(np.asarray(jax.jit(ggml_kernel.product)(x, packed)), got,
                                   atol=1e-5 * np.abs(got).max(), rtol=0)
        np.testing.assert_array_equal(np.asarray(packed.decompress(np.float32)),
                                      np.asarray(held.decompress(np.float32)))


def test_a_gguf_model_runs_its_host_products_in_ggml():
    """SmolLM2's Q4_1 file as ``hx.load`` gives it (``auto``: ggml, ggml being built, and a
    float16 KV cache, compared here with a float32 one): its projection matrices and its Q8_0
    table held in the file's blocks; all-accelerator (the blocks decompressed by XLA) gives
    the logits of the ``xla`` layout to float32 rounding, all-host (ggml's products,
    activations rounded to 8 bits a block as llama.cpp's) within 10 % of their scale, the
    same next token. A format without GGUF blocks is refused."""
    ref, got = hx.load(dtype="float32", host_matmul="xla"), hx.load(dtype="float32", kv="dense")
    assert got.spec.host_matmul == "ggml" and ref.spec.kv_format == "dense"
    # auto holds the KV cache as llama.cpp does where ggml multiplies: float16
    assert hx.load(dtype="float32").spec.kv_format == "float16"
    assert isinstance(got.params["layer_0"]["MLP2"]["w_down"]["kernel"], GGUFBlocks)
    assert isinstance(got.params["HEAD"]["embedding"], GGUFBlocks)
    ids = [ref.tokenizer.encode("The capital of France is")]
    n = ref.spec.n_layers
    base = Engine(ref, policies.all_host(n), discover()).last_logits(ids)
    on_acc = Engine(got, policies.all_accelerator(n), discover()).last_logits(ids)
    on_host = Engine(got, policies.all_host(n), discover()).last_logits(ids)
    scale = np.abs(base).max()
    assert np.abs(on_acc - base).max() <= 1e-5 * scale
    # ggml's, not XLA's: 5.3 % and 6.8 % of the scale with q4_1 held centred, the two runs
    # differing in the order of a block's float32 sum alone (perplexity over 2,977 tokens
    # +0.17 % against float32, top-1 96.74 %: scripts/accuracy.py, docs/measurements/log.md)
    assert 1e-5 * scale < np.abs(on_host - base).max() <= 1e-1 * scale
    assert on_host.argmax() == base.argmax()
    with pytest.raises(HxError, match="GGUF block formats"):
        hx.load(dtype="float32", weights="int8", host_matmul="ggml")
