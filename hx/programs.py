"""Segment programs: each segment's jitted function, compiled ahead of time from shapes.

A segment (``hx.segments``) runs as one XLA program on its device. ``Programs`` lowers and
compiles it from ``jax.ShapeDtypeStruct`` arguments -- nothing is allocated or executed -- and
caches the executable per (signature, batch, new tokens, cache slots). The executor runs these
executables; the memory estimate reads their temporary bytes from XLA's own
``memory_analysis()`` (DESIGN §5), so plan-time and run-time temporaries are the same numbers
from the same compilation.

A segment holding many whole layers (the all-accelerator plan is one segment of the whole
model) is sized by a *proxy* with at most ``PROXY_MIDDLE_LAYERS`` of its middle layers: XLA
frees a layer's buffers before the next layer starts, so temporaries do not grow with depth
(measured on XLA:CPU at Llama-2-7B shapes: 1, 4 and 32 layers of one segment need 431, 447
and 447 MiB at a 1000-token prefill; ``tests/test_schedule.py`` checks proxy >= whole). This
keeps sizing a 70B plan to a few small compilations.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from hx.devices import ACCELERATOR, HOST, Devices
from hx.host_compute.attention import attends_in_numpy, cache_attention
from hx.host_compute.xla_attention import blocked_attention
from hx.models.llama import OPS, Step, append_kv, apply_op
from hx.models.spec import HOST_DTYPE, ModelSpec
from hx.segments import Segment

PROXY_MIDDLE_LAYERS = 1


def segment_function(spec: ModelSpec, device: str, ops: tuple[str, ...],
                     writes: tuple[str, ...], attend: bool = True):
    """``(params tuple, activations, caches tuple, step) -> (activations, caches)``, jitted
    with the caches donated. SCORE on the host uses ``xla_attention.blocked_attention``; with
    ``attend=False`` it only appends k and v to its cache (``SplitHostProgram`` attends
    outside XLA)."""
    kernel = blocked_attention if device == HOST else None

    def run(params, acts, caches, step):
        acts = dict(acts)
        caches = list(caches)
        slot = 0
        for op, p in zip(ops, params):
            if OPS[op].uses_cache and not attend:
                caches[slot] = append_kv(caches[slot], acts["k"], acts["v"], step.write_index)
                slot += 1
                continue
            if OPS[op].uses_cache:
                out, caches[slot] = apply_op(spec, op, p, acts, step, caches[slot], kernel)
                slot += 1
            else:
                out, _ = apply_op(spec, op, p, acts, step)
            acts.update(out)
        return {name: acts[name] for name in writes}, tuple(caches)

    return jax.jit(run, donate_argnums=(2,))


def host_pieces(ops: tuple[str, ...], writes: tuple[str, ...]
                ) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """A host segment's ops cut after each SCORE: [(ops, reads, writes), ...]. A piece ending
    in SCORE only appends k, v to the cache in XLA and writes ``q`` for the attention after
    it, which makes ``o``. Reads and writes come from liveness, back to front: a piece writes
    what later pieces or the segment's ``writes`` use, and reads what it uses before making."""
    cuts = [i + 1 for i, op in enumerate(ops) if OPS[op].uses_cache]
    spans = [(a, b) for a, b in zip([0] + cuts, cuts + [len(ops)]) if b > a]
    pieces, live = [], set(writes)
    for a, b in reversed(spans):
        part = ops[a:b]
        scores = OPS[part[-1]].uses_cache
        out = (live - {"o"}) | ({"q"} if scores else set())
        live = set(out)
        for op in reversed(part):
            made = () if OPS[op].uses_cache else OPS[op].writes
            live = (live - set(made)) | set(OPS[op].reads)
        pieces.insert(0, (part, tuple(sorted(live)), tuple(sorted(out))))
    return pieces


class SplitHostProgram:
    """A host segment holding SCORE, run as XLA programs cut after each SCORE (which there
    only appends k, v to the donated cache) with ``host_compute.attention.cache_attention``
    reading the cache in place between them. Called like a compiled segment executable.

    Args:
      pieces: [(executable, activations it reads, number of ops, attends after it)], in
        order (``host_pieces``).
      writes: the segment's outputs.
      dtype: dtype of the attention output ``o`` (the model's activation dtype); it goes on
        as a numpy array (the next piece's executable places it; a copy to the accelerator
        takes it as it is).
    """

    def __init__(self, pieces: list[tuple[Any, tuple[str, ...], int, int]],
                 writes: tuple[str, ...], dtype):
        self.pieces, self.writes, self.dtype = pieces, writes, dtype

    def __call__(self, params: tuple, acts: dict, caches: tuple, step: Step
                 ) -> tuple[dict, tuple]:
        acts, caches = dict(acts), list(caches)
        first = slot = 0
        for executable, reads, n_ops, attends in self.pieces:
            out, new = executable(params[first:first + n_ops], {n: acts[n] for n in reads},
                                  tuple(caches[slot:slot + attends]), step)
            first += n_ops
            acts.update(out)
            if attends:
                cache = caches[slot] = new[0]
                slot += 1
                o = cache_attention(out["q"], cache, step)
                acts["o"] = o.astype(self.dtype)  # numpy: the next piece takes it as is
        return {name: acts[name] for name in self.writes}, tuple(caches)

    def memory_analysis(self) -> Any:
        """XLA's temporaries of the largest piece (``temp_size_in_bytes``); the attention's
        numpy scratch (a few MiB per thread) is host memory outside XLA."""
        temp = max(int(e.memory_analysis().temp_size_in_bytes) for e, *_ in self.pieces)
        return SimpleNamespace(temp_size_in_bytes=temp)


def weight_dtype(spec: ModelSpec, device: str) -> str:
    """The dtype a segment on ``device`` holds its weights in: ``HOST_DTYPE`` (float32) on the
    host, the model's dtype on the accelerator (``models.spec.HOST_DTYPE`` says why)."""
    return HOST_DTYPE if device == HOST else spec.dtype


def activation_shape(spec: ModelSpec, name: str, batch: int, tokens: int
                     ) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of a named activation (``models.llama.OPS`` names) at B=``batch``,
    T=``tokens``: the model's dtype on either device; token ids int32, logits float32."""
    s, B, T, dt = spec, batch, tokens, jnp.dtype(spec.dtype)
    shapes = {"tokens": ((B, T), jnp.int32), "x": ((B, T, s.d_model), dt),
              "h": ((B, T, s.d_model), dt),
              "q": ((B, T, s.n_heads, s.head_dim), dt),
              "o": ((B, T, s.n_heads, s.head_dim), dt),
              "k": ((B, T, s.n_kv_heads, s.head_dim), dt),
              "v": ((B, T, s.n_kv_heads, s.head_dim), dt),
              "a": ((B, T, s.d_ff), dt), "logits": ((B, s.vocab_size), jnp.float32)}
    return shapes[name]


def _param_tree(spec: ModelSpec, op: str, sharding, dtype: str) -> dict:
    """Abstract parameter tree of ``op`` in ``dtype``, nested as the Flax modules nest it."""
    tree: dict = {}
    for path, shape in spec.op_weight_shapes(op).items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    return tree


def proxy(segment: Segment) -> Segment:
    """The segment with its middle whole layers cut to ``PROXY_MIDDLE_LAYERS`` (itself when
    it has no more): same device, reads, writes and kinds of ops, for sizing temporaries."""
    layers = [layer for layer, _ in segment.ops if layer is not None]
    if not layers:
        return segment
    first, last = layers[0], layers[-1]
    if last - first - 1 <= PROXY_MIDDLE_LAYERS:
        return segment
    keep = [i for i, (layer, _) in enumerate(segment.ops)
            if layer is None or layer in (first, last) or layer <= first + PROXY_MIDDLE_LAYERS]
    return Segment(segment.device, tuple(segment.ops[i] for i in keep),
                   tuple(segment.staged[i] for i in keep), segment.reads, segment.writes)


class Programs:
    """AOT-compiled segment executables of one model on one pair of devices, cached.

    Args:
      spec: model shapes (its layer count does not matter: segments name their ops).
      devices: where accelerator and host segments run.
    Attributes:
      compilations: number of XLA compilations so far.
    """

    def __init__(self, spec: ModelSpec, devices: Devices):
        self.spec, self.devices = spec, devices
        self.compilations = 0
        self._functions: dict[tuple, Any] = {}
        self._compiled: dict[tuple, Any] = {}
        self._temps: dict[tuple, int] = {}
        acc = devices.accelerator.device
        self.shardings = {ACCELERATOR: SingleDeviceSharding(acc, memory_kind="device"),
                          HOST: SingleDeviceSharding(devices.host.device)}

    def abstract_args(self, segment: Segment, batch: int, tokens: int, slots: int) -> tuple:
        """``(params, activations, caches, step)`` of ``segment`` as ``ShapeDtypeStruct``s on
        its device: B=``batch`` rows, T=``tokens`` new tokens, S=``slots`` cache slots."""
        s, where = self.spec, self.shardings[segment.device]

        def struct(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

        held = weight_dtype(s, segment.device)
        params = tuple(_param_tree(s, op, where, held) for _, op in segment.ops)
        acts = {n: struct(*activation_shape(s, n, batch, tokens)) for n in segment.reads}
        cache, kv = (batch, slots, s.n_kv_heads, s.head_dim), jnp.dtype(s.dtype)
        caches = tuple({"k": struct(cache, kv), "v": struct(cache, kv)}
                       for _ in segment.cache_layers)
        step = Step(struct((batch, tokens), jnp.int32), struct((), jnp.int32),
                    struct((batch,), jnp.int32))
        return params, acts, caches, step

    def _key(self, segment: Segment, batch: int, tokens: int, slots: int) -> tuple:
        device, ops, _, reads, writes = segment.signature
        return (device, ops, reads, writes, batch, tokens, slots if segment.cache_layers else 0)

    def _function(self, device: str, ops: tuple[str, ...], writes: tuple[str, ...],
                  attend: bool):
        key = (device, ops, writes, attend)
        if key not in self._functions:
            self._functions[key] = segment_function(self.spec, device, ops, writes, attend)
        return self._functions[key]

    def _lower(self, segment: Segment, batch: int, tokens: int, slots: int):
        """The segment lowered at these shapes: something with ``compile()``."""
        device, ops, _, _, writes = segment.signature
        params, acts, caches, step = self.abstract_args(segment, batch, tokens, slots)
        s = self.spec
        if device != HOST or not segment.cache_layers or not attends_in_numpy(
                batch, slots, s.n_kv_heads, s.head_dim, jnp.dtype(s.dtype).itemsize):
            return self._function(device, ops, writes, True).lower(params, acts, caches, step)
        where = self.shardings[HOST]
        lowered, first, slot = [], 0, 0
        for part, part_reads, part_writes in host_pieces(ops, writes):
            attends = int(OPS[part[-1]].uses_cache)
            ins = {n: jax.ShapeDtypeStruct(*activation_shape(self.spec, n, batch, tokens),
                                           sharding=where) for n in part_reads}
            lowered.append((self._function(HOST, part, part_writes, False).lower(
                params[first:first + len(part)], ins, caches[slot:slot + attends], step),
                part_reads, len(part), attends))
            first, slot = first + len(part), slot + attends
        return _SplitLowering(lowered, writes, jnp.dtype(self.spec.dtype))

    def compiled(self, segment: Segment, batch: int, tokens: int, slots: int):
        """The executable of ``segment`` at these shapes (compiled on first use). Segments
        that differ only in which weights were staged share it (staged and resident weights
        are both device-memory arguments), and a segment without SCORE ignores ``slots``."""
        key = self._key(segment, batch, tokens, slots)
        if key not in self._compiled:
            self._compiled[key] = self._lower(segment, batch, tokens, slots).compile()
            self.compilations += 1
        return self._compiled[key]

    def prepare(self, wanted: list[tuple[Segment, int, int, int]]) -> None:
        """Compile the (segment, batch, tokens, slots) not compiled yet, on every CPU core at
        once: each is handed to a compiling thread as soon as it is lowered (XLA compiles
        without holding Python's lock, so compiles overlap the tracing and lowering of the
        next segments, which stay serial)."""
        todo: dict[tuple, Any] = {}
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for segment, batch, tokens, slots in wanted:
                key = self._key(segment, batch, tokens, slots)
                if key not in self._compiled and key not in todo:
                    todo[key] = pool.submit(self._lower(segment, batch, tokens, slots).compile)
            for key, compiling in todo.items():
                self._compiled[key] = compiling.result()
                self.compilations += 1

    def temp_bytes(self, segment: Segment, batch: int, tokens: int, slots: int) -> int:
        """XLA's temporary bytes for one run of ``segment`` (of its ``proxy`` when it holds
        many whole layers), from ``memory_analysis()``."""
        short = proxy(segment)
        key = self._key(short, batch, tokens, slots)
        if key not in self._temps:
            analysis = self.compiled(short, batch, tokens, slots).memory_analysis()
            self._temps[key] = int(analysis.temp_size_in_bytes)
        return self._temps[key]


class _SplitLowering:
    """The lowered pieces of a ``SplitHostProgram``; ``compile()`` compiles them in order."""

    def __init__(self, lowered: list, writes: tuple[str, ...], dtype):
        self.lowered, self.writes, self.dtype = lowered, writes, dtype

    def compile(self) -> SplitHostProgram:
        return SplitHostProgram([(piece.compile(), reads, n_ops, attends)
                                 for piece, reads, n_ops, attends in self.lowered],
                                self.writes, self.dtype)


_PROGRAMS: dict[tuple, Programs] = {}
_ABSENT_ACCELERATOR: ContextVar[bool] = ContextVar("hx_absent_accelerator", default=False)


@contextmanager
def sizing_for_absent_accelerator() -> Iterator[None]:
    """Within the block, size XLA temporaries for an accelerator that is not this process's:
    a hardware preset the simulator prices (``planner.grid``, ``hx simulate``).

    ``programs_for`` then compiles the model in float32. XLA:CPU has no float16/bfloat16 dot:
    it converts the operands to float32, so a half-precision program compiled here holds
    float32 copies of its weights as temporaries (an OPT-175B layer: tens of GB), which a GPU,
    multiplying in the half type, never allocates. No buffer of the half-precision program is
    wider than the float32 program's, so the float32 temporaries bound the target's from above.
    """
    token = _ABSENT_ACCELERATOR.set(True)
    try:
        yield
    finally:
        _ABSENT_ACCELERATOR.reset(token)


def programs_for(spec: ModelSpec, devices: Devices | None = None) -> Programs:
    """The process's ``Programs`` for ``spec``'s shapes on ``devices`` (default: what
    ``hx.discover`` finds), shared by executors and estimates so each segment compiles once.
    Specs that differ only in layer count or name share one. A shapes-only architecture (OPT)
    is compiled as the Llama layer of the same shapes: only its XLA temporaries are asked for,
    and SwiGLU's extra (B, T, F) product makes them an upper bound for OPT's ReLU MLP. Inside
    ``sizing_for_absent_accelerator`` the model is compiled in float32."""
    from hx.devices import discover

    devices = devices or discover()
    shape = spec.replace(n_layers=1, name="", architecture="llama")
    if _ABSENT_ACCELERATOR.get():
        shape = shape.replace(dtype="float32")
    key = (shape, devices.accelerator.device, devices.host.device)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = Programs(shape, devices)
    return _PROGRAMS[key]
