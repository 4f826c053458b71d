"""Throughput mode (iteration-level scheduling over a block of micro-batches) and the runner
that carries out ``hx.scheduler``'s decisions, for it and for static batches.

Orca (Yu et al., OSDI 2022) schedules per iteration instead of per batch: a sequence leaves the
batch the step it ends and a waiting prompt takes its place at the next iteration, so short
answers do not wait for long ones and no step computes rows that are done.
``ContinuousBatcher`` sizes, checks and compiles such a run over a block of N micro-batches of
B rows (the zig-zag block schedule of ``Executor.run_block``: each streamed layer serves all
N·B rows once per step). ``hx.scheduler.schedule`` decides each step -- who joins, in which
prefill chunks, who leaves, which micro-batches shrink or are reframed (its docstring gives the
rules) -- and ``BlockRunner`` carries the decisions out on the executor:

* a ``Join`` is prefilled, a power of two of prompts of one padded length together, into a
  spare cache of as many rows; the receiving micro-batches are reframed where needed and each
  prompt's cache row is copied into its row, reframed so that its last token sits just before
  the frontier (a static batch is prefilled straight into its micro-batch's caches);
* a ``Decode`` shrinks micro-batches (their live cache rows gathered, layer by layer), reframes
  reframes others (their caches rolled along the slots, layer by layer), then steps each block of
  micro-batches of equal rows and samples every row.

Each row computes what it would alone, up to float rounding of the batched products.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hx.devices import ACCELERATOR, release_free_heap
from hx.errors import HxError
from hx.memory import reframe_bytes
from hx.models.layers import Cache, Step
from hx.models.spec import ModelSpec
from hx.models.tensors import step_limit
from hx.prefill import check_prompts, left_pad, prefill_in_chunks
from hx.sampling import Sampler, SamplingParams, sample
from hx.scheduler import (BatchState, BlockConfig, Completion, Decode, Join, MicroBatch,
                          Reframe, Request, Row, Shrink, complete, schedule)
from hx.workload import (CACHE_BUCKET, Workload, new_tokens, powers_of_two, round_up,
                         step_chunk)

if TYPE_CHECKING:
    from hx.generate import Engine  # which runs its batches with ``BlockRunner``

JOIN_CHUNK = 64  # tokens per prefill step of a joining prompt, unless the plan sets a chunk


@functools.partial(jax.jit, donate_argnums=0)
def _reframe_array(cache: jax.Array, slots: jax.Array) -> jax.Array:
    """``cache`` (B, S, K, E) reframed by ``slots``: rolled along S (positive: towards the
    end)."""
    return jnp.roll(cache, slots, axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def _insert(cache: jax.Array, joined: jax.Array, source: jax.Array, row: jax.Array,
            slots: jax.Array) -> jax.Array:
    """``cache`` (B, S, K, E) with row ``row`` replaced by row ``source`` of ``joined``
    (G, S, K, E) reframed by ``slots`` (rolled along S)."""
    return cache.at[row].set(jnp.roll(joined[source], slots, axis=0))


@jax.jit
def _take(cache: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` of ``cache`` (B, S, K, E)."""
    return cache[rows]


def run_slots(lengths: Sequence[int], max_new_tokens: Sequence[int], spec: ModelSpec,
              chunk: int) -> int:
    """KV-cache slots S of a run: room for every prompt's tokens and its new tokens (capped
    by the context), and for its prefill padded to a multiple of ``chunk``, rounded up to
    ``CACHE_BUCKET``."""
    need = max(max(L + new_tokens(L, n, spec), round_up(L, chunk))
               for L, n in zip(lengths, max_new_tokens))
    return round_up(need, CACHE_BUCKET)


class ContinuousBatcher:
    """Generates many prompts with iteration-level scheduling over N micro-batches of B rows.

    Args:
      engine: the ``Engine`` (model, plan, executor) to run.
      micro_batch: B, rows per micro-batch.
      micro_batches: N, micro-batches in the block.
      join_chunk: tokens per prefill step of joining prompts (default: the plan's prefill
        chunk, else ``JOIN_CHUNK``).
      join_min: free rows a join waits for while other rows decode (default 1: at once).
      join_max: most prompts prefilled together (default B).
    Raises:
      HxError: B or N below 1, ``join_max`` outside 1..B, or ``join_min`` outside 1..B·N.
    """

    def __init__(self, engine: Engine, micro_batch: int, micro_batches: int = 1,
                 join_chunk: int | None = None, join_min: int = 1,
                 join_max: int | None = None):
        if micro_batch < 1 or micro_batches < 1:
            raise HxError(f"a block needs at least one micro-batch of one row, got "
                          f"{micro_batches} x {micro_batch}")
        join_max = join_max or micro_batch
        if not 1 <= join_max <= micro_batch:
            raise HxError(f"join_max must be from 1 to the {micro_batch} rows of a "
                          f"micro-batch, got {join_max}")
        if not 1 <= join_min <= micro_batch * micro_batches:
            raise HxError(f"join_min must be from 1 to the block's {micro_batch * micro_batches} "
                          f"rows, got {join_min}")
        self.engine, self.B, self.N = engine, micro_batch, micro_batches
        self.join_min, self.join_max = join_min, join_max
        self.chunk = step_chunk(join_chunk or engine.plan.prefill_chunk or JOIN_CHUNK,
                                step_limit(engine.model.spec))

    @classmethod
    def for_block(cls, engine: Engine, block: Workload, join_min: int = 1
                  ) -> "ContinuousBatcher":
        """The batcher of a block workload (``planner.throughput.choose_block``'s): its B, N,
        join chunk (``prompt_tokens``) and largest join group (``spare_rows``; B if none)."""
        return cls(engine, block.batch, block.micro_batches, block.prompt_tokens, join_min,
                   block.spare_rows or None)

    def workload(self, cache_slots: int) -> Workload:
        """Shapes of a run: (B, join chunk, S, N) with ``join_max`` spare rows (a joining
        group's prefill cache)."""
        return Workload(self.B, self.chunk, cache_slots, self.N, spare_rows=self.join_max)

    def config(self, cache_slots: int) -> BlockConfig:
        """The scheduler's view of a run with S = ``cache_slots``: joins padded to and
        prefilled in chunks of the join chunk."""
        return BlockConfig(self.B, self.N, cache_slots, self.chunk, self.chunk, self.join_min,
                           self.join_max)

    def compile(self, workload: Workload, sampling: SamplingParams) -> float:
        """Compile decode at every power of two of rows up to B (a micro-batch shrinks to
        them once no prompt waits), prefill at every one up to ``join_max`` (join groups),
        and the samplers; returns the seconds it took."""
        ex, start = self.engine.executor, time.perf_counter()
        B, S = workload.batch, workload.cache_slots
        sizes, groups = powers_of_two(B), powers_of_two(self.join_max)
        self.engine.status(f"compiling decode at {sizes} rows and prefill chunks of "
                           f"{self.chunk} tokens at {groups} rows, {S} KV slots")
        for g in sizes:
            ex.compile("decode", g, 1, S)
        for g in groups:
            ex.compile("prefill", g, self.chunk, S)
        head = ex.devices[self.engine.plan.phase("decode").head]
        for rows in {B, *sizes}:
            zeros = jax.device_put(np.zeros((rows, self.engine.model.spec.vocab_size),
                                            np.float32), head)
            sample(zeros, sampling, 0, [0] * rows).block_until_ready()
        release_free_heap()
        return time.perf_counter() - start

    def run(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(),
            seeds: Sequence[int] | None = None,
            on_finish: Callable[[int, Completion], None] | None = None,
            cache_slots: int | None = None,
            max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        """Answer every prompt; each leaves its row the step it ends and the next waiting
        prompt (in the given order) takes the row.

        Args:
          prompts: token ids of each prompt.
          sampling: sampling and stopping rules (one for all).
          seeds: a sampling seed per prompt (default ``sampling.seed``); a prompt draws the
            same tokens as it would alone.
          on_finish: called with (prompt index, its ``Completion``) the moment it ends.
          cache_slots: KV-cache slots S (default ``run_slots`` of these prompts); a batch run
            passes one value for all its runs so each shape compiles once.
          max_new_tokens: a token limit per prompt (default: ``sampling``'s for all).
        Returns:
          one ``Completion`` per prompt, in order. ``ttft_s`` counts from the start of the
          prompt's own prefill.
        Raises:
          HxError: an empty prompt or one longer than the context, or a plan that does not
            fit the memory budget at this run's shapes.
        """
        spec = self.engine.model.spec
        if len(self.engine.stints) > 1:
            raise HxError("an engine whose plans follow the context (stints) runs static "
                          "batches (Engine.generate): iteration-level batching mixes rows at "
                          "different contexts")
        if not prompts:
            return []
        lengths = [len(p) for p in prompts]
        check_prompts(lengths, spec)
        asked = list(max_new_tokens or [sampling.max_new_tokens] * len(prompts))
        limits = [new_tokens(L, n, spec) for L, n in zip(lengths, asked)]
        least = run_slots(lengths, limits, spec, self.chunk)
        if cache_slots is not None and cache_slots < least:
            raise HxError(f"KV cache of {cache_slots} slots is too small for these prompts "
                          f"and their new tokens ({least} needed)")
        workload = self.workload(cache_slots or least)
        self.engine.check(workload)
        compile_s = self.compile(workload, sampling)
        runner = BlockRunner(self.engine, self.config(workload.cache_slots), sampling,
                             compile_s, on_finish)
        return runner.run(prompts, limits, asked, seeds)


class StepInputs(NamedTuple):
    """A micro-batch's decode step inputs: ``tokens`` (B, 1) int32, each row's last token; the
    ``step``; ``drawn`` and ``seeds``, each row's tokens drawn so far and its sampling seed (a
    free row: 0 each)."""

    tokens: np.ndarray
    step: Step
    drawn: list[int]
    seeds: list[int]


class BlockRunner:
    """Carries out ``hx.scheduler.schedule``'s decisions for one run on an engine's executor:
    it holds each micro-batch's KV caches, runs prefill and decode steps, samples, and turns
    each row that ends into its ``Completion``.

    Args:
      engine: the ``Engine`` to run on (checked and compiled for ``config``'s shapes).
      config: the block and its policy (``refill``: iteration-level; else a static batch).
      sampling: sampling rules (one for all rows; a row's seed is its own).
      compile_s: seconds spent compiling, reported in each ``Completion``.
      on_finish: called with (prompt index, its ``Completion``) the moment a row ends.
    """

    def __init__(self, engine: Engine, config: BlockConfig, sampling: SamplingParams,
                 compile_s: float = 0.0,
                 on_finish: Callable[[int, Completion], None] | None = None):
        self.engine, self.config, self.sampling = engine, config, sampling
        self.compile_s, self.on_finish = compile_s, on_finish
        self.prompts: Sequence[Sequence[int]] = []
        self.stop = np.zeros(0, bool)  # (V,) the run's stop tokens (``run`` sets it)
        self.caches: list[list[Cache]] = []  # per micro-batch, per layer
        self.results: list[Completion | None] = []
        self._shown = ""

    def run(self, prompts: Sequence[Sequence[int]], limits: Sequence[int],
            asked: Sequence[int], seeds: Sequence[int] | None = None) -> list[Completion]:
        """Answer ``prompts`` (token ids), each with its token limit (``limits``: capped by
        the context; ``asked``: as asked) and sampling seed (default: the sampling's);
        returns their completions in order. The stop tokens are EOS and the sampling's
        ``stop_ids``."""
        eos = self.engine.model.tokenizer.eos_id
        stop = frozenset(self.sampling.stop_ids) | frozenset([] if eos is None else [eos])
        if seeds is None:
            seeds = [self.sampling.seed] * len(prompts)
        self.stop = np.zeros(self.engine.executor.spec.vocab_size, bool)  # for decode loops
        self.stop[[t for t in stop if 0 <= t < len(self.stop)]] = True
        requests = [Request(i, len(p), n, a, stop, s)
                    for i, (p, n, a, s) in enumerate(zip(prompts, limits, asked, seeds))]
        state = BatchState.start(self.config, requests)
        ex, B, S = self.engine.executor, self.config.rows, self.config.cache_slots
        self.prompts, self.results = prompts, [None] * len(prompts)
        self.caches = [ex.new_cache(B, S, micro=m) for m in range(self.config.micro_batches)]
        try:
            while (decision := schedule(state)) is not None:
                state = (self._join(state, decision) if isinstance(decision, Join)
                         else self._decode(state, decision))
        finally:
            self.engine.executor.release_cache()  # the run may have switched executors
        return self.results

    def _join(self, state: BatchState, join: Join) -> BatchState:
        """Prefill ``join``'s prompts, sample their first tokens and put each in its row."""
        ex, engine = self.engine.executor, self.engine
        started = time.perf_counter()
        G, T, m = len(join.requests), join.padded, join.places[0][0]
        tokens, step = left_pad([self.prompts[q.index] for q in join.requests], T,
                                engine.model.tokenizer.eos_id or 0)
        caches = (self.caches[m] if join.in_place
                  else ex.new_cache(G, self.config.cache_slots, micro="join"))
        try:
            logits, caches = prefill_in_chunks(
                ex, tokens, step, caches, join.chunks,
                lambda i, n: engine.status(f"prefill of {G} prompt(s) x {T} tokens, "
                                           f"chunk {i}/{n}"))
            first = np.asarray(sample(logits, self.sampling, 0, [q.seed for q in join.requests]))
            after, ended = state.joined(join, first.tolist(), started, time.perf_counter())
            if join.in_place:
                self.caches[m] = caches
            else:
                self._place(state, after, join, caches)
        finally:
            if not join.in_place:
                ex.release_cache("join")
        self._finish(ended)
        return after

    def _place(self, before: BatchState, after: BatchState, join: Join,
               joined: list[Cache]) -> None:
        """Reframe the micro-batches receiving ``join``'s prompts, then copy row j of the
        ``joined`` caches into each prompt's row, reframed so its last token sits just before
        the frontier."""
        for reframe in join.reframes:
            self._reframe(before.micro_batches[reframe.micro_batch], reframe)
        for j, (m, r) in enumerate(join.places):
            slots = np.int32(after.micro_batches[m].frontier - join.padded)
            self.caches[m] = [{name: _insert(cache[name], part[name], np.int32(j), np.int32(r),
                                             slots) for name in cache}
                              for cache, part in zip(self.caches[m], joined)]

    def _decode(self, state: BatchState, decode: Decode) -> BatchState:
        """Carry out ``decode``'s shrinks and reframes, then step each of its blocks."""
        self._show(state)
        for shrink in decode.shrinks:
            self._shrink(state.micro_batches[shrink.micro_batch], shrink)
            state = state.shrunk(shrink)
        for reframe in decode.reframes:
            self._reframe(state.micro_batches[reframe.micro_batch], reframe)
            state = state.reframed(reframe)
        if len(self.engine.stints) > 1:  # plans that follow the context (a static batch)
            self.caches = self.engine.follow(state.micro_batches[0].frontier - self.config.pad,
                                             self.caches)
        for block in decode.blocks:
            state = self._step(state, block)
        return state

    def _step(self, state: BatchState, block: tuple[int, ...]) -> BatchState:
        """One decode step of micro-batches ``block`` (equal rows) as a block; samples and
        records each live row's token. A static batch whose plan loops runs several steps
        (``_loop_steps``, ``_steps``)."""
        if len(block) == 1 and (n := self._loop_steps(state.micro_batches[block[0]])) > 1:
            return self._steps(state, block[0], n)
        inputs = [self._inputs(state.micro_batches[m]) for m in block]
        logits, caches = self.engine.executor.run_block(
            "decode", [i.tokens for i in inputs], [i.step for i in inputs],
            [self.caches[m] for m in block])
        for m, i, out, cache in zip(block, inputs, logits, caches):
            self.caches[m] = cache
            new = np.asarray(sample(out, self.sampling, i.drawn, i.seeds))
            state, ended = state.decoded(m, new.tolist(), time.perf_counter())
            self._finish(ended)
        return state

    def _inputs(self, mb: MicroBatch) -> StepInputs:
        """What a decode step of ``mb`` takes (``StepInputs``)."""
        S = self.config.cache_slots
        return StepInputs(
            tokens=np.array([[0 if row is None else row.last] for row in mb.rows], np.int32),
            step=Step(np.array(mb.positions(S), np.int32)[:, None], np.int32(mb.frontier),
                      np.array(mb.kv_starts(S), np.int32)),
            drawn=[0 if row is None else row.drawn for row in mb.rows],
            seeds=[0 if row is None else row.request.seed for row in mb.rows])

    def _loop_steps(self, mb: MicroBatch) -> int:
        """Decode steps the next launch of ``mb`` runs: 1, but for a static batch (one plan)
        whose decode loops (``Executor.loops``) up to ``Engine.loop_steps``, no more than
        its live rows may still draw or its cache has slots for."""
        engine, S = self.engine, self.config.cache_slots
        if (self.config.refill or engine.loop_steps <= 1 or len(engine.stints) > 1
                or not engine.executor.loops(len(mb.rows), S)):
            return 1
        left = max(mb.rows[r].request.limit - mb.rows[r].drawn for r in mb.live)
        return min(engine.loop_steps, left, S - mb.frontier)

    def _steps(self, state: BatchState, m: int, n: int) -> BatchState:
        """Up to ``n`` decode steps of micro-batch ``m`` in one launch, sampled where they
        run (``Executor.decode_steps``; it stops once every live row has ended); each step's
        tokens go to the state as ``_step``'s would, all at the launch's end time."""
        mb, sampling = state.micro_batches[m], self.sampling
        live, i = set(mb.live), self._inputs(mb)
        rows = {"n": np.int32(n), "drawn": np.array(i.drawn, np.uint32),
                "seeds": np.array(i.seeds, np.uint32),
                "remaining": np.array([row.request.limit - row.drawn if r in live else 0
                                       for r, row in enumerate(mb.rows)], np.int32),
                "temperature": np.float32(sampling.temperature),
                "top_p": np.float32(sampling.top_p)}
        new, self.caches[m] = self.engine.executor.decode_steps(
            i.tokens, i.step, self.caches[m], self.engine.loop_steps, Sampler.of(sampling), rows,
            self.stop)
        now = time.perf_counter()
        for drawn in new.T:
            state, ended = state.decoded(m, drawn.tolist(), now)
            self._finish(ended)
        return state

    def _finish(self, ended: list[Row]) -> None:
        """Build each ended row's ``Completion`` and hand it to ``on_finish``."""
        for row in ended:
            result = complete(row, self.engine.model.tokenizer.decode, self.compile_s)
            self.results[row.request.index] = result
            if self.on_finish is not None:
                self.on_finish(row.request.index, result)

    def _show(self, state: BatchState) -> None:
        """Report the rows decoding and the prompts waiting when they change."""
        line = (f"decoding {sum(len(mb.live) for mb in state.micro_batches)} rows, "
                f"{len(state.waiting)} prompts waiting")
        if line != self._shown:
            self.engine.status(line)
            self._shown = line

    def _shrink(self, mb: MicroBatch, shrink: Shrink) -> None:
        """Gather rows ``shrink.keep`` of a micro-batch's caches: once no prompt waits, steps
        stop computing rows that have ended."""
        m, index = shrink.micro_batch, jnp.asarray(shrink.keep, jnp.int32)
        # layer by layer, each old cache dropped as its copy is made: beside the caches, at most
        # a K and a V array of ``rows`` <= B/2 rows, one (B, S, K, E) array's bytes
        with self._cache_temporary(len(mb.rows)):
            for layer, cache in enumerate(self.caches[m]):
                self.caches[m][layer] = {name: _take(c, index) for name, c in cache.items()}
        self.engine.executor.account_cache(self.caches[m], m)

    def _reframe(self, mb: MicroBatch, reframe: Reframe) -> None:
        """Reframe a micro-batch's caches by ``reframe.slots`` (``_reframe_array``); with no row in
        it, nothing reads them and only its frontier moves (in the state)."""
        if all(row is None for row in mb.rows):
            return
        m, slots = reframe.micro_batch, np.int32(reframe.slots)
        with self._cache_temporary(len(mb.rows)):
            self.caches[m] = [{name: _reframe_array(c, slots) for name, c in cache.items()}
                              for cache in self.caches[m]]

    @contextlib.contextmanager
    def _cache_temporary(self, rows: int) -> Iterator[None]:
        """Account, while the body rewrites a micro-batch's caches one array at a time, the
        accelerator bytes of one of its (rows, S, K, E) arrays (``memory.reframe_bytes``;
        none when every KV cache is on the host)."""
        engine = self.engine
        temp = reframe_bytes(engine.model.spec,
                             Workload(rows, self.config.pad, self.config.cache_slots))
        engine.accountant.allocate("activations", ("reframe",),
                                   temp if ACCELERATOR in engine.plan.kv else 0)
        try:
            yield
        finally:
            engine.accountant.free(("reframe",))
