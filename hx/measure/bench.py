"""Decode benchmark: executor step time per plan and batch vs one jitted whole-model step.

For each (plan, batch) the executor and a single ``jax.jit`` of ``models.decoder.forward`` on the
same device run alternately, step by step, over the same KV-cache state, so their ratio is
measured under the same machine load. Reported numbers are medians.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import jax
import numpy as np

from hx.devices import Devices
from hx.executor import Executor, held_params
from hx.host_compute.products import products_on
from hx.models.layers import Step
from hx.models.decoder import forward
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.prefill import run_prefill
from hx.timeline import H2D, Timeline, median_overlap
from hx.workload import CACHE_BUCKET, Workload, round_up


@dataclass
class DecodeBenchRow:
    """One (plan, batch) measurement. Times in seconds, rates in tokens/s.

    Attributes:
      weights: how the weights are held, ``matrices/tables`` formats
        (``ModelSpec.weight_format``, ``embedding_format``).
      h2d_weight_bytes: weight bytes copied host -> accelerator in a decode step, median of
        the traced steps (``link_weight_bytes``): what a weight format saves on the link.
    """

    plan: str
    weights: str
    host_matmul: str
    batch: int
    context: int
    steps: int
    executor_step_s: float
    whole_model_step_s: float
    ratio: float
    decode_tok_s: float
    segments_per_step: int
    reference_device: str
    overlap: float | None
    accelerator_peak_bytes: int
    h2d_weight_bytes: int


WARMUP_STEPS, TRACED_STEPS = 3, 8


def bench_workload(batch: int, context: int, steps: int) -> Workload:
    """The shapes ``bench_decode`` runs at (prefill of ``context`` tokens, cache for every
    warm-up, timed and traced decode step)."""
    return Workload(batch, context,
                    round_up(context + WARMUP_STEPS + steps + TRACED_STEPS, CACHE_BUCKET))


def _majority_device(plan: ExecutionPlan) -> str:
    devices = [dev for _, _, dev in plan.decode.sequence()]
    return max(set(devices), key=devices.count)


class DecodeProbe:
    """Decode-step inputs at a fixed batch after a prefill of ``context`` random tokens.

    ``prefill()`` returns the prefill (tokens, Step); ``step(i)`` the i-th decode (tokens, Step),
    with random token ids from a seeded generator.
    """

    def __init__(self, spec: ModelSpec, batch: int, context: int, seed: int = 0):
        self.spec, self.batch, self.context = spec, batch, context
        self.rng = np.random.default_rng(seed)
        self.kv_start = np.zeros((batch,), np.int32)

    def prefill(self) -> tuple[np.ndarray, Step]:
        B, T = self.batch, self.context
        tokens = self.rng.integers(0, self.spec.vocab_size, (B, T), dtype=np.int32)
        positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
        return tokens, Step(positions, np.int32(0), self.kv_start)

    def step(self, i: int) -> tuple[np.ndarray, Step]:
        B, at = self.batch, self.context + i
        tokens = self.rng.integers(0, self.spec.vocab_size, (B, 1), dtype=np.int32)
        return tokens, Step(np.full((B, 1), at, np.int32), np.int32(at), self.kv_start)


def time_decode(executor: Executor, probe: DecodeProbe, slots: int, steps: int,
                prefill: bool = True, warmup: int = WARMUP_STEPS) -> list[float]:
    """Seconds of each of ``steps`` executor decode steps until its logits were ready (after
    a prefill and ``warmup`` untimed steps: the first compiles, the next run on warm caches;
    one will do for shapes the executor ran before); the KV caches are released at the end.

    ``prefill=False`` decodes at the same positions over the zero-filled cache instead: a
    decode step does the same work whatever the cache holds, and no prefill is run or compiled
    (the profiler's calibration uses this to stay within its time).
    """
    caches = executor.new_cache(probe.batch, slots)
    times = []
    try:
        if prefill:
            _, caches = run_prefill(executor, *probe.prefill(), caches,
                                    executor.plan.prefill_chunk)
        for i in range(warmup + steps):
            tokens, step = probe.step(i)
            t0 = time.perf_counter()
            logits, caches = executor.run("decode", tokens, step, caches)
            logits.block_until_ready()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        executor.release_cache()


def time_block_decode(executor: Executor, probe: DecodeProbe, slots: int, steps: int,
                      micro_batches: int, warmup: int = WARMUP_STEPS) -> list[float]:
    """Seconds of each of ``steps`` decode steps of a block of ``micro_batches`` micro-batches
    of ``probe.batch`` rows (``Executor.run_block``, the zig-zag block schedule) until every
    micro-batch's logits were ready, after ``warmup`` untimed ones, over zero-filled
    caches at ``probe``'s positions (as ``time_decode(prefill=False)``); the caches are
    released at the end."""
    caches = [executor.new_cache(probe.batch, slots, micro=m) for m in range(micro_batches)]
    times = []
    try:
        for i in range(warmup + steps):
            tokens, step = probe.step(i)
            t0 = time.perf_counter()
            logits, caches = executor.run_block("decode", [tokens] * micro_batches,
                                                [step] * micro_batches, caches)
            jax.block_until_ready(logits)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        executor.release_cache()


def link_weight_bytes(timeline: Timeline) -> int:
    """Median bytes of weights copied host -> accelerator per decode step of ``timeline`` (its
    H2D ``weights`` events: streamed and disk-homed weights staged; 0 where none is)."""
    moved = [sum(e.args["bytes"] for e in step if e.resource == H2D
                 and e.name.startswith("weights")) for step in timeline.steps("decode")]
    return int(statistics.median(moved)) if moved else 0


def bench_decode(spec: ModelSpec, params: dict[str, Any], plan: ExecutionPlan, batch: int,
                 devices: Devices, context: int = 128, steps: int = 32) -> DecodeBenchRow:
    """Median decode-step time of the executor under ``plan`` and of the whole-model jit.

    Args:
      context: prompt tokens already in the KV cache when timing starts.
      steps: timed decode steps, after ``WARMUP_STEPS`` untimed ones; then ``TRACED_STEPS``
        more run with a ``Timeline`` to measure the overlap fraction and the weight bytes
        copied in (not timed: tracing adds its own cost).
    Returns:
      the measurement; ``ratio`` = executor / whole-model median step time, where the
      whole-model step runs, with every weight resident, on the device that hosts most of the
      plan's decode ops (its weights as the executor holds them there:
      ``executor.held_params``); ``overlap`` = median ``overlap_fraction`` of the traced
      steps (None when a step copies nothing).
    """
    warmup, traced_steps = WARMUP_STEPS, TRACED_STEPS
    slots = bench_workload(batch, context, steps).cache_slots
    probe = DecodeProbe(spec, batch, context)
    prompt, prefill = probe.prefill()

    executor = Executor(spec, params, plan, devices)
    exec_caches = executor.new_cache(batch, slots)
    _, exec_caches = run_prefill(executor, prompt, prefill, exec_caches,
                                 executor.plan.prefill_chunk)

    ref_name = _majority_device(plan)
    ref_device = devices[ref_name]
    ref_params = jax.device_put(held_params(spec, params, ref_name), ref_device)
    ref_step = jax.jit(partial(forward, products=products_on(ref_name)), static_argnums=0,
                       donate_argnums=(4,))
    ref_caches = jax.device_put(executor.new_cache(batch, slots), ref_device)
    _, ref_caches = ref_step(spec, ref_params, jax.device_put(prompt, ref_device),
                             jax.device_put(prefill, ref_device), ref_caches)

    exec_times, ref_times = [], []
    for i in range(warmup + steps):  # alternate, so both see the same machine load
        tokens, step = probe.step(i)
        t0 = time.perf_counter()
        logits, exec_caches = executor.run("decode", tokens, step, exec_caches)
        logits.block_until_ready()
        t1 = time.perf_counter()
        logits, ref_caches = ref_step(spec, ref_params, jax.device_put(tokens, ref_device),
                                      jax.device_put(step, ref_device), ref_caches)
        logits.block_until_ready()
        t2 = time.perf_counter()
        if i >= warmup:
            exec_times.append(t1 - t0)
            ref_times.append(t2 - t1)
    exec_s, ref_s = statistics.median(exec_times), statistics.median(ref_times)

    executor.timeline = Timeline()
    for i in range(warmup + steps, warmup + steps + traced_steps):
        tokens, step = probe.step(i)
        logits, exec_caches = executor.run("decode", tokens, step, exec_caches)
        logits.block_until_ready()
    overlap = median_overlap(executor.timeline)
    executor.release_cache()
    return DecodeBenchRow(plan=plan.name,
                          weights=f"{spec.weight_format}/{spec.embedding_format}",
                          host_matmul=spec.host_matmul, batch=batch, context=context, steps=steps,
                          executor_step_s=exec_s, whole_model_step_s=ref_s, ratio=exec_s / ref_s,
                          decode_tok_s=batch / exec_s,
                          segments_per_step=len(executor.segments["decode"]),
                          reference_device=ref_name, overlap=overlap,
                          accelerator_peak_bytes=executor.accountant.peak,
                          h2d_weight_bytes=link_weight_bytes(executor.timeline))


def rows_to_json(rows: list[DecodeBenchRow], devices: Devices, spec: ModelSpec) -> dict:
    """The JSON document ``hx bench`` writes (each row names its weight formats)."""
    return {"model": spec.name, "dtype": spec.dtype, "devices": devices.describe(),
            "emulated": devices.emulated, "rows": [asdict(r) for r in rows]}
