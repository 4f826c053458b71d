"""Segment programs: each segment's jitted function, compiled ahead of time from shapes.

A segment (``hx.segments``) runs as one XLA program on its device. ``Programs`` lowers and
compiles it from ``jax.ShapeDtypeStruct`` arguments -- nothing is allocated or executed -- and
caches the executable per (signature, batch, new tokens, cache slots). The executor runs these
executables; the memory estimate reads their temporary bytes from XLA's own
``memory_analysis()`` (docs/architecture.md, "Memory: the accountant and the dry run"), so
plan-time and run-time temporaries are the same numbers
from the same compilation.

Temporaries are sized two ways (``Programs.temp_bytes``). **Exactly**, from the executable the
executor runs: what a run's check uses (``hx.memory.EXACT``), at no extra cost since the run
compiles it anyway. **By proxy**, for planners sizing many candidate plans of models they never
run (a 70B segment of 80 layers would take minutes to compile): a segment with many whole
layers is sized by a cut-down copy with one of its middle layers, plus what each further middle
layer adds (``layer_growth``). The middle layers of any segment are whole layers on its device
with resident weights, all alike, so the growth is measured once per device and shapes: the
whole model as one segment with two middle layers minus with one. On a GPU, and on XLA:CPU in
float32 and bfloat16, a layer's buffers are freed before the next layer starts and temporaries
do not grow with depth (Llama-2-7B shapes, a 1000-token prefill on XLA:CPU: 1, 4 and 32 layers
need 431, 447 and 447 MiB; a bfloat16 decode step: 0.5 MB a layer at one row, its products
padded to two by ``models.layers.product``). XLA:CPU has no float16 dot and holds a float32 copy
of every float16 weight of the program at once (SmolLM2, one decode step: 14.16 MB a layer, its
weights in float32), which the extrapolation follows.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hx.decode_loop import loop_function
from hx.devices import ACCELERATOR, HOST, Devices
from hx.host_compute.attention import attends_in_numpy, cache_attention
from hx.host_compute import ggml_kernel, ggml_layer, int4_kernel
from hx.host_compute.products import products_on
from hx.host_compute.xla_attention import blocked_attention
from hx.models.compressed import held_matrix
from hx.models.holding import rows_stay
from hx.models.formats import get_format
from hx.models.layers import Step, append_kv
from hx.models.decoder import apply_op
from hx.models.sharding import TP_AXIS, activation_partition, cache_partition, partition
from hx.models.spec import EMBED, HEAD, LAYER_OPS, ModelSpec
from hx.models.tensors import (OPS, activation_shape, held_slots, held_weights, kv_arrays,
                               kv_bytes, kv_format, weight_dtype, widest_slots)
from hx.plan import ExecutionPlan
from hx.sampling import Sampler
from hx.segments import Segment, split_segments
from hx.sizing import absent_accelerator
from hx.streamed_kv import H

PROXY_MIDDLE_LAYERS = 1


def segment_function(spec: ModelSpec, device: str, ops: tuple[str, ...],
                     writes: tuple[str, ...], attend: bool = True, keep_h: tuple[int, ...] = (),
                     types: tuple[str, ...] = (), parts: tuple[int, ...] = ()):
    """``(params tuple, activations, caches tuple, step) -> (activations, caches)``, jitted
    with the caches donated. Each op runs with the spec of its layer's type (``types``, one
    per op: ``ModelSpec.type_spec``; "" or none: ``spec``), so a local and a global layer of
    Gemma 3 attend over their own window with their own RoPE; an op with a part of an MoE
    layer's experts (``parts``: ``Segment.parts``) runs with that part's spec. SCORE on the host uses
    ``xla_attention.blocked_attention``; with ``attend=False`` it only appends k and v to its
    cache -- quantized there when the cache is compressed (``models.layers.append_kv``) -- and
    ``SplitHostProgram`` attends outside XLA. A host segment runs consecutive whole decoder
    layers of one type that ``host_compute.ggml_layer.runs`` takes as one ggml graph.
    The caches of the slots in ``keep_h`` come back with the new positions' ``h`` (B, T, D)
    beside K and V (a streamed cache that recomputes keeps it: ``hx.streamed_kv``)."""
    kernel = blocked_attention if device == HOST and spec.model_family.host_attention else None
    products = products_on(device)
    held, fmt = weight_dtype(spec, device), kv_format(spec)
    specs = [spec.type_spec(kind) for kind in types] if types else [spec] * len(ops)
    specs = [s if n < 0 else s.expert_part(op, n)
             for s, op, n in zip(specs, ops, parts or (-1,) * len(ops))]

    width = len(LAYER_OPS)

    def graph_layers(params, caches, i: int, slot: int, rows: int) -> int:
        """How many whole decoder layers from op ``i`` (cache ``slot``) run as one ggml graph
        (``host_compute.ggml_layer``): the consecutive ones of one type it takes."""
        n = 0
        while (device == HOST and attend and ops[i + n * width:i + (n + 1) * width] == LAYER_OPS
               and specs[i + n * width] == specs[i] and slot + n not in keep_h
               and ggml_layer.runs(specs[i], params[i + n * width:i + (n + 1) * width], rows,
                                   caches[slot + n])):
            n += 1
        return n

    def run(params, acts, caches, step):
        acts = dict(acts)
        caches = list(caches)
        slot, i = 0, 0
        while i < len(ops):
            op, p, op_spec = ops[i], params[i], specs[i]
            x = acts.get("x")
            n = 0 if x is None else graph_layers(params, caches, i, slot, x.shape[0] * x.shape[1])
            if n:
                acts["x"], caches[slot:slot + n] = ggml_layer.decoder_layers(
                    op_spec, [params[i + j * width:i + (j + 1) * width] for j in range(n)],
                    x, step, caches[slot:slot + n])
                slot, i = slot + n, i + n * width
                continue
            i += 1
            if OPS[op].uses_cache and not attend:
                caches[slot] = append_kv(caches[slot], acts["k"], acts["v"], step.write_index,
                                         fmt, ring=op_spec.sliding_window is not None)
                slot += 1
                continue
            if OPS[op].uses_cache:
                out, caches[slot] = apply_op(op_spec, op, p, acts, step, caches[slot], kernel)
                if slot in keep_h:
                    caches[slot] = {**caches[slot], H: acts[H]}
                slot += 1
            else:
                out, _ = apply_op(op_spec, op, p, acts, step, held=held, products=products)
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
      pieces: [(executable, activations it reads, number of ops, attends after it, the
        sliding window of that attention: ``ModelSpec.sliding_window`` of its layer's
        type)], in order (``host_pieces``).
      writes: the segment's outputs.
      dtype: dtype of the attention output ``o`` (the model's activation dtype); it goes on
        as a numpy array (the next piece's executable places it; a copy to the accelerator
        takes it as it is).
      kv_fmt: the KV cache's format (``models.tensors.kv_format``; None: dense); the numpy
        kernel decompresses the compressed cache block by block as it reads it.
    """

    def __init__(self, pieces: list[tuple[Any, tuple[str, ...], int, int, int | None]],
                 writes: tuple[str, ...], dtype, kv_fmt=None):
        self.pieces, self.writes, self.dtype, self.kv_fmt = pieces, writes, dtype, kv_fmt

    def __call__(self, params: tuple, acts: dict, caches: tuple, step: Step
                 ) -> tuple[dict, tuple]:
        acts, caches = dict(acts), list(caches)
        first = slot = 0
        for executable, reads, n_ops, attends, window in self.pieces:
            out, new = executable(params[first:first + n_ops], {n: acts[n] for n in reads},
                                  tuple(caches[slot:slot + attends]), step)
            first += n_ops
            acts.update(out)
            if attends:
                cache = caches[slot] = new[0]
                slot += 1
                o = cache_attention(out["q"], cache, step, self.kv_fmt, window)
                acts["o"] = o.astype(self.dtype)  # numpy: the next piece takes it as is
        return {name: acts[name] for name in self.writes}, tuple(caches)

    def memory_analysis(self) -> Any:
        """XLA's temporaries of the largest piece (``temp_size_in_bytes``); the attention's
        numpy scratch (a few MiB per thread) is host memory outside XLA."""
        temp = max(int(e.memory_analysis().temp_size_in_bytes) for e, *_ in self.pieces)
        return SimpleNamespace(temp_size_in_bytes=temp)


def param_tree(spec: ModelSpec, op: str, device: str, where) -> dict:
    """Abstract parameter tree of ``op`` as a segment on ``device`` holds it
    (``models.tensors.held_weights``), nested as the Flax modules nest it, each leaf on the
    sharding ``where(path, shape)`` gives."""
    tree: dict = {}
    for path, (shape, dtype) in held_weights(spec, op, device).items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _struct(shape, dtype, where(path, shape))
    for path in spec.op_weight_shapes(op):  # a compressed matrix's arrays: one typed leaf
        fmt = get_format(spec.matrix_format(path))
        if fmt is not None:
            *parents, leaf = path.split("/")
            node = functools.reduce(dict.__getitem__, parents, tree)
            stay = rows_stay(spec, op, path)
            node[leaf] = held_matrix(fmt, node[leaf], int4_kernel.row_block,
                                     lambda rows: stay and ggml_kernel.repacks(fmt.name, rows))
    return tree


def _struct(shape: tuple[int, ...], dtype: str, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def _activation_structs(spec: ModelSpec, names: tuple[str, ...], batch: int, tokens: int,
                        where) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract activations ``names`` at (B, T) (``models.tensors.activation_shape``), each on
    the sharding ``where(name, shape)`` gives."""
    structs = {}
    for n in names:
        shape, dtype = activation_shape(spec, n, batch, tokens)
        structs[n] = _struct(shape, dtype, where(n, shape))
    return structs


def middle_layers(segment: Segment) -> int:
    """Layers of ``segment`` strictly between its first and last layer (whole layers)."""
    layers = [layer for layer, _ in segment.ops if layer is not None]
    return max(0, layers[-1] - layers[0] - 1) if layers else 0


def proxy(segment: Segment, middle: int = PROXY_MIDDLE_LAYERS) -> Segment:
    """The segment with its middle whole layers cut to ``middle`` (itself when it has no
    more): same device, reads, writes and kinds of ops, for sizing temporaries."""
    if middle_layers(segment) <= middle:
        return segment
    first = next(layer for layer, _ in segment.ops if layer is not None)
    last = next(layer for layer, _ in reversed(segment.ops) if layer is not None)
    keep = [i for i, (layer, _) in enumerate(segment.ops)
            if layer is None or layer in (first, last) or layer <= first + middle]
    return Segment(segment.device, tuple(segment.ops[i] for i in keep),
                   tuple(segment.staged[i] for i in keep), segment.reads, segment.writes,
                   tuple(segment.parts[i] for i in keep) if segment.parts else ())


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
        acc = devices.accelerator
        self.tp = len(acc.group) or 1
        self.mesh = acc.mesh(TP_AXIS) if self.tp > 1 else None
        self.shardings = {ACCELERATOR: (NamedSharding(self.mesh, PartitionSpec())
                                        if self.mesh else
                                        SingleDeviceSharding(acc.device, memory_kind="device")),
                          HOST: SingleDeviceSharding(devices.host.device)}

    def weight_sharding(self, device: str, path: str, shape: tuple[int, ...],
                        memory_kind: str = "device"):
        """Where a weight at ``path`` (``.../wq/kernel``) of ``shape`` held for a segment on
        ``device`` lives: the host's CPU device, the accelerator (``memory_kind``: ``device``
        or ``pinned_host``), or split over the accelerators' mesh by ``models.sharding``."""
        if device == HOST:
            return self.shardings[HOST]
        if self.mesh is None:
            return SingleDeviceSharding(self.devices.accelerator.device,
                                        memory_kind=memory_kind)
        return NamedSharding(self.mesh,
                             PartitionSpec(*partition(self.spec, path, shape, self.tp)),
                             memory_kind=memory_kind)

    def activation_sharding(self, device: str, name: str, shape: tuple[int, ...]):
        """Where activation ``name`` of ``shape`` on ``device`` lives: on a mesh, the heads
        of q, k, v, o and the feed-forward rows of a split as the ops that make or take them
        split (``models.sharding.activation_partition``), the rest whole on each."""
        if device == HOST or self.mesh is None:
            return self.shardings[device]
        return NamedSharding(self.mesh, PartitionSpec(*activation_partition(name, shape,
                                                                            self.tp)))

    def cache_sharding(self, device: str, shape: tuple[int, ...]):
        """Where a dense KV cache array of ``shape`` (B, S, K, E) on ``device`` lives: on a
        mesh, split by KV heads (``models.sharding.cache_partition``)."""
        if device == HOST or self.mesh is None:
            return self.shardings[device]
        return NamedSharding(self.mesh, PartitionSpec(*cache_partition(shape, self.tp)))

    def abstract_args(self, segment: Segment, batch: int, tokens: int, slots: int) -> tuple:
        """``(params, activations, caches, step)`` of ``segment`` as ``ShapeDtypeStruct``s on
        its device: B=``batch`` rows, T=``tokens`` new tokens, S=``slots`` cache slots."""
        s, where = self.spec, self.shardings[segment.device]
        segment = self.at_rows(segment, batch, tokens)
        params = tuple(param_tree(segment.op_spec(s, i), op, segment.device, functools.partial(
            self.weight_sharding, segment.device)) for i, (_, op) in enumerate(segment.ops))
        acts = _activation_structs(segment.spec_at(s, end=False), segment.reads, batch, tokens,
                                   functools.partial(self.activation_sharding, segment.device))
        caches = tuple({name: _struct(shape, dtype, self.cache_sharding(segment.device, shape))
                        for name, (shape, dtype) in kv_arrays(
                            s, batch, held_slots(s.type_spec(kind), slots)).items()}
                       for kind in self.cache_types(segment))
        step = Step(_struct((batch, tokens), "int32", where), _struct((), "int32", where),
                    _struct((batch,), "int32", where))
        return params, acts, caches, step

    def cache_types(self, segment: Segment) -> tuple[str, ...]:
        """The layer type (``layer_types``) of each of ``segment``'s KV caches
        (``Segment.cache_layers``: its SCORE ops, in order)."""
        return tuple(kind for (_, op), kind in zip(segment.ops, self.layer_types(segment))
                     if OPS[op].uses_cache)

    def layer_types(self, segment: Segment) -> tuple[str, ...]:
        """Per op of ``segment``, its layer's type (``ModelSpec.layer_type``; "" for EMBED,
        HEAD and a model whose layers are alike): what the compiled function depends on
        beside ``Segment.signature``, which the plan alone gives."""
        return tuple("" if layer is None else self.spec.layer_type(layer)
                     for layer, _ in segment.ops)

    def at_rows(self, segment: Segment, batch: int, tokens: int) -> Segment:
        """``segment`` as a step of B·T rows runs it (``Segment.at_rows``: a layer's streamed
        experts in the slots the step can route to)."""
        return segment.at_rows(batch * tokens, self.spec.moe.top_k) if segment.routes else segment

    def signature(self, segment: Segment) -> tuple:
        """What ``segment``'s compiled function depends on: ``Segment.signature`` and its
        ops' ``layer_types`` (no layer index: segments of like layers share one function, a
        local and a global layer of Gemma 3 compile apart)."""
        return (*segment.signature, self.layer_types(segment))

    def _key(self, segment: Segment, batch: int, tokens: int, slots: int,
             keep_h: tuple[int, ...] = ()) -> tuple:
        device, ops, _, reads, writes, parts, types = self.signature(
            self.at_rows(segment, batch, tokens))
        return (device, ops, reads, writes, parts, types, batch, tokens,
                widest_slots(self.spec, slots) if segment.cache_layers else 0, keep_h)

    def _function(self, device: str, ops: tuple[str, ...], writes: tuple[str, ...],
                  attend: bool, keep_h: tuple[int, ...] = (), types: tuple[str, ...] = (),
                  parts: tuple[int, ...] = ()):
        key = (device, ops, writes, attend, keep_h, types, parts)
        if key not in self._functions:
            self._functions[key] = segment_function(self.spec, device, ops, writes, attend,
                                                    keep_h, types, parts)
        return self._functions[key]

    def _lower(self, segment: Segment, batch: int, tokens: int, slots: int,
               keep_h: tuple[int, ...] = ()):
        """The segment lowered at these shapes: something with ``compile()``."""
        device, ops, _, _, writes, parts, types = self.signature(
            self.at_rows(segment, batch, tokens))
        params, acts, caches, step = self.abstract_args(segment, batch, tokens, slots)
        s = self.spec
        held = max((held_slots(s.type_spec(kind), slots) for kind in self.cache_types(segment)),
                   default=slots)  # the largest cache a SCORE of the segment reads
        elements = 2 * batch * held * s.n_kv_heads * s.head_dim
        if (device != HOST or not segment.cache_layers or not s.model_family.host_attention
                or not attends_in_numpy(batch, held, s.n_kv_heads, s.head_dim,
                                        kv_bytes(s, batch, held) / elements)):
            return self._function(device, ops, writes, True, keep_h, types, parts).lower(
                params, acts, caches, step)
        where = self.shardings[HOST]
        lowered, first, slot = [], 0, 0
        for part, part_reads, part_writes in host_pieces(ops, writes):
            attends = int(OPS[part[-1]].uses_cache)
            kinds = types[first:first + len(part)]
            ins = _activation_structs(s.type_spec(kinds[0]) if kinds else s, part_reads,
                                      batch, tokens, lambda *_: where)
            piece_parts = parts[first:first + len(part)] if parts else ()
            lowered.append((self._function(HOST, part, part_writes, False, (), kinds,
                                           piece_parts).lower(
                params[first:first + len(part)], ins, caches[slot:slot + attends], step),
                part_reads, len(part), attends, s.type_spec(kinds[-1]).sliding_window))
            first, slot = first + len(part), slot + attends
        return _SplitLowering(lowered, writes, jnp.dtype(self.spec.dtype), kv_format(s))

    def compiled(self, segment: Segment, batch: int, tokens: int, slots: int,
                 keep_h: tuple[int, ...] = ()):
        """The executable of ``segment`` at these shapes (compiled on first use). Segments
        that differ only in which weights were staged share it (staged and resident weights
        are both device-memory arguments), and a segment without SCORE ignores ``slots``.
        ``keep_h``: ``segment_function``'s (an accelerator segment's cache slots that return
        their new ``h``)."""
        key = self._key(segment, batch, tokens, slots, keep_h)
        if key not in self._compiled:
            self._compiled[key] = self._lower(segment, batch, tokens, slots, keep_h).compile()
            self.compilations += 1
        return self._compiled[key]

    def decode_loop(self, segment: Segment, batch: int, slots: int, steps: int,
                    sampler: Sampler):
        """The executable of ``hx.decode_loop.loop_function`` over ``segment`` (a decode
        segment reading only ``tokens``): up to ``steps`` decode steps of B=``batch`` rows
        over S=``slots`` cache slots, sampled by ``sampler``, all on the segment's device
        (compiled on first use)."""
        key = ("loop", self._key(segment, batch, 1, slots), steps, sampler)
        if key not in self._compiled:
            device, ops, _, _, writes, parts, types = self.signature(segment)
            params, acts, caches, step = self.abstract_args(segment, batch, 1, slots)
            where = self.shardings[device]
            one, rows = functools.partial(_struct, (), sharding=where), functools.partial(
                _struct, (batch,), sharding=where)
            loop = loop_function(self._function(device, ops, writes, True, (), types, parts),
                                 steps, sampler)
            self._compiled[key] = loop.lower(
                params, acts["tokens"], caches, step, one("int32"), rows("uint32"),
                rows("uint32"), rows("int32"), _struct((self.spec.vocab_size,), "bool", where),
                one("float32"), one("float32")).compile()
            self.compilations += 1
        return self._compiled[key]

    def prepare(self, wanted: list[tuple]) -> None:
        """Compile the (segment, batch, tokens, slots[, keep_h]) not compiled yet, one after
        another: a thread each saved about 5 % of a cold plan-and-generate on the 2-core VM
        (10.9 against 11.4 s), not worth the threads (jaxlib 0.10.2's occasional segfault in
        the persistent compilation cache, once blamed on them, comes serially too: the log,
        session 27)."""
        for segment, batch, tokens, slots, *keep_h in wanted:
            self.compiled(segment, batch, tokens, slots, tuple(keep_h[0]) if keep_h else ())

    def sizing_segments(self, segment: Segment, exact: bool) -> tuple[Segment, ...]:
        """The segments ``temp_bytes`` compiles to size ``segment``: itself when ``exact`` or
        when it has at most one middle layer, else its proxy and the two that measure
        ``layer_growth``."""
        if exact or middle_layers(segment) <= PROXY_MIDDLE_LAYERS:
            return (segment,)
        return (proxy(segment), *_growth_probes(segment.device))

    def temp_bytes(self, segment: Segment, batch: int, tokens: int, slots: int,
                   exact: bool = True) -> int:
        """XLA's temporary bytes for one run of ``segment`` at (B, T, S), from
        ``memory_analysis()``: of its own executable when ``exact`` (what the executor runs),
        else of its ``proxy`` plus ``layer_growth`` for each further middle layer (the module
        docstring says why linear)."""
        n = middle_layers(segment)
        if exact or n <= PROXY_MIDDLE_LAYERS:
            return self._temp(segment, batch, tokens, slots)
        return (self._temp(proxy(segment), batch, tokens, slots)
                + (n - PROXY_MIDDLE_LAYERS) * self.layer_growth(segment.device, batch, tokens,
                                                                slots))

    def layer_growth(self, device: str, batch: int, tokens: int, slots: int) -> int:
        """XLA temporary bytes one more whole middle layer adds to a segment on ``device`` at
        (B, T, S), at least 0: the whole model as one segment, with two middle layers minus
        with one (about 0 on a GPU and in float32 or bfloat16; on XLA:CPU in float16, a
        layer's weights in float32)."""
        one, two = (self._temp(s, batch, tokens, slots) for s in _growth_probes(device))
        return max(0, two - one)

    def _temp(self, segment: Segment, batch: int, tokens: int, slots: int) -> int:
        key = self._key(segment, batch, tokens, slots)
        if key not in self._temps:
            analysis = self.compiled(segment, batch, tokens, slots).memory_analysis()
            self._temps[key] = int(analysis.temp_size_in_bytes)
        return self._temps[key]


def _growth_probes(device: str) -> tuple[Segment, Segment]:
    """The whole model on ``device`` as one segment, cut to one and to two middle layers."""
    host_ops = () if device == ACCELERATOR else (EMBED, *LAYER_OPS, HEAD)
    whole = split_segments(ExecutionPlan.uniform(PROXY_MIDDLE_LAYERS + 3, host_ops),
                           "decode")[0]
    return proxy(whole, PROXY_MIDDLE_LAYERS), proxy(whole, PROXY_MIDDLE_LAYERS + 1)


class _SplitLowering:
    """The lowered pieces of a ``SplitHostProgram``; ``compile()`` compiles them in order."""

    def __init__(self, lowered: list, writes: tuple[str, ...], dtype, kv_fmt=None):
        self.lowered, self.writes, self.dtype, self.kv_fmt = lowered, writes, dtype, kv_fmt

    def compile(self) -> SplitHostProgram:
        return SplitHostProgram([(piece.compile(), reads, n_ops, attends, window)
                                 for piece, reads, n_ops, attends, window in self.lowered],
                                self.writes, self.dtype, self.kv_fmt)


_PROGRAMS: dict[tuple, Programs] = {}
def programs_for(spec: ModelSpec, devices: Devices | None = None) -> Programs:
    """The process's ``Programs`` for ``spec``'s shapes on ``devices`` (default: what
    ``hx.discover`` finds), shared by executors and estimates so each segment compiles once.
    Specs that differ only in layer count or name share one (their ``layer_types`` kept: a
    segment's layers' types are part of its key, ``Programs.signature``). A shapes-only
    architecture (OPT) is compiled as the Llama layer of the same shapes: only its XLA
    temporaries are asked for, and SwiGLU's extra (B, T, F) product makes them an upper bound for OPT's ReLU MLP. Inside
    ``hx.sizing.sizing_for_absent_accelerator`` the model is compiled in float32."""
    from hx.devices import discover

    devices = devices or discover()
    shape = spec.replace(n_layers=1, name="")
    if absent_accelerator():
        shape = shape.replace(dtype="float32")
    key = (shape, devices.accelerator.device, devices.accelerator.group, devices.host.device)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = Programs(shape, devices)
    return _PROGRAMS[key]
