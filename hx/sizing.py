"""Whose compiler sizes XLA's temporaries in a plan-time estimate: this process's, for its own
accelerator, or -- inside ``sizing_for_absent_accelerator`` -- a float32 stand-in for one that
is not here. Free of JAX, so that the planner can choose (``planner.hardware.memory_sizing``);
``hx.programs.programs_for`` reads it (``absent_accelerator``)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_ABSENT_ACCELERATOR: ContextVar[bool] = ContextVar("hx_absent_accelerator", default=False)


@contextmanager
def sizing_for_absent_accelerator() -> Iterator[None]:
    """Within the block, size XLA temporaries for an accelerator that is not this process's:
    a hardware preset the simulator prices (``planner.grid``, ``hx simulate``).

    ``hx.programs.programs_for`` then compiles the model in float32. XLA:CPU has no
    float16/bfloat16 dot: it converts the operands to float32, so a half-precision program
    compiled here holds float32 copies of its weights as temporaries (an OPT-175B layer: tens
    of GB), which a GPU, multiplying in the half type, never allocates. No buffer of the
    half-precision program is wider than the float32 program's, so the float32 temporaries
    bound the target's from above.
    """
    token = _ABSENT_ACCELERATOR.set(True)
    try:
        yield
    finally:
        _ABSENT_ACCELERATOR.reset(token)


def absent_accelerator() -> bool:
    """Whether this is inside ``sizing_for_absent_accelerator``."""
    return _ABSENT_ACCELERATOR.get()
