"""Compressed KV caches (``ModelSpec.kv_format``): the JAX quantizer against numpy's, the bytes
table, and the executor under plans keeping KV on the accelerator, on the host (XLA and numpy
attention) and with weights streamed, against a float64 numpy model that attends over the very
values the compressed cache decodes to."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hx.devices import discover
from hx.errors import HxError
from hx.executor import Executor, tree_bytes
from hx.host_compute.attention import CompressedKV, prefix_attention
from hx.memory import estimate
from hx.models.formats import (FORMATS, dequantize, dequantize_into, kv_cache_format,
                               quantize)
from hx.models.layers import Step, attention, quantize_kv, read_kv
from hx.models.loader import Model, load_spec
from hx.models.spec import PRESETS
from hx.models.tensors import kv_arrays, kv_bytes, kv_format, kv_key, kv_shape
from hx.planner import policies
from hx.programs import Programs
from hx.segments import split_segments
from hx.workload import Workload

from conftest import force_numpy_attention
from numpy_reference import logits_np
from plans import kv_host_odd
from steps import left_padded_steps
from test_host_compute import attention_np

B, T, S, DECODE_STEPS = 2, 8, 32, 4
KV_START = (0, 2)  # left_padded_steps: row 1 is padded by 2


def kv_model(model, kv):
    """``model`` with its KV cache held in ``kv``."""
    return Model(model.spec.replace(kv_format=kv), model.params, model.tokenizer, model.source)


def plans(n_layers):
    return {p.name: p for p in (policies.all_accelerator(n_layers), policies.all_host(n_layers),
                                policies.stream_all(n_layers), kv_host_odd(n_layers))}


def decoded(cache, fmt):
    """(k, v) float32 (B, S, K, E) a layer's compressed cache decodes to, in numpy."""
    out = []
    for name in ("k", "v"):
        held = {p: np.asarray(cache[kv_key(name, p)]) for p in ("codes", "scale", "offset")
                if kv_key(name, p) in cache}
        shape = (*held["scale"].shape[:-1], held["scale"].shape[-1] * fmt.group)
        out.append(dequantize(held, fmt, shape))
    return out


@pytest.mark.parametrize("name", ["int8", "int4", "q8_0", "q4_1"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_jax_quantizer_is_numpys_bit_for_bit(name, head_dim):
    """``llama.quantize_kv`` gives ``formats.quantize``'s codes, scales and offsets, and
    ``read_kv`` and ``formats.dequantize_into`` decode them to ``formats.dequantize``'s
    values; in an asymmetric format a group of equal values decodes exactly."""
    fmt = kv_cache_format(name, head_dim)
    assert fmt.group == min(FORMATS[name].group, head_dim)
    rng = np.random.default_rng(head_dim)
    x = (rng.standard_normal((2, 5, 3, head_dim)) * rng.uniform(0.1, 30, (2, 5, 3, 1)))
    x = x.astype(np.float32)
    x[0, 0, 0] = 1.25  # a constant group: scale 0
    got = jax.jit(quantize_kv, static_argnums=1)(x, fmt)
    want = quantize(x, fmt)
    assert set(got) == set(want)
    for part in want:
        assert got[part].dtype == want[part].dtype and got[part].shape == want[part].shape
        np.testing.assert_array_equal(np.asarray(got[part]), want[part])
    values = dequantize(want, fmt, x.shape)
    assert np.all(values[0, 0, 0] == (1.25 if fmt.asymmetric else values[0, 0, 0]))
    cache = {kv_key("k", p): a for p, a in got.items()}
    np.testing.assert_array_equal(np.asarray(read_kv(cache, "k", fmt)), values)
    np.testing.assert_array_equal(np.asarray(read_kv(cache, "k", fmt, 1, 3)), values[:, 1:4])
    into = dequantize_into(want, fmt, np.empty(x.shape, np.float32))
    np.testing.assert_array_equal(into, values)
    scale = np.asarray(want["scale"], np.float32)[..., None]  # within half a step (and
    err = np.abs(values - x).reshape(*scale.shape[:-1], -1)  # float16 rounding) of x
    assert np.all(err <= 0.5 * scale + 2e-3 * np.abs(x).max())


def test_head_dim_the_format_cannot_group_is_refused():
    with pytest.raises(HxError, match="head dim 96 is not a multiple of 64.*--kv dense"):
        PRESETS["llama2-7b"].replace(head_dim=96, kv_format="int4")
    with pytest.raises(HxError, match="unknown weight format 'int3'"):
        PRESETS["llama2-7b"].replace(kv_format="int3")
    assert PRESETS["llama2-7b"].replace(head_dim=32, kv_format="int4").kv_format == "int4"


@pytest.mark.parametrize("kv, bits", [("dense", None), ("int8", 8), ("int4", 4)])
def test_kv_bytes_are_the_formats(tiny_model, kv, bits):
    """``kv_bytes`` is the format's bytes of the logical (B, S, K, E) K and V -- what the
    executor allocates and the compiled programs take -- and SmolLM2's cache shrinks to
    (bits + 32/64) / 32 of float32's."""
    spec = tiny_model.spec.replace(kv_format=kv)
    fmt = kv_format(spec)
    shape = kv_shape(spec, B, S)
    want = 2 * (math.prod(shape) * 4 if fmt is None else fmt.nbytes(shape))
    assert kv_bytes(spec, B, S) == want
    ex = Executor(spec, tiny_model.params, policies.all_accelerator(spec.n_layers), discover())
    caches = ex.new_cache(B, S)
    assert all(tree_bytes(c) == want for c in caches)
    assert ex.accountant.by_owner()["kv"] == spec.n_layers * want
    assert {k: (a.shape, a.dtype.name) for k, a in caches[0].items()} == kv_arrays(spec, B, S)
    ex.release_cache()
    seg = split_segments(policies.all_accelerator(spec.n_layers), "decode")[0]
    _, _, cache_args, _ = Programs(spec, discover()).abstract_args(seg, B, 1, S)
    assert sum(math.prod(a.shape) * a.dtype.itemsize
               for a in jax.tree.leaves(cache_args[0])) == want
    smollm = load_spec("smollm2-135m", "float32", "dense", kv)
    # a group's float16 scale and offset: 32 bits over its values
    ratio = 1 if bits is None else (bits + 32 / kv_cache_format(kv, 64).group) / 32
    assert kv_bytes(smollm, 1, 4096) == round(2 * 4096 * 3 * 64 * 4 * ratio)


def run(model, plan, devices):
    """Prefill and DECODE_STEPS decode steps of two rows (the second left-padded by 2):
    (logits per step, final caches)."""
    ex = Executor(model.spec, model.params, plan, devices)
    caches = ex.new_cache(B, S)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, model.spec.vocab_size, (B, T), dtype=np.int32)] + [
        rng.integers(0, model.spec.vocab_size, (B, 1), dtype=np.int32)
        for _ in range(DECODE_STEPS)]
    out = []
    for i, (step, t) in enumerate(zip(left_padded_steps(T, DECODE_STEPS), tokens)):
        logits, caches = ex.run("prefill" if i == 0 else "decode", t, step, caches)
        out.append(np.asarray(logits))
    peak = ex.accountant.peak
    ex.release_cache()
    return np.concatenate([tokens[0], *tokens[1:]], axis=1), np.stack(out), caches, peak


PLAN_CASES = [(name, False) for name in plans(3)] + [
    (name, True) for name in ("all-host", "stream-all", "kv-host-odd")]


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("name, numpy_attention", PLAN_CASES)
def test_compressed_cache_is_exact(tiny_model, kv, name, numpy_attention, monkeypatch):
    """Under plans keeping KV on the accelerator, on the host (attention in XLA, or in numpy
    between XLA pieces) and with weights streamed: (1) every written slot of the cache is a
    group-wise quantization of the float64 model's k and v (within half a step); (2) each
    step's logits equal the float64 model's when it attends over exactly the values the
    cache decodes to; (3) the accountant's peak equals the estimate's."""
    if numpy_attention:
        force_numpy_attention(monkeypatch)
    model = kv_model(tiny_model, kv)
    spec, fmt = model.spec, kv_format(model.spec)
    plan = plans(3)[name]
    need = estimate(plan, spec, Workload(B, T, S)).accelerator
    tokens, logits, caches, peak = run(model, plan, discover(accelerator_memory=need))
    assert peak == need
    assert {a.dtype.name for c in caches for a in c.values()} == {"uint8", "float16"}
    assert [next(iter(c["k"].devices())).platform for c in caches] == ["cpu"] * 3
    cache = [decoded(c, fmt) for c in caches]
    end = T + DECODE_STEPS
    for row, start in enumerate(KV_START):
        seq = [(k[row, start:end], v[row, start:end]) for k, v in cache]
        computed = []
        ref = logits_np(spec, model.params, tokens[row, start:], cache=seq, computed=computed)
        for layer, ((k_hat, v_hat), (k, v)) in enumerate(zip(seq, computed)):
            for name_, got, want in (("k", k_hat, k), ("v", v_hat, v)):
                scale = np.asarray(caches[layer][kv_key(name_, "scale")][row, start:end],
                                   np.float64)[..., None]
                err = np.abs(got - want).reshape(*scale.shape[:-1], -1)
                assert np.all(err <= 0.5 * scale + 2e-3 * np.abs(want).max()), (layer, name_)
        # the prefill's logits score the prompt's last slot, decode step i slot T - 1 + i
        positions = [T - 1 - start + i for i in range(DECODE_STEPS + 1)]
        np.testing.assert_allclose(logits[:, row], ref[positions], rtol=0,
                                   atol=1e-5 * np.abs(ref).max())


def test_compressed_kv_changes_logits_by_little(tiny_model, devices):
    """The compressed runs differ from the dense one, by less at 8 bits than at 4 (this
    random model's attention is not smooth: its int4 logits move by a fifth of their
    largest)."""
    plan = policies.all_accelerator(3)
    dense = run(tiny_model, plan, devices)[1]
    gaps = {kv: np.abs(run(kv_model(tiny_model, kv), plan, devices)[1] - dense).max()
            for kv in ("int8", "int4")}
    assert 0 < gaps["int8"] < gaps["int4"] / 4 < 0.1 * np.abs(dense).max()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_host_attention_over_compressed_cache(kv, monkeypatch):
    """The numpy kernel decompressing slot chunks and the XLA kernels decompressing blocks
    or the whole cache give float64 attention over the decoded values (chunks smaller than
    the prefix, rows split over KV head groups)."""
    from hx.host_compute import attention as host_attention
    from hx.host_compute.xla_attention import blocked_attention

    monkeypatch.setattr(host_attention, "SLOT_CHUNK", 7)
    monkeypatch.setattr(host_attention, "threads", lambda: 4)
    monkeypatch.setattr(host_attention, "MIN_TASK_BYTES", 1)
    rng = np.random.default_rng(3)
    Bq, Tq, Sq, H, K, E, write_index = 2, 3, 64, 4, 2, 32, 40
    fmt = kv_cache_format(kv, E)
    q = rng.standard_normal((Bq, Tq, H, E)).astype(np.float32)
    held = {name: quantize(rng.standard_normal((Bq, Sq, K, E)).astype(np.float32), fmt)
            for name in ("k", "v")}
    k, v = (dequantize(held[n], fmt, (Bq, Sq, K, E)) for n in ("k", "v"))
    kv_start = np.array([0, 5], np.int32)
    ref = attention_np(q, k, v, kv_start, write_index)
    got = prefix_attention(q, *(CompressedKV(h["codes"], h["scale"], h["offset"], fmt)
                                for h in held.values()), write_index, kv_start)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    cache = {kv_key(n, p): jnp.asarray(a) for n, h in held.items() for p, a in h.items()}
    step = Step(np.zeros((Bq, Tq), np.int32), np.int32(write_index), kv_start)
    for kernel in (blocked_attention, attention):
        out = jax.jit(kernel, static_argnums=3)(q, cache, step, fmt)
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5)


@pytest.mark.slow
def test_compressed_kv_in_iteration_level_runs(tiny_model, monkeypatch):
    """Joins, re-framing and shrinking move compressed caches row by row: each
    prompt gets the tokens it gets alone, in a block of two micro-batches of two rows, with
    the KV caches of odd layers on the host."""
    from hx import continuous, scheduler
    from hx.continuous import ContinuousBatcher
    from hx.generate import Engine
    from hx.sampling import SamplingParams

    engine = Engine(kv_model(tiny_model, "int4"), kv_host_odd(3))
    greedy = SamplingParams(max_new_tokens=24)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(5, 4000, n)] for n in (3, 70, 12, 41, 5, 29)]
    alone = [engine.generate_ids([p], greedy)[0].token_ids for p in prompts]
    decisions = []

    def spy(state):
        decisions.append(scheduler.schedule(state))
        return decisions[-1]

    monkeypatch.setattr(continuous, "schedule", spy)
    got = ContinuousBatcher(engine, 2, 2).run(prompts, greedy)
    assert [c.token_ids for c in got] == alone
    reframes = [r.slots for d in decisions if d is not None for r in d.reframes]
    assert reframes  # caches rolled along their slots
