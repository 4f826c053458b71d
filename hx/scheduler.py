"""Request scheduling as data: the state of a block of rows, the decisions of its next step, and
the pure function from one to the other.

vLLM v1 splits serving into ``Scheduler.schedule() -> SchedulerOutput`` (which requests run and
which of their tokens) and a model runner that carries that output out. hx does the same in its
own terms: ``schedule(state)`` reads a ``BatchState`` -- the prompts waiting, N micro-batches of B
rows with each row's request and cache slots, each micro-batch's frontier -- and returns the next
step, one of

* ``Join``: prefill a group of waiting prompts (which tokens, in which chunks) and place them in
  free rows, after reframing the micro-batches that receive them;
* ``Decode``: one decode step of every micro-batch with a live row, after shrinking or
  reframing some of them;
* None: every prompt has finished.

The runner (``hx.continuous.BlockRunner``) carries a decision out on the executor and folds its
outcome back into the state (``BatchState.joined``, ``shrunk``, ``reframed``, ``decoded``);
``complete`` builds a finished row's ``Completion``. Nothing here touches an array, so the
decisions are unit-tested without JAX (tests/test_scheduler.py).

Every row of a micro-batch writes the same cache slot per decode step, the micro-batch's
*frontier*; rows differ in the slot their prompt starts at (``kv_start``). To **reframe** a
micro-batch by k slots is to roll its KV caches by k along the slot axis (k > 0: towards the
end) and move its frontier and every row's ``kv_start`` by k. RoPE positions count from each
row's own first token, so a reframe changes no result.

Two policies share ``schedule`` (``BlockConfig.refill``):

* **Iteration-level scheduling** (Orca, Yu et al., OSDI 2022; throughput mode). A row leaves
  the step it ends and waiting prompts take free rows before the next decode step. A join
  takes the first waiting prompt and the others of its padded length (a multiple of
  ``pad``, the join chunk, so no prompt pads more than a chunk), a power of two of them (one
  compiled prefill shape per power of two), at most ``join_max`` and the free rows. While rows
  decode, a join waits until ``join_min`` rows are free (or every waiting prompt has one): with
  streamed weights a prefill costs a pass over them whatever its rows. A joining prompt of L
  tokens is prefilled into a spare cache and copied into its row so that its last token sits
  just before the frontier (``kv_start`` = frontier - L); a frontier below L first reframes
  the micro-batch right. When a frontier reaches the last of S slots, the micro-batch is
  reframed left by its smallest ``kv_start`` (slots no row reads any more). Once no prompt
  waits, a micro-batch shrinks to the power of two of rows >= its live rows, so no step
  computes a row that has ended. A cache of S >= L + max_new_tokens slots for every prompt
  always leaves room: the row that starts at slot 0 has then finished.
* **A static batch** (latency mode, ``--batch-size``): every prompt joins at once, left-padded
  to one length (``pad``) and prefilled straight into the micro-batch's cache; a row that ends
  idles (still computed, its tokens dropped) until the last one ends; no shrink, no reframe but
  the join's frontier move.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from hx.workload import prefill_chunks, round_up

STOP, LENGTH, CONTEXT = "stop", "length", "context"  # a Completion's finish reasons


@dataclass(frozen=True)
class Request:
    """One prompt to answer.

    Attributes:
      index: its position in the caller's prompts (results come back in that order).
      length: prompt tokens L.
      limit: new tokens it may draw: its ``max_new_tokens`` capped so that the context holds
        them (a static batch: capped by the batch's longest prompt).
      asked: the ``max_new_tokens`` asked for; ``limit < asked`` means the context cut it.
      stop: token ids that end it (EOS and the sampling's stop ids; the stop token is dropped).
      seed: its sampling seed: its n-th token is drawn with the PRNG key (seed, n).
    """

    index: int
    length: int
    limit: int
    asked: int
    stop: frozenset[int] = frozenset()
    seed: int = 0


@dataclass(frozen=True)
class Row:
    """A request in a row of a micro-batch.

    Attributes:
      request: the prompt it answers.
      kv_start: cache slot of its first prompt token.
      started: when its prefill began (seconds, ``time.perf_counter``).
      tokens: the tokens it keeps (a stop token is not kept).
      drawn: tokens drawn so far: the PRNG step of the next.
      last: the token it feeds to the next decode step.
      first: when its first token was drawn (seconds).
      end: when its latest token was drawn (seconds).
      reason: why it ended (``STOP``, ``LENGTH``, ``CONTEXT``); None while it runs. Only a
        static batch keeps an ended row in place (idle).
    """

    request: Request
    kv_start: int
    started: float
    tokens: tuple[int, ...] = ()
    drawn: int = 0
    last: int = 0
    first: float = 0.0
    end: float = 0.0
    reason: str | None = None

    def drew(self, token: int, now: float) -> "Row":
        """This row after drawing ``token`` at ``now``: a stop token ends it (and is dropped);
        otherwise the token is kept and the row ends at its limit."""
        drawn, request = self.drawn + 1, self.request
        stopped = token in request.stop
        reason = (STOP if stopped else None if drawn < request.limit
                  else CONTEXT if request.limit < request.asked else LENGTH)
        return Row(request, self.kv_start, self.started,
                   self.tokens if stopped else self.tokens + (token,), drawn, token,
                   now if self.drawn == 0 else self.first, now, reason)


@dataclass(frozen=True)
class MicroBatch:
    """B rows sharing one frontier (the cache slot the next decode step writes).

    Attributes:
      frontier: that slot.
      rows: each row's ``Row``, None where it is free.
    """

    frontier: int
    rows: tuple[Row | None, ...]

    @property
    def live(self) -> tuple[int, ...]:
        """Rows still generating."""
        return tuple(r for r, row in enumerate(self.rows) if row is not None and row.reason is None)

    @property
    def free(self) -> tuple[int, ...]:
        """Rows a prompt may join."""
        return tuple(r for r, row in enumerate(self.rows) if row is None)

    def kv_starts(self, slots: int) -> list[int]:
        """Each row's ``kv_start``; a free row's is ``slots`` (past the end: it attends to
        nothing)."""
        return [slots if row is None else row.kv_start for row in self.rows]

    def positions(self, slots: int) -> list[int]:
        """RoPE position of the token each row feeds next (a free row: 0)."""
        return [0 if row is None else self.frontier - row.kv_start for row in self.rows]


@dataclass(frozen=True)
class BlockConfig:
    """The shape and policy of a block of N micro-batches of B rows.

    Attributes:
      rows: B, rows per micro-batch.
      micro_batches: N.
      cache_slots: S, KV-cache slots per row.
      pad: a joining group is left-padded to a multiple of this many tokens (the join chunk;
        a static batch: its padded length).
      chunk: prefill tokens per step (``hx.workload.prefill_chunks``; None: one step).
      join_min: free rows a join waits for while other rows decode.
      join_max: most prompts prefilled together (None: B).
      refill: iteration-level scheduling (True) or a static batch (False; one micro-batch
        whose rows are all its requests).
    """

    rows: int
    micro_batches: int
    cache_slots: int
    pad: int
    chunk: int | None
    join_min: int = 1
    join_max: int | None = None
    refill: bool = True


@dataclass(frozen=True)
class Reframe:
    """Roll micro-batch ``micro_batch``'s KV caches by ``slots`` along the slot axis (> 0:
    towards the end) and move its frontier and rows' ``kv_start`` by as many; with no row in
    it, only the frontier moves."""

    micro_batch: int
    slots: int


@dataclass(frozen=True)
class Shrink:
    """Keep rows ``keep`` of micro-batch ``micro_batch`` (its live rows first), in that order."""

    micro_batch: int
    keep: tuple[int, ...]


@dataclass(frozen=True)
class Join:
    """Prefill ``requests`` together and place each in its row.

    Attributes:
      requests: the prompts, each left-padded to ``padded`` tokens.
      places: (micro-batch, row) of each.
      padded: T, tokens of the prefill (a multiple of the config's ``pad``).
      chunks: tokens of each prefill step (sum T).
      reframes: done before the rows are placed (frontiers below a joining prompt's length).
      in_place: prefill straight into the micro-batch's caches (a static batch: the requests
        fill it); otherwise into a spare cache of len(requests) rows, each copied into its
        row so its last token sits just before the frontier.
    """

    requests: tuple[Request, ...]
    places: tuple[tuple[int, int], ...]
    padded: int
    chunks: tuple[int, ...]
    reframes: tuple[Reframe, ...]
    in_place: bool = False


@dataclass(frozen=True)
class Decode:
    """One decode step: the shrinks, then the reframes, then each block of micro-batches of
    equal rows (``blocks``, micro-batch indices) steps together (``Executor.run_block``)."""

    shrinks: tuple[Shrink, ...]
    reframes: tuple[Reframe, ...]
    blocks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class BatchState:
    """What the scheduler knows: its config, the prompts waiting (in order) and the
    micro-batches."""

    config: BlockConfig
    waiting: tuple[Request, ...]
    micro_batches: tuple[MicroBatch, ...]

    @classmethod
    def start(cls, config: BlockConfig, requests: Sequence[Request]) -> "BatchState":
        """Every request waiting, every row free, every frontier at slot 0.

        Raises:
          ValueError: a static batch of other than one micro-batch of one row per request.
        """
        if not config.refill and (config.micro_batches, config.rows) != (1, len(requests)):
            raise ValueError(f"a static batch is one micro-batch of a row per request, got "
                             f"{config.micro_batches} x {config.rows} for {len(requests)}")
        empty = MicroBatch(0, (None,) * config.rows)
        return cls(config, tuple(requests), (empty,) * config.micro_batches)

    def _with(self, m: int, micro_batch: MicroBatch) -> "BatchState":
        batches = self.micro_batches
        return BatchState(self.config, self.waiting, batches[:m] + (micro_batch,) + batches[m + 1:])

    def reframed(self, reframe: Reframe) -> "BatchState":
        """The state after ``reframe``."""
        mb, k = self.micro_batches[reframe.micro_batch], reframe.slots
        rows = tuple(None if row is None else replace(row, kv_start=row.kv_start + k)
                     for row in mb.rows)
        return self._with(reframe.micro_batch, MicroBatch(mb.frontier + k, rows))

    def shrunk(self, shrink: Shrink) -> "BatchState":
        """The state after ``shrink``."""
        mb = self.micro_batches[shrink.micro_batch]
        return self._with(shrink.micro_batch,
                          MicroBatch(mb.frontier, tuple(mb.rows[r] for r in shrink.keep)))

    def joined(self, join: Join, first: Sequence[int], started: float, now: float
               ) -> tuple["BatchState", list[Row]]:
        """The state after ``join``: its reframes done, its requests out of the queue and in
        their rows, each having drawn its first token ``first[j]`` at ``now``.

        Returns:
          (the state, the rows that ended at their first token).
        """
        state = self
        for reframe in join.reframes:
            state = state.reframed(reframe)
        taken = {request.index for request in join.requests}
        waiting = tuple(q for q in self.waiting if q.index not in taken)
        rows = {m: list(state.micro_batches[m].rows) for m, _ in join.places}
        ended: list[Row] = []
        for request, (m, r), token in zip(join.requests, join.places, first):
            start = state.micro_batches[m].frontier - request.length
            self._settle(rows[m], r, Row(request, start, started).drew(token, now), ended)
        batches = tuple(MicroBatch(mb.frontier, tuple(rows[m])) if m in rows else mb
                        for m, mb in enumerate(state.micro_batches))
        return BatchState(self.config, waiting, batches), ended

    def decoded(self, m: int, tokens: Sequence[int], now: float
                ) -> tuple["BatchState", list[Row]]:
        """The state after micro-batch ``m``'s decode step (its frontier one slot on) drew
        ``tokens[r]`` for each row r at ``now`` (a free or idle row's token is ignored).

        Returns:
          (the state, the rows that ended).
        """
        mb = self.micro_batches[m]
        rows, ended = list(mb.rows), []
        for r in mb.live:
            self._settle(rows, r, mb.rows[r].drew(tokens[r], now), ended)
        return self._with(m, MicroBatch(mb.frontier + 1, tuple(rows))), ended

    def _settle(self, rows: list[Row | None], r: int, row: Row, ended: list[Row]) -> None:
        """Put ``row`` in ``rows[r]``; an ended row goes to ``ended`` too and, when rows are
        refilled, frees its place."""
        rows[r] = row
        if row.reason is not None:
            ended.append(row)
            if self.config.refill:
                rows[r] = None


def schedule(state: BatchState) -> Join | Decode | None:
    """The next step of ``state``: a join when one is due, else a decode step of every
    micro-batch with a live row, else None (every prompt has finished).

    Raises:
      RuntimeError: a micro-batch's frontier reached the last slot while a row still reads
        slot 0 (its cache was sized too small: a bug).
    """
    if state.waiting:
        join = _refill_join(state) if state.config.refill else _static_join(state)
        if join is not None:
            return join
    return _decode(state)


def _static_join(state: BatchState) -> Join | None:
    """Every request at once, prefilled in place, once the batch is empty."""
    config, mb = state.config, state.micro_batches[0]
    if any(row is not None for row in mb.rows):
        return None
    T = round_up(max(q.length for q in state.waiting), config.pad)
    return Join(state.waiting, tuple((0, r) for r in range(len(state.waiting))), T,
                tuple(prefill_chunks(T, config.chunk)), (Reframe(0, T - mb.frontier),),
                in_place=True)


def _refill_join(state: BatchState) -> Join | None:
    """The next group of waiting prompts of one padded length, a power of two of them, into
    the first free rows; None while fewer than ``join_min`` rows are free and rows decode."""
    config, batches = state.config, state.micro_batches
    free = [(m, r) for m, mb in enumerate(batches) for r in mb.free]
    decoding = any(mb.live for mb in batches)
    if not free or decoding and len(free) < min(config.join_min, len(state.waiting)):
        return None
    padded = round_up(state.waiting[0].length, config.pad)
    most = min(config.join_max or config.rows, len(free))
    same = [q for q in state.waiting if round_up(q.length, config.pad) == padded][:most]
    group = tuple(same[:1 << (len(same).bit_length() - 1)])
    places = tuple(free[:len(group)])
    need: dict[int, int] = {}  # micro-batch -> its longest joining prompt
    for request, (m, _) in zip(group, places):
        need[m] = max(need.get(m, 0), request.length)
    reframes = tuple(Reframe(m, n - batches[m].frontier) for m, n in need.items()
                     if batches[m].frontier < n)
    return Join(group, places, padded, tuple(prefill_chunks(padded, config.chunk)), reframes)


def _decode(state: BatchState) -> Decode | None:
    """A decode step of the micro-batches with live rows, shrunk once no prompt waits (to the
    power of two >= their live rows) and reframed left where the frontier reached the end."""
    config = state.config
    shrinks, reframes, blocks = [], [], {}
    for m, mb in enumerate(state.micro_batches):
        live = mb.live
        if not live:
            continue
        rows = 1 << (len(live) - 1).bit_length()
        if config.refill and not state.waiting and rows < len(mb.rows):
            shrinks.append(Shrink(m, live + mb.free[:rows - len(live)]))
        else:
            rows = len(mb.rows)
        if mb.frontier == config.cache_slots:
            unread = min(row.kv_start for row in mb.rows if row is not None)
            if unread == 0:
                raise RuntimeError(f"no free slot in a {config.cache_slots}-slot KV cache")
            reframes.append(Reframe(m, -unread))
        blocks.setdefault(rows, []).append(m)
    if not blocks:
        return None
    return Decode(tuple(shrinks), tuple(reframes), tuple(tuple(b) for b in blocks.values()))


@dataclass
class Completion:
    """One prompt's result.

    Attributes:
      prompt_tokens: prompt length in tokens.
      token_ids: generated ids, without the stop token.
      text: ``token_ids`` decoded.
      finish_reason: ``"stop"`` (a stop token), ``"length"`` (max_new_tokens reached) or
        ``"context"`` (cut short of max_new_tokens: the prompt -- in a static batch, the
        batch's longest -- and the new tokens filled the model's context).
      ttft_s: seconds from the start of its prefill to its first token (prefill + first
        sample).
      decode_tok_s: its tokens after the first, per second of decode; None when the first
        token already ended it.
      compile_s: seconds spent before the timed run compiling (and running once) the run's
        prefill and decode shapes; 0 when they were already compiled. Not part of ttft_s.
    """

    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    decode_tok_s: float | None
    compile_s: float = 0.0


def complete(row: Row, detokenize: Callable[[list[int]], str], compile_s: float = 0.0
             ) -> Completion:
    """The ``Completion`` of an ended row (``row.reason`` set); ``detokenize`` turns token ids
    into text. Decode tokens/s counts the tokens drawn after the first (a stop token
    included) over the seconds from the first to the last."""
    tokens = list(row.tokens)
    after_first = row.drawn - 1
    elapsed = row.end - row.first
    return Completion(prompt_tokens=row.request.length, token_ids=tokens,
                      text=detokenize(tokens), finish_reason=row.reason,
                      ttft_s=row.first - row.started,
                      decode_tok_s=after_first / elapsed if after_first > 0 and elapsed > 0
                      else None, compile_s=compile_s)
