"""Robust wall-clock timing of JAX work on a shared, noisy machine, and how long the profiler
measures (``Effort``: ``FULL`` for ``hx profile``, ``QUICK`` when a command needs one now).

All times are in seconds, measured with ``time.perf_counter`` around the call and
``jax.block_until_ready`` of its result (device work is asynchronous: a call returns before the
device has finished).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax

WARMUP_S = 0.3


def median_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``run`` (blocking on its result) after at least ``WARMUP_S`` seconds
    and two calls of warm-up: on this VM a core that was idle runs at half speed for a while
    (measured: 16-20 ms instead of 8 ms for the same matmul chain right after a 1 s sleep)."""
    start, calls = time.perf_counter(), 0
    while calls < 2 or time.perf_counter() - start < WARMUP_S:
        jax.block_until_ready(run())
        calls += 1
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Timing:
    """What ``stable_seconds`` saw of one callable.

    Attributes:
      seconds: median wall time (s) of the last ``window`` timed calls.
      spread: (max - min) / median of those calls (0.05 = they agree within 5 %).
      calls: timed calls made (warm-up excluded).
    """

    seconds: float
    spread: float
    calls: int


def _window_spread(times: list[float]) -> float:
    mid = statistics.median(times)
    return (max(times) - min(times)) / mid if mid > 0 else float("inf")


def stable_seconds(*runs: Callable[[], object], window: int = 5, tolerance: float = 0.05,
                   max_rounds: int = 25, max_seconds: float = 3.0, warmup_s: float = WARMUP_S,
                   setups: Sequence[Callable[[], object] | None] | None = None
                   ) -> tuple[Timing, ...]:
    """Time each of ``runs`` until its median is stable, the runs interleaved.

    Each round calls every run once, in turn, so a slow spell of a shared machine hits them all
    alike (their ratio is what a two-point fit or a comparison needs). Warm-up: every run is
    called at least twice, and the rounds repeat untimed for ``warmup_s`` seconds. Then rounds
    are timed until, for every run, the last ``window`` times lie within ``tolerance`` of their
    median ((max - min) / median), or ``max_rounds`` rounds or ``max_seconds`` seconds of timed
    rounds have passed (at least ``window`` rounds always run).

    Args:
      runs: callables whose results are blocked on; each call is one sample.
      setups: one entry per run, or None: a callable entry is called (and its result blocked
        on) before each call of its run, outside the timed region, and its result is passed to
        the run (``run(setup())``): for sources that must be fresh on every call, as the
        executor's activations are.
    Returns:
      one ``Timing`` per run, in order: the median of its last ``window`` times when they
      settled within ``tolerance``, else the median of all its timed calls.
    """
    setups = tuple(setups) if setups is not None else (None,) * len(runs)

    def call(run: Callable, setup: Callable | None) -> float:
        args = () if setup is None else (jax.block_until_ready(setup()),)
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        return time.perf_counter() - t0

    start, rounds = time.perf_counter(), 0
    while rounds < 2 or time.perf_counter() - start < warmup_s:
        for run, setup in zip(runs, setups):
            call(run, setup)
        rounds += 1
    times: list[list[float]] = [[] for _ in runs]
    start = time.perf_counter()
    while True:
        for run, setup, seen in zip(runs, setups, times):
            seen.append(call(run, setup))
        n = len(times[0])
        if n < window:
            continue
        stable = all(_window_spread(seen[-window:]) <= tolerance for seen in times)
        if stable or n >= max_rounds or time.perf_counter() - start >= max_seconds:
            break
    result = []
    for seen in times:
        spread = _window_spread(seen[-window:])
        middle = statistics.median(seen[-window:] if spread <= tolerance else seen)
        result.append(Timing(middle, spread, len(seen)))
    return tuple(result)


MiB = 2**20
MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # M of a full profile's matmul curve
ATTENTION_SLOTS = (256, 1024, 4096)  # S of a full profile's attention curve


@dataclass(frozen=True)
class Effort:
    """How long to measure.

    Attributes:
      link_target_s: seconds one large copy should take (bandwidth-bound beyond it).
      memory_target_s / matmul_target_s: seconds one timed call of elementwise passes / of
        products should last (work is repeated inside the call until it does).
      matmul_rows: the M of the matmul rate curve.
      ggml_rows: the M of ggml's product curves (``rates.measure_ggml_matmul``: five
        layouts, up to 512 rows; the kernels' time is near linear in M between them).
      matmul_weight_bytes: weights of the product at M = 1, beyond any cache (256 MiB; the
        quick profile's 64 MiB are still beyond an H100's 50 MB L2).
      attention_slots: the S of the attention rate curve.
      window / tolerance / max_rounds / max_seconds / warmup_s: ``stable_seconds``' stopping
        rule for every figure.
      launch_plans: which of ``calibrate.dispatch_plans`` (indices) the launch fit observes
        on the tiny model: all five (1 to 121 segments), or the 33-segment one alone.
      dequantize_widths: the d_model of the MLP segments the decompression probe times
        (``rates.measure_dequantize``; up to Llama-2-7B's 4096).
    """

    link_target_s: float
    memory_target_s: float
    matmul_target_s: float
    matmul_rows: tuple[int, ...]
    ggml_rows: tuple[int, ...]
    matmul_weight_bytes: int
    attention_slots: tuple[int, ...]
    window: int
    tolerance: float
    max_rounds: int
    max_seconds: float
    warmup_s: float
    launch_plans: tuple[int, ...]
    dequantize_widths: tuple[int, ...]

    def time(self, *runs: Callable, setups=None, warmup_s: float | None = None
             ) -> tuple[Timing, ...]:
        """``stable_seconds`` of ``runs`` (interleaved) under this effort's stopping rule
        (``warmup_s`` instead of the effort's own, when given)."""
        return stable_seconds(*runs, window=self.window, tolerance=self.tolerance,
                              max_rounds=self.max_rounds, max_seconds=self.max_seconds,
                              warmup_s=self.warmup_s if warmup_s is None else warmup_s,
                              setups=setups)


FULL = Effort(link_target_s=0.02, memory_target_s=0.01, matmul_target_s=0.01,
              matmul_rows=MATMUL_ROWS, ggml_rows=(1, 4, 16, 32, 64, 256, 512),
              matmul_weight_bytes=256 * MiB,
              attention_slots=ATTENTION_SLOTS, window=5,
              tolerance=0.05, max_rounds=25, max_seconds=1.0, warmup_s=0.3,
              launch_plans=(0, 1, 2, 3, 4), dequantize_widths=(512, 1024, 2048, 4096))
QUICK = Effort(link_target_s=0.01, memory_target_s=0.005, matmul_target_s=0.005,
               matmul_rows=(1, 16, 256), ggml_rows=(1, 16, 256), matmul_weight_bytes=64 * MiB,
               attention_slots=(256, 4096), window=3,
               tolerance=0.05, max_rounds=7, max_seconds=0.4, warmup_s=0.1, launch_plans=(3,),
               dequantize_widths=(512,))
