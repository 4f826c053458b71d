"""The host stream: host segments of a block run on one worker thread, in issue order.

XLA dispatches a program asynchronously, but a host segment holding SCORE
(``hx.programs.SplitHostProgram``) computes its attention in numpy, which the calling thread
has to wait for. In a block of micro-batches (the zig-zag schedule) that would stop the
executor from issuing the next micro-batch's accelerator work while the host attends, so the
executor hands host segments to this stream instead and keeps ``Deferred`` results: it waits
on one only where it needs the value (a copy to the accelerator, the end of the step). One
thread keeps host work in issue order, as XLA's own host queue does, so a host segment's
inputs from an earlier host segment are always ready when it runs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Callable

import jax


@lru_cache(maxsize=1)
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="hx-host-stream")


class Deferred:
    """One value of a host-stream call's result: ``result[index]`` (or ``result[index][key]``
    when ``key`` is given), available once the call has run."""

    def __init__(self, future: Future, index: int, key: Any = None):
        self.future, self.index, self.key = future, index, key

    def get(self) -> Any:
        """The value; waits for the call, and raises what it raised."""
        value = self.future.result()[self.index]
        return value if self.key is None else value[self.key]


def submit(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*resolve(args))`` on the host stream, after everything submitted before."""
    return _worker().submit(lambda: fn(*resolve(args)))


def pending(tree: Any) -> bool:
    """Whether ``tree`` holds a ``Deferred`` leaf (a value the stream still owes)."""
    return any(isinstance(x, Deferred) for x in jax.tree.leaves(
        tree, is_leaf=lambda x: isinstance(x, Deferred)))


def resolve(tree: Any) -> Any:
    """``tree`` with every ``Deferred`` leaf replaced by its value (waiting for it)."""
    return jax.tree.map(lambda x: x.get() if isinstance(x, Deferred) else x, tree,
                        is_leaf=lambda x: isinstance(x, Deferred))
