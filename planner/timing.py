"""Robust wall-clock timing of JAX work on a shared, noisy machine."""

from __future__ import annotations

import statistics
import time
from typing import Callable

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
