"""Timeline of segments and transfers, written as a Chrome / Perfetto trace (docs/architecture.md,
"The executor").

JAX dispatch is asynchronous, so an event's end is observed, not assumed: each resource has a
watcher thread that waits (``block_until_ready``) on the event's output arrays in dispatch
order and stamps the time they became ready. Its start is reconstructed as the latest of: its
dispatch time, the end of the previous event on the same resource (each resource is modelled as
one in-order stream), and the ends of the events that produced its inputs.

Resources: ``accelerator compute``, ``host compute``, ``H2D`` (host -> accelerator copies) and
``D2H`` (accelerator -> host copies).
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

ACC_COMPUTE, HOST_COMPUTE, H2D, D2H = "accelerator compute", "host compute", "H2D", "D2H"
RESOURCES = (ACC_COMPUTE, HOST_COMPUTE, H2D, D2H)
COMPUTE, COPY = (ACC_COMPUTE, HOST_COMPUTE), (H2D, D2H)
SWITCH_INTERVAL_S = 5e-5


@dataclass
class Event:
    """One segment run or transfer. Times are ``time.perf_counter()`` seconds."""

    id: int
    resource: str
    name: str
    step: int
    dispatch: float
    deps: tuple[int, ...]
    args: dict[str, Any]
    start: float | None = None
    end: float | None = None


@dataclass
class Timeline:
    """Records events; ``wait()`` before reading starts and ends.

    The first event recorded on a resource starts that resource's watcher thread and lowers
    the interpreter's thread switch interval to ``SWITCH_INTERVAL_S`` for the rest of the
    process (see ``_queue``); a timeline built from given events (the simulator's) starts
    neither.
    """

    events: list[Event] = field(default_factory=list)
    step: int = -1
    step_names: dict[int, str] = field(default_factory=dict)
    _queues: dict[str, queue.Queue] = field(default_factory=dict)

    def _queue(self, resource: str) -> queue.Queue:
        """``resource``'s queue, its watcher started on first use. Raises ValueError for a
        resource not in ``RESOURCES``."""
        if resource not in RESOURCES:
            raise ValueError(f"unknown timeline resource {resource!r}: one of {RESOURCES}")
        if resource not in self._queues:
            # Watchers stamp an event's end once they get the GIL back; keep that latency to
            # tens of microseconds instead of CPython's default 5 ms switch interval.
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            self._queues[resource] = queue.Queue()
            threading.Thread(target=self._watch, args=(self._queues[resource],), daemon=True,
                             name=f"hx-timeline-{resource}").start()
        return self._queues[resource]

    @staticmethod
    def _watch(q: queue.Queue) -> None:
        import jax  # here, not at the top: the simulator's timelines import no JAX

        from hx.host_compute import stream

        while True:
            event, arrays = q.get()
            try:
                jax.block_until_ready(stream.resolve(arrays))
            except RuntimeError:  # deleted: donated to a later program, so defined by now
                pass
            event.end = time.perf_counter()
            del event, arrays  # hold no buffers while waiting for the next event
            q.task_done()

    def begin_step(self, name: str) -> int:
        """Start a new step (one executor run); events recorded next belong to it."""
        self.step += 1
        self.step_names[self.step] = name
        return self.step

    def record(self, resource: str, name: str, arrays: Any, deps: Iterable[int | None] = (),
               dispatch: float | None = None, **args: Any) -> int:
        """Record an event that finishes when ``arrays`` are ready; returns its id.

        Args:
          resource: one of ``RESOURCES``.
          arrays: pytree of the event's output arrays.
          deps: ids of events whose outputs it reads (None entries are ignored).
          dispatch: when it was issued (default: now).
        """
        event = Event(len(self.events), resource, name, self.step,
                      time.perf_counter() if dispatch is None else dispatch,
                      tuple(d for d in deps if d is not None), args)
        self.events.append(event)
        self._queue(resource).put((event, arrays))
        return event.id

    def wait(self) -> None:
        """Block until every recorded event has an end, then resolve starts."""
        for q in self._queues.values():
            q.join()
        last_end: dict[str, float] = {}
        for e in self.events:  # dispatch order
            start = max([e.dispatch, last_end.get(e.resource, 0.0)]
                        + [self.events[d].end for d in e.deps])
            e.start = min(start, e.end)
            last_end[e.resource] = e.end

    def steps(self, name: str | None = None) -> list[list[Event]]:
        """Events grouped by step, optionally only steps called ``name``."""
        groups: dict[int, list[Event]] = {}
        for e in self.events:
            if name is None or self.step_names.get(e.step) == name:
                groups.setdefault(e.step, []).append(e)
        return [groups[k] for k in sorted(groups)]

    def to_chrome(self, path: str) -> None:
        """Write a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one track
        per resource, one complete ("X") event per segment or transfer, times in µs."""
        self.wait()
        t0 = min((e.start for e in self.events), default=0.0)
        tids = {r: i + 1 for i, r in enumerate(RESOURCES)}
        trace = [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": r}}
                 for r, tid in tids.items()]
        trace.append({"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "hx"}})
        for e in self.events:
            trace.append({"ph": "X", "pid": 1, "tid": tids[e.resource], "name": e.name,
                          "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6,
                          "args": {"step": e.step, "phase": self.step_names.get(e.step),
                                   **e.args}})
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def overlap_fraction(events: list[Event]) -> float | None:
    """(Σcompute + Σcopy − wall) / min(Σcompute, Σcopy) over one step's events.

    Σ are sums of event durations on the compute and copy resources; wall runs from the step's
    first dispatch to its last end. 1 means the shorter of the two is entirely hidden under the
    other; 0 means they never overlap (gaps in the step make it lower still). None when the
    step has no compute or its copies take under 1 % of its compute time (e.g. only the input
    tokens cross): the ratio of two near-zero quantities says nothing.
    """
    compute = sum(e.end - e.start for e in events if e.resource in COMPUTE)
    copy = sum(e.end - e.start for e in events if e.resource in COPY)
    if compute <= 0 or copy < 0.01 * compute:
        return None
    wall = max(e.end for e in events) - min(e.dispatch for e in events)
    return (compute + copy - wall) / min(compute, copy)


def step_traffic(timeline: Timeline, phase: str = "decode") -> dict[str, float]:
    """Medians over the timeline's steps of ``phase``: bytes each copy resource moved a step
    (``H2D``, ``D2H``: the events' ``bytes``), and ``experts``, the streamed routed experts a
    step copied (the ``experts in`` events' ``experts``); {} without such steps."""
    timeline.wait()
    steps = timeline.steps(phase)
    if not steps:
        return {}
    per_step = [{**{r: sum(e.args.get("bytes", 0) for e in events if e.resource == r)
                    for r in COPY},
                 "experts": sum(len(e.args.get("experts", ())) for e in events)}
                for events in steps]
    return {key: statistics.median(step[key] for step in per_step) for key in per_step[0]}


def median_overlap(timeline: Timeline, phase: str = "decode") -> float | None:
    """Median ``overlap_fraction`` over the timeline's steps of ``phase``."""
    timeline.wait()
    values = [v for v in (overlap_fraction(s) for s in timeline.steps(phase)) if v is not None]
    return statistics.median(values) if values else None
