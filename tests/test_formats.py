"""Weight formats and mapped checkpoints: GGUF blocks held exactly, group-wise compression's
error bound, compressed models against a float64 reference, streamed bytes, bounded
temporaries, mapped safetensors folders (shards, index, errors) and released pages."""

import os

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest

from hx.errors import HxError
from hx.generate import Engine
from hx.models import formats
from hx.models.formats import FORMATS, dequantize, quantize
from hx.models.gguf_loader import gguf_blocks
from hx.models.decoder import init_params
from hx.models.loader import Model, load
from hx.models.mapped import is_mapped, map_file, release
from hx.models.safetensors_loader import load_safetensors_dir, write_hf_folder
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.planner.policies import stream_all
from hx.programs import programs_for
from hx.segments import split_segments
from hx.timeline import H2D, Timeline

from numpy_reference import logits_np

# head_dim 64 and FFN 128: every matrix's last axis is a multiple of 32 and of 64
WIDE = ModelSpec(name="wide", n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64,
                 d_ff=128, vocab_size=49152, context_length=128, tie_embeddings=True)
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1}


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_gguf_blocks_decode_to_the_gguf_packages_values(name):
    """Blocks taken as they are decode (numpy and JAX) to exactly gguf's dequantization."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(w, GGUF_TYPES[name])
    tensor = type("T", (), {"data": blocks, "tensor_type": GGUF_TYPES[name]})()
    held = gguf_blocks(tensor, (6, 8, 256))  # rows split like wq's (H, E, D)
    expected = gguf.quants.dequantize(blocks, GGUF_TYPES[name]).reshape(6, 8, 256)
    fmt = FORMATS[name]
    assert held.fmt == fmt and held.shape == (6, 8, 256)
    np.testing.assert_array_equal(dequantize(held.parts(), fmt, (6, 8, 256)), expected)
    got = jax.jit(lambda h: h.decompress(np.float32))(held)  # a pytree through the program
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert sum(a.nbytes for a in held.parts().values()) == fmt.nbytes((6, 8, 256)) == blocks.nbytes


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_error_is_at_most_half_a_step(name):
    """Each element decodes within half its group's step of the original, plus how far the
    group sticks out of its grid's range -- at most the float16 rounding of a min/max group's
    offset and scale (2^-11 of each, relative): int8's other candidates must cover their
    group -- and the held bytes are the format's. Normal and heavy-tailed (Student t, 2
    degrees of freedom) weights."""
    rng = np.random.default_rng(1)
    w = np.concatenate([rng.standard_normal((8, 3, 128)), rng.standard_t(2, (8, 3, 128))])
    w = w.astype(np.float32)
    fmt = FORMATS[name]
    held = quantize(w, fmt)
    assert sum(a.nbytes for a in held.values()) == fmt.nbytes(w.shape)
    groups = w.reshape(16, 3, -1, fmt.group)
    error = np.abs(dequantize(held, fmt, w.shape).reshape(groups.shape) - groups)
    step = held["scale"].astype(np.float32)[..., None]
    base = held["offset"].astype(np.float32)[..., None] if fmt.asymmetric else 0
    first = base + step * (0 - fmt.zero)  # the grid's lowest and highest values
    last = base + step * ((1 << fmt.bits) - 1 - fmt.zero)
    low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    slack = np.maximum(0, np.maximum(first - low, high - last))
    assert (slack <= 2 ** -10 * (np.abs(low) + high - low) + 1e-7).all()
    assert (error <= 0.5 * step * (1 + 1e-3) + slack + 1e-7).all()
    assert error.max() > 0  # it is a compression


def _minmax_reference(w: np.ndarray, bits: int, group: int):
    """FlexGen's min/max group-wise quantizer (Sheng et al. 2023 §5), written here on its
    own: codes (G, group) uint8 (unpacked), scale and offset (G,) float16."""
    g = w.reshape(-1, group).astype(np.float32)
    low = g.min(axis=1)
    scale = ((g.max(axis=1) - low) / np.float32((1 << bits) - 1)).astype(np.float16)
    offset = low.astype(np.float16)
    s, m = scale.astype(np.float32)[:, None], offset.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s > 0, np.rint((g - m) / s), 0)
    return np.clip(codes, 0, (1 << bits) - 1).astype(np.uint8), scale, offset


def test_int4_is_flexgens_min_max_scheme():
    """int4 stays FlexGen's scheme (group 64, asymmetric min/max): the held codes, scales and
    offsets are exactly those of an independent min/max quantizer."""
    fmt = FORMATS["int4"]
    assert (fmt.bits, fmt.group, fmt.asymmetric, fmt.fit) == (4, 64, True, "minmax")
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((40, 256)) * rng.uniform(0.01, 3, (40, 1))).astype(np.float32)
    w[0, :64] = 0.3  # a constant group: scale 0
    held = quantize(w, fmt)
    codes, scale, offset = _minmax_reference(w, 4, 64)
    np.testing.assert_array_equal(formats.unpack(held["codes"], fmt).reshape(codes.shape),
                                  codes)
    np.testing.assert_array_equal(held["scale"].reshape(-1), scale)
    np.testing.assert_array_equal(held["offset"].reshape(-1), offset)


def _group_sse(w: np.ndarray, decoded: np.ndarray, group: int) -> np.ndarray:
    d = decoded.astype(np.float64).reshape(-1, group) - w.astype(np.float64).reshape(-1, group)
    return (d * d).sum(axis=1)


def _int8_sources(rng):
    """Groups of 32 of several kinds: normal, heavy-tailed, shifted, constant, a symmetric
    8-bit grid (Q8_0-like blocks: float16 step d times integers, max |q| = 127) and 16 levels
    of a min/max grid (Q4_1-like blocks)."""
    normal = rng.standard_normal((64, 256)) * rng.uniform(1e-3, 2, (64, 1))
    heavy = rng.standard_t(2, (64, 256)) * 0.02
    shifted = rng.standard_normal((64, 256)) * 0.01 + rng.uniform(-1, 1, (64, 1))
    constant = np.repeat(rng.uniform(-1, 1, (64, 1)), 256, axis=1)
    d = rng.uniform(1e-3, 1e-2, (64 * 8, 1)).astype(np.float16).astype(np.float64)
    q = rng.integers(-127, 128, (64 * 8, 32))
    q[:, 0] = np.where(rng.random(64 * 8) < 0.5, 127, -127)  # the block's absmax is 127 d
    q8 = (d * q).reshape(64, 256)
    d4 = rng.uniform(1e-3, 1e-2, (64 * 8, 1)).astype(np.float16).astype(np.float64)
    m4 = rng.uniform(-0.1, 0, (64 * 8, 1)).astype(np.float16).astype(np.float64)
    q4 = rng.integers(0, 16, (64 * 8, 32))
    q4[:, :2] = [0, 15]
    q41 = (d4 * q4 + m4).reshape(64, 256)
    return {k: v.astype(np.float32) for k, v in dict(
        normal=normal, heavy=heavy, shifted=shifted, constant=constant, q8_0=q8,
        q4_1=q41).items()}


def test_int8_fit_never_loses_to_min_max_and_holds_q8_0_grids_exactly():
    """int8 (group 32, ``mse`` fit): every group's squared error (float64) is at most the
    min/max quantizer's at the same group (up to the float32 rounding of the fit's own error
    sums), clearly lower in total on normal weights, zero on groups that lie on a zero-centred
    8-bit grid (Q8_0 blocks, where min/max is not), and far below rounding noise on 16 levels
    of a min/max grid (Q4_1 blocks, which min/max already nearly holds: 255 = 15 x 17)."""
    fmt = FORMATS["int8"]
    assert (fmt.bits, fmt.group, fmt.asymmetric, fmt.fit) == (8, 32, True, "mse")
    assert fmt.nbytes((4096, 4096)) * 8 / 4096 ** 2 == 9.0  # bits per weight
    for kind, w in _int8_sources(np.random.default_rng(4)).items():
        fit = _group_sse(w, dequantize(quantize(w, fmt), fmt, w.shape), 32)
        codes, scale, offset = _minmax_reference(w, 8, 32)
        base = codes * scale.astype(np.float32)[:, None] + offset.astype(np.float32)[:, None]
        minmax = _group_sse(w, base, 32)
        scale_of = (w.reshape(-1, 32).max(1).astype(np.float64) - w.reshape(-1, 32).min(1))
        assert (fit <= minmax * (1 + 1e-4) + 1e-12 * scale_of ** 2).all(), kind
        if kind == "normal":
            assert fit.sum() < 0.93 * minmax.sum()
        if kind == "q8_0":
            assert fit.max() == 0 and minmax.min() > 0
        if kind == "q4_1":  # the float16 offset and scale: far below rounding to 8 bits
            noise = 32 * (scale.astype(np.float64) ** 2 / 12).sum()  # uniform rounding error
            assert fit.sum() <= minmax.sum() < 0.05 * noise


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantize_in_chunks_equals_quantize_at_once(name):
    """Chunks of rows (7 groups here, not dividing the 96 groups) give the same held arrays,
    bit for bit, as the whole matrix in one chunk; a bf16 source is widened per chunk."""
    w = np.random.default_rng(2).standard_normal((12, 512)).astype(ml_dtypes.bfloat16)
    fmt = FORMATS[name]
    whole, chunked = quantize(w, fmt), quantize(w, fmt, chunk_bytes=7 * 4 * fmt.group)
    for part in whole:
        np.testing.assert_array_equal(chunked[part], whole[part])


def test_a_matrix_whose_last_axis_is_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(HxError, match="multiple of 64"):
        FORMATS["int4"].arrays((8, 96))


@pytest.fixture(scope="module")
def wide_dense():
    params = jax.tree.map(np.asarray, init_params(WIDE, seed=4))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int4", "q4_1", "q8_0"])
def test_compressed_models_match_the_float64_reference_of_their_values(name, tokenizer,
                                                                       devices):
    """A compressed model computes on exactly its decoded values: its logits equal a float64
    numpy forward pass over the dequantized matrices, under plans that keep the matrices on
    each device and stream them."""
    spec = WIDE.replace(weight_format=name, embedding_format=name)
    params = init_params(spec, seed=4)
    tokens = [1, 510, 4402, 314, 30, 7]
    expected = logits_np(spec, params, tokens)[-1]
    model = Model(spec, params, tokenizer, name)
    for plan in (ExecutionPlan.all_accelerator(2), ExecutionPlan.all_host(2),
                 stream_all(2)):
        got = Engine(model, plan, devices).last_logits([tokens])[0]
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max(), plan.name


def test_streaming_moves_the_compressed_bytes(tokenizer, devices):
    """Stream-all copies exactly the held bytes of the staged matrices in a step: int4 moves
    about an eighth of what float32 moves."""
    moved = {}
    plan = stream_all(2)
    for name in ("dense", "int4"):
        spec = WIDE.replace(weight_format=name, embedding_format=name)
        timeline = Timeline()
        engine = Engine(Model(spec, init_params(spec, seed=4), tokenizer, name), plan, devices,
                        timeline)
        engine.last_logits([[5, 6, 7]])
        timeline.wait()
        moved[name] = sum(e.args["bytes"] for e in timeline.steps()[-1]
                          if e.resource == H2D and e.name.startswith("weights"))
        staged = {(layer, op) for phase in ("prefill",)
                  for seg in split_segments(plan, phase)
                  for (layer, op), st in zip(seg.ops, seg.staged) if st}
        assert moved[name] == sum(spec.op_weight_bytes(op) for _, op in staged)
    assert moved["int4"] / moved["dense"] < 0.16


def test_decompression_waits_for_its_input_so_temporaries_do_not_grow_with_depth(devices):
    """XLA holds one decompressed matrix at a time, not a segment's worth: a 6-layer
    accelerator segment's temporaries are about a 1-layer one's."""
    temps = []
    for layers in (1, 6):
        spec = WIDE.replace(n_layers=layers, weight_format="q4_1", embedding_format="q4_1",
                            d_ff=1024)
        (segment,) = split_segments(ExecutionPlan.all_accelerator(layers), "decode")
        temps.append(programs_for(spec, devices).temp_bytes(segment, 1, 1, 16))
    one_matrix = 1024 * 128 * 4
    assert temps[1] <= temps[0] + one_matrix


def _write_folder(tmp_path, tokenizer, shards: int):
    """A Hugging Face folder of WIDE's shapes (untied), float32, in ``shards`` files."""
    spec = WIDE.replace(tie_embeddings=False)
    params = jax.tree.map(np.asarray, init_params(spec, seed=5))
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    write_hf_folder(str(tmp_path), spec, shards, lambda layers: params)
    return spec, params


def test_sharded_folder_is_mapped_not_copied(tmp_path, tokenizer):
    spec, params = _write_folder(tmp_path, tokenizer, shards=2)
    loaded, held = load_safetensors_dir(str(tmp_path), "float32")
    assert loaded.n_layers == 2
    leaves = jax.tree.leaves(held)
    assert all(is_mapped(a) for a in leaves)  # float32 file as float32: every tensor a view
    for a, b in zip(jax.tree.leaves(params), leaves):
        np.testing.assert_array_equal(a, b)
    compressed = load(str(tmp_path), weights="int8")
    assert compressed.spec.weight_format == "int8"
    assert compressed.spec.weight_bytes < spec.weight_bytes / 3
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(HxError, match="shards named by .* are missing"):
        load_safetensors_dir(str(tmp_path))


def test_corrupt_safetensors_are_refused(tmp_path, tokenizer):
    _write_folder(tmp_path, tokenizer, shards=1)
    (path,) = tmp_path.glob("*.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(HxError, match="not a readable safetensors file"):
        load_safetensors_dir(str(tmp_path))
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(HxError, match="not a readable safetensors file"):
        load_safetensors_dir(str(tmp_path))


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_release_drops_a_mapped_tensors_pages(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(np.arange(16 << 20, dtype=np.uint32).tobytes())  # 64 MiB
    data = map_file(str(path)).view(np.uint32)
    before = _rss_file_kib()
    assert int(data.sum(dtype=np.uint64)) > 0  # touch every page
    touched = _rss_file_kib()
    release(data)
    after = _rss_file_kib()
    assert touched - before > 60 << 10 and touched - after > 60 << 10
    assert data[12345] == 12345  # still readable: the pages fault back in
    release(np.zeros(10))  # not mapped: nothing happens
    assert not formats.get_format("dense")


def test_kv_cache_formats_keep_min_max_and_group_a_head_of_64():
    """The KV cache's int8 is min/max (what ``llama.quantize_kv`` computes in JAX), not the
    weights' ``mse`` fit, in groups of the format's 32 (two per SmolLM2 head of 64); a head of
    16 is one group; int4 keeps FlexGen's group 64."""
    kv8 = formats.kv_cache_format("int8", 64)
    assert (kv8.bits, kv8.group, kv8.asymmetric, kv8.fit) == (8, 32, True, "minmax")
    assert formats.kv_cache_format("int8", 16).group == 16
    assert formats.kv_cache_format("int4", 128).group == 64
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float32)
    codes, scale, offset = _minmax_reference(x, 8, 32)
    held = quantize(x, kv8)
    np.testing.assert_array_equal(held["codes"].reshape(codes.shape), codes)
    np.testing.assert_array_equal(held["scale"].reshape(-1), scale)
    np.testing.assert_array_equal(held["offset"].reshape(-1), offset)
