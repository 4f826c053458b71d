"""Iteration-level scheduling of many prompts over a block of micro-batches.

Orca (Yu et al., OSDI 2022) schedules per iteration instead of per batch: a sequence leaves the
batch the step it ends and a waiting prompt takes its place at the next iteration, so short
answers do not wait for long ones and no step computes rows that are done. ``ContinuousBatcher``
does this over a block of N micro-batches of B rows (the zig-zag block schedule of
``Executor.run_block``: each streamed layer serves all N·B rows once per step).

Every step of the executor writes one cache slot shared by a micro-batch's rows (its
``frontier``: ``Step.write_index``); rows differ in where they start (``Step.kv_start``). A
prompt of L tokens joins a free row by

1. a prefill of its own, in chunks of ``join_chunk`` tokens, into a spare cache -- between
   two decode iterations. Waiting prompts of one padded length (a multiple of the chunk)
   share a prefill, a power of two of them at a time, at most ``join_max`` (one compiled
   shape per power of two up to it, and no idle rows; ``join_max`` bounds the prefill's
   activations and spare cache rows, so a block of many rows need not prefill as many at
   once). While rows decode, a join may wait until ``join_min`` rows are
   free (or every waiting prompt has one): where weights are streamed a prefill costs a pass
   over them whatever its rows, so prompts joining one at a time would stream the weights
   once each (``planner.throughput`` picks ``join_min``);
2. copying its cache row into the micro-batch, shifted so that its last prompt token sits just
   before the frontier (its first L slots before it; ``kv_start`` = frontier - L). A frontier
   smaller than L first shifts the micro-batch's caches right.

When a micro-batch's frontier reaches the last slot, its caches are shifted left by the
smallest ``kv_start`` of its rows (slots no row attends to any more). A row's RoPE positions
count from its own first token, so shifts change no result: each row computes what it would
alone, up to float rounding of the batched products. A cache of S slots >= L + max_new_tokens
of every prompt always leaves room (the row that starts at slot 0 has then finished).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hx.devices import ACCELERATOR
from hx.errors import HxError
from hx.generate import Completion, Engine, check_prompts, run_prefill
from hx.memory import reframe_bytes
from hx.models.llama import Cache, Step
from hx.models.spec import ModelSpec
from hx.sampling import SamplingParams, sample
from hx.workload import CACHE_BUCKET, Workload, new_tokens, round_up

JOIN_CHUNK = 64  # tokens per prefill step of a joining prompt, unless the plan sets a chunk


@functools.partial(jax.jit, donate_argnums=0)
def _shift(cache: jax.Array, slots: jax.Array) -> jax.Array:
    """``cache`` (B, S, K, E) rolled by ``slots`` along S (positive: towards the end)."""
    return jnp.roll(cache, slots, axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def _insert(cache: jax.Array, joined: jax.Array, source: jax.Array, row: jax.Array,
            slots: jax.Array) -> jax.Array:
    """``cache`` (B, S, K, E) with row ``row`` replaced by row ``source`` of ``joined``
    (G, S, K, E) rolled by ``slots`` along S."""
    return cache.at[row].set(jnp.roll(joined[source], slots, axis=0))


@jax.jit
def _take(cache: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` of ``cache`` (B, S, K, E)."""
    return cache[rows]


@dataclass
class _Row:
    """A prompt being answered in one row of a micro-batch."""

    prompt: int  # index into the prompts
    max_new: int
    started: float  # its prefill began (seconds, perf_counter)
    tokens: list[int] = field(default_factory=list)
    sampled: int = 0  # tokens drawn so far: the PRNG step of the next
    first: float = 0.0
    end: float = 0.0
    stopped: bool = False


@dataclass
class _MicroBatch:
    """B rows sharing one frontier (the cache slot the next decode step writes)."""

    name: int
    caches: list[Cache]
    kv_start: np.ndarray  # (B,) int32; an empty row starts past the end (attends nothing)
    frontier: int
    rows: list[_Row | None]
    last: np.ndarray  # (B,) int32 token each row feeds next

    @property
    def active(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None]


def run_slots(lengths: Sequence[int], max_new_tokens: Sequence[int], spec: ModelSpec,
              chunk: int) -> int:
    """KV-cache slots S of a run: room for every prompt's tokens and its new tokens (capped
    by the context), and for its prefill padded to a multiple of ``chunk``, rounded up to
    ``CACHE_BUCKET``."""
    need = max(max(L + new_tokens(L, n, spec), round_up(L, chunk))
               for L, n in zip(lengths, max_new_tokens))
    return round_up(need, CACHE_BUCKET)


def _group_sizes(rows: int) -> list[int]:
    """Row counts a joining group is prefilled at: the powers of two up to ``rows``."""
    return [1 << k for k in range(rows.bit_length()) if 1 << k <= rows]


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
        self.chunk = join_chunk or engine.plan.prefill_chunk or JOIN_CHUNK

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

    def compile(self, workload: Workload, sampling: SamplingParams) -> float:
        """Compile decode at every power of two of rows up to B (a micro-batch shrinks to
        them once no prompt waits), prefill at every one up to ``join_max`` (join groups),
        and the samplers; returns the seconds it took."""
        ex, start = self.engine.executor, time.perf_counter()
        B, S = workload.batch, workload.cache_slots
        sizes, groups = _group_sizes(B), _group_sizes(self.join_max)
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
        engine, ex, spec = self.engine, self.engine.executor, self.engine.model.spec
        if not prompts:
            return []
        lengths = [len(p) for p in prompts]
        check_prompts(lengths, spec)
        asked = list(max_new_tokens or [sampling.max_new_tokens] * len(prompts))
        max_new = [new_tokens(L, n, spec) for L, n in zip(lengths, asked)]
        least = run_slots(lengths, max_new, spec, self.chunk)
        if cache_slots is not None and cache_slots < least:
            raise HxError(f"KV cache of {cache_slots} slots is too small for these prompts "
                          f"and their new tokens ({least} needed)")
        workload = self.workload(cache_slots or least)
        engine.check(workload)
        compile_s = self.compile(workload, sampling)
        tok = engine.model.tokenizer
        stop = set(sampling.stop_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        seeds = list(seeds) if seeds is not None else [sampling.seed] * len(prompts)
        results: list[Completion | None] = [None] * len(prompts)
        B, S = self.B, workload.cache_slots

        def finish(row: _Row) -> None:
            after_first = len(row.tokens) - 1 + (1 if row.stopped else 0)
            elapsed = row.end - row.first
            results[row.prompt] = Completion(
                prompt_tokens=lengths[row.prompt], token_ids=row.tokens,
                text=tok.decode(row.tokens),
                finish_reason=("stop" if row.stopped else "context"
                               if row.max_new < asked[row.prompt] else "length"),
                ttft_s=row.first - row.started,
                decode_tok_s=after_first / elapsed if after_first > 0 and elapsed > 0 else None,
                compile_s=compile_s)
            if on_finish is not None:
                on_finish(row.prompt, results[row.prompt])

        def record(mb: _MicroBatch, r: int, token: int, now: float) -> None:
            """A row's new token; frees the row when it ends."""
            row = mb.rows[r]
            row.sampled += 1
            row.end = now
            if token in stop:
                row.stopped = True
            else:
                row.tokens.append(token)
            mb.last[r] = token
            if row.stopped or row.sampled >= row.max_new:
                mb.rows[r] = None
                mb.kv_start[r] = S
                finish(row)

        queue = list(range(len(prompts)))
        shown = ""
        blocks = [_MicroBatch(m, ex.new_cache(B, S, micro=m), np.full(B, S, np.int32), 0,
                              [None] * B, np.zeros(B, np.int32)) for m in range(self.N)]
        try:
            while queue or any(mb.active for mb in blocks):
                while queue:  # fill free rows (a prompt may end at its first token)
                    free = [(mb, r) for mb in blocks for r in range(len(mb.rows))
                            if mb.rows[r] is None]
                    decoding = any(mb.active for mb in blocks)
                    if not free or decoding and len(free) < min(self.join_min, len(queue)):
                        break  # wait for join_min free rows
                    group = self._next_group(queue, prompts, min(self.join_max, len(free)))
                    self._join(group, free[:len(group)], prompts, max_new, sampling, seeds, S,
                               record)
                running = [mb for mb in blocks if mb.active]
                if not running:
                    continue
                line = (f"decoding {sum(len(mb.active) for mb in running)} rows, "
                        f"{len(queue)} prompts waiting")
                if line != shown:
                    engine.status(line)
                    shown = line
                for mb in running:
                    rows = 1 << (len(mb.active) - 1).bit_length()
                    if not queue and rows < len(mb.rows):  # no prompt will fill empty rows
                        self._shrink(mb, rows)
                    if mb.frontier == S:  # the last slot is written: drop what no row reads
                        unread = int(mb.kv_start[mb.active].min())
                        if unread == 0:  # a row would have outlived the cache: a bug
                            raise RuntimeError(f"no free slot in a {S}-slot KV cache")
                        self._reframe(mb, -unread)
                shapes: dict[int, list[_MicroBatch]] = {}  # a block step per row count
                for mb in running:
                    shapes.setdefault(len(mb.rows), []).append(mb)
                for group in shapes.values():
                    self._decode(group, S, sampling, seeds, record)
        finally:
            ex.release_cache()
        return results

    def _decode(self, group: list[_MicroBatch], S: int, sampling: SamplingParams,
                seeds: list[int], record: Callable) -> None:
        """One decode step of micro-batches of equal rows, as a block; records each row's
        token."""
        steps = []
        for mb in group:
            positions = np.where(mb.kv_start < S, mb.frontier - mb.kv_start, 0)
            steps.append(Step(positions[:, None].astype(np.int32), np.int32(mb.frontier),
                              mb.kv_start.copy()))
        logits, caches = self.engine.executor.run_block(
            "decode", [mb.last[:, None] for mb in group], steps, [mb.caches for mb in group])
        for mb, out, cache in zip(group, logits, caches):
            mb.caches, mb.frontier = cache, mb.frontier + 1
            rows = [mb.rows[r] for r in range(len(mb.rows))]
            new = np.asarray(sample(out, sampling, [row.sampled if row else 0 for row in rows],
                                    [seeds[row.prompt] if row else 0 for row in rows]))
            now = time.perf_counter()
            for r in mb.active:
                record(mb, r, int(new[r]), now)

    def _shrink(self, mb: _MicroBatch, rows: int) -> None:
        """Keep ``rows`` rows of micro-batch ``mb`` (its rows in use first): once no prompt
        waits, steps stop computing rows that have ended."""
        ex = self.engine.executor
        keep = mb.active
        keep += [r for r in range(len(mb.rows)) if r not in keep][:rows - len(keep)]
        index = jnp.asarray(keep, jnp.int32)
        # layer by layer, each old cache dropped as its copy is made: beside the caches, at most
        # a K and a V array of ``rows`` <= B/2 rows, one (B, S, K, E) array's bytes
        with self._cache_temporary(mb):
            for layer, cache in enumerate(mb.caches):
                mb.caches[layer] = {name: _take(c, index) for name, c in cache.items()}
        ex.account_cache(mb.caches, mb.name)
        mb.rows = [mb.rows[r] for r in keep]
        mb.kv_start, mb.last = mb.kv_start[keep], mb.last[keep]

    def _next_group(self, queue: list[int], prompts: Sequence[Sequence[int]], most: int
                    ) -> list[int]:
        """Take from ``queue`` the next prompts to prefill together: the first waiting prompt
        and others of the same padded length (a multiple of the chunk: no prompt pads more
        than a chunk), as many as the largest power of two <= ``most`` allows (one compiled
        shape per power of two, no idle rows)."""
        padded = lambda p: round_up(len(prompts[p]), self.chunk)  # noqa: E731
        same = [p for p in queue if padded(p) == padded(queue[0])][:most]
        group = same[:1 << (len(same).bit_length() - 1)]
        chosen = set(group)
        queue[:] = [p for p in queue if p not in chosen]
        return group

    def _join(self, group: list[int], places: list[tuple[_MicroBatch, int]],
              prompts: Sequence[Sequence[int]], max_new: list[int], sampling: SamplingParams,
              seeds: list[int], S: int, record: Callable) -> None:
        """Prefill ``group`` (prompts of one padded length, a power of two of them) together
        and move each into its place."""
        engine, ex = self.engine, self.engine.executor
        started = time.perf_counter()
        G = len(group)
        T = round_up(len(prompts[group[0]]), self.chunk)
        tokens = np.full((G, T), engine.model.tokenizer.eos_id or 0, np.int32)
        kv_start = np.zeros(G, np.int32)
        for j, p in enumerate(group):
            tokens[j, T - len(prompts[p]):] = prompts[p]
            kv_start[j] = T - len(prompts[p])
        positions = np.maximum(np.arange(T, dtype=np.int32)[None, :] - kv_start[:, None], 0)
        joined = ex.new_cache(G, S, micro="join")
        try:
            logits, joined = run_prefill(
                ex, tokens, Step(positions, np.int32(0), kv_start), joined, self.chunk,
                lambda i, n: engine.status(f"prefill of {len(group)} joining prompt(s), "
                                            f"chunk {i}/{n}"))
            first = np.asarray(sample(logits, sampling, 0, [seeds[p] for p in group]))
            now = time.perf_counter()
            for mb in {id(mb): mb for mb, _ in places}.values():  # one shift per micro-batch
                need = max(len(prompts[p]) for p, (m, _) in zip(group, places) if m is mb)
                if mb.frontier < need:
                    self._reframe(mb, need - mb.frontier)
            for j, (p, (mb, r)) in enumerate(zip(group, places)):
                L = len(prompts[p])
                shift = np.int32(mb.frontier - T)
                mb.caches = [{name: _insert(cache[name], part[name], np.int32(j), np.int32(r),
                                            shift) for name in cache}
                             for cache, part in zip(mb.caches, joined)]
                mb.kv_start[r] = mb.frontier - L
                mb.rows[r] = _Row(p, max_new[p], started, first=now)
                record(mb, r, int(first[j]), now)
        finally:
            ex.release_cache("join")

    @contextlib.contextmanager
    def _cache_temporary(self, mb: _MicroBatch) -> Iterator[None]:
        """Account, while the body rewrites ``mb``'s caches one array at a time, the
        accelerator bytes of one of its (B, S, K, E) arrays (``memory.reframe_bytes``; none
        when every KV cache is on the host)."""
        acct = self.engine.accountant
        temp = reframe_bytes(self.engine.model.spec, Workload(
            len(mb.rows), self.chunk, mb.caches[0]["k"].shape[1]))
        acct.allocate("activations", ("reframe",),
                      temp if ACCELERATOR in self.engine.plan.kv else 0)
        try:
            yield
        finally:
            acct.free(("reframe",))

    def _reframe(self, mb: _MicroBatch, slots: int) -> None:
        """Shift micro-batch ``mb``'s caches by ``slots`` (negative: towards slot 0); with no
        row in use only its frontier moves (no row reads the caches)."""
        if not mb.active:
            mb.frontier += slots
            return
        shift = np.int32(slots)
        with self._cache_temporary(mb):
            mb.caches = [{name: _shift(c, shift) for name, c in cache.items()}
                         for cache in mb.caches]
        active = mb.active
        mb.kv_start[active] += slots
        mb.frontier += slots
