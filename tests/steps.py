"""Step sequences used by several tests."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from hx.models.layers import Step


def left_padded_steps(prompt: int, decode_steps: int) -> Iterator[Step]:
    """Two rows, the second left-padded by 2: the prefill of ``prompt`` tokens, then
    ``decode_steps`` decode steps."""
    kv_start = np.array([0, 2], np.int32)
    yield Step(np.maximum(np.arange(prompt, dtype=np.int32)[None] - kv_start[:, None], 0),
               np.int32(0), kv_start)
    for i in range(1, decode_steps + 1):
        yield Step((prompt - kv_start + i - 1)[:, None].astype(np.int32),
                   np.int32(prompt + i - 1), kv_start)
