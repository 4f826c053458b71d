"""The request scheduler's decisions (``hx.scheduler``), against hand-computed expectations:
joins, finishes, reframes, prompts longer than a prefill chunk, per-prompt options, static
batches. No JAX: the scheduler is plain data."""

import subprocess
import sys

import pytest

from hx.scheduler import (CONTEXT, LENGTH, STOP, BatchState, BlockConfig, Decode, Join,
                          Reframe, Request, Shrink, complete, schedule)

EOS = 2


def requests(*lengths, limit=8, stop=(EOS,)):
    """Requests of these prompt lengths, each allowed ``limit`` new tokens."""
    return [Request(i, L, limit, limit, frozenset(stop), seed=100 + i)
            for i, L in enumerate(lengths)]


def config(rows=4, micro_batches=1, slots=128, pad=16, **options):
    return BlockConfig(rows, micro_batches, slots, pad, pad, **options)


def join_all(state, token=7, now=1.0):
    """Carry out joins (every prompt drawing ``token`` first) until a decode step is due."""
    while isinstance(decision := schedule(state), Join):
        state, _ = state.joined(decision, [token] * len(decision.requests), now - 0.5, now)
    return state, decision


def test_the_scheduler_imports_without_jax():
    code = ("import sys, hx.scheduler; print(sorted({m.split('.')[0] for m in sys.modules} "
            "& {'jax', 'jaxlib', 'flax', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_a_join_takes_a_power_of_two_of_prompts_of_the_first_ones_padded_length():
    """Waiting: 5, 10, 14, 3, 20, 8 tokens, padded to 16 but the 20 (32). The first join takes
    four 16s (of five: a power of two, at most the 4 rows of a micro-batch) into micro-batch 0,
    reframed right for its longest (14)."""
    state = BatchState.start(config(micro_batches=2), requests(5, 10, 14, 3, 20, 8))
    join = schedule(state)
    assert join == Join(tuple(state.waiting[:4]), ((0, 0), (0, 1), (0, 2), (0, 3)), 16, (16,),
                        (Reframe(0, 14),))
    state, ended = state.joined(join, [7, 7, 7, 7], started=0.5, now=1.0)
    assert ended == [] and [q.index for q in state.waiting] == [4, 5]
    assert state.micro_batches[0].frontier == 14
    assert state.micro_batches[0].kv_starts(128) == [9, 4, 0, 11]
    assert state.micro_batches[0].positions(128) == [5, 10, 14, 3]
    # then the 20-token prompt alone (its padded length differs), into micro-batch 1
    join = schedule(state)
    assert (join.requests, join.places, join.padded, join.reframes) == (
        (state.waiting[0],), ((1, 0),), 32, (Reframe(1, 20),))


def test_join_max_caps_a_group_and_rows_free_cap_it_too():
    waiting = requests(4, 4, 4, 4, 4)
    for join_max, group in ((None, 4), (3, 2), (1, 1)):
        join = schedule(BatchState.start(config(join_max=join_max), waiting))
        assert len(join.requests) == group
    state = BatchState.start(config(rows=2, micro_batches=2), waiting)
    first = schedule(state)
    assert [len(first.requests), first.places] == [2, ((0, 0), (0, 1))]
    state, _ = state.joined(first, [7, 7], 0.0, 1.0)
    assert schedule(state).places == ((1, 0), (1, 1))  # the other micro-batch's rows


def test_join_min_waits_for_free_rows_while_others_decode():
    """With join_min 2, one free row waits for a second while rows decode (or for the last
    waiting prompt); with nothing decoding, a join never waits."""
    state = BatchState.start(config(join_min=2), requests(4, 4, 4, 4, 4, 4, limit=3))
    state, decision = join_all(state)
    assert isinstance(decision, Decode) and len(state.waiting) == 2
    state, ended = state.decoded(0, [EOS, 9, 9, 9], now=2.0)  # row 0 stops
    assert [row.request.index for row in ended] == [0]
    assert isinstance(schedule(state), Decode)  # 1 free row < join_min: keep decoding
    state, ended = state.decoded(0, [0, EOS, 9, 9], now=3.0)  # row 1 stops: 2 free
    join = schedule(state)
    assert [q.index for q in join.requests] == [4, 5] and join.places == ((0, 0), (0, 1))
    # the last waiting prompt does not wait for a second free row
    state = BatchState.start(config(join_min=2), requests(4, 4, 4, 4, 4, limit=3))
    state, _ = join_all(state)
    state, _ = state.decoded(0, [EOS, 9, 9, 9], now=2.0)
    assert [q.index for q in schedule(state).requests] == [4]


def test_rows_finish_at_a_stop_token_or_their_limit():
    stop = requests(4, 4, 4, limit=3, stop=(EOS, 11))
    stop[2] = Request(2, 4, 2, 5, stop[2].stop)  # the context leaves it 2 of 5 tokens
    state, _ = join_all(BatchState.start(config(rows=4), stop), token=7, now=1.0)
    state, ended = state.decoded(0, [11, 8, 8, 0], now=2.0)
    assert [(row.request.index, row.reason, row.tokens) for row in ended] == [
        (0, STOP, (7,)), (2, CONTEXT, (7, 8))]  # a stop token is not kept
    assert state.micro_batches[0].free == (0, 2, 3)  # ended rows are free at once
    state, ended = state.decoded(0, [0, EOS, 0, 0], now=3.0)
    assert [(row.request.index, row.reason) for row in ended] == [(1, STOP)]
    assert schedule(state) is None
    row = BatchState.start(config(), requests(4, limit=1)).joined(
        schedule(BatchState.start(config(), requests(4, limit=1))), [9], 0.0, 1.0)[1][0]
    assert (row.reason, row.tokens) == (LENGTH, (9,))  # its first token was its last


def test_a_completion_reports_its_tokens_reason_and_times():
    state = BatchState.start(config(), requests(6, stop=(EOS,)))
    state, _ = state.joined(schedule(state), [5], started=10.0, now=10.5)
    for now, token in ((11.0, 6), (11.5, 7), (12.5, EOS)):
        state, ended = state.decoded(0, [token, 0, 0, 0], now)
    done = complete(ended[0], lambda ids: "-".join(map(str, ids)), compile_s=3.0)
    assert (done.prompt_tokens, done.token_ids, done.text, done.finish_reason) == (
        6, [5, 6, 7], "5-6-7", STOP)
    assert done.ttft_s == 0.5 and done.compile_s == 3.0
    assert done.decode_tok_s == pytest.approx(3 / 2.0)  # 3 draws after the first in 2 s
    state = BatchState.start(config(), requests(6))
    _, ended = state.joined(schedule(state), [EOS], 0.0, 1.0)
    assert complete(ended[0], str).decode_tok_s is None


def test_a_frontier_at_the_last_slot_reframes_left_by_the_first_slot_still_read():
    state = BatchState.start(config(rows=2, slots=32), requests(5, 12, limit=40))
    state, decision = join_all(state)  # frontier 12: kv_starts 7 and 0
    assert decision.reframes == ()
    state, _ = state.decoded(0, [9, EOS], now=2.0)  # the row reading slot 0 ends
    for step in range(19):
        state, _ = state.decoded(0, [9, 0], now=3.0)
    assert state.micro_batches[0].frontier == 32
    decision = schedule(state)
    assert decision.reframes == (Reframe(0, -7),)
    state = state.reframed(decision.reframes[0])
    assert (state.micro_batches[0].frontier, state.micro_batches[0].kv_starts(32)) == (25, [0, 32])
    # a row still reading slot 0 at the last slot: the cache was sized too small
    state = BatchState.start(config(rows=1, slots=16), requests(6, limit=40))
    state, _ = join_all(state)
    for step in range(10):
        state, _ = state.decoded(0, [9], now=2.0)
    with pytest.raises(RuntimeError, match="no free slot in a 16-slot"):
        schedule(state)


def test_a_prompt_longer_than_the_frontier_reframes_its_micro_batch_right():
    """Two 4-token prompts decode at frontier 5 when one ends and a 14-token prompt takes its
    row: the micro-batch is reframed 9 slots right (the other row's kv_start 0 -> 9), and
    the new row starts at slot 0, its last token just before the frontier (14)."""
    state = BatchState.start(config(rows=2), requests(4, 4, 14, limit=20))
    state, decision = join_all(state)
    assert state.micro_batches[0].frontier == 4 and isinstance(decision, Decode)
    state, _ = state.decoded(0, [EOS, 8], now=2.0)
    join = schedule(state)
    assert (join.requests, join.places, join.reframes) == (
        (state.waiting[0],), ((0, 0),), (Reframe(0, 9),))
    state, _ = state.joined(join, [7], 2.0, 3.0)
    mb = state.micro_batches[0]
    assert (mb.frontier, mb.kv_starts(128), mb.positions(128)) == (14, [0, 9], [14, 5])


def test_a_prompt_longer_than_a_chunk_is_prefilled_in_several():
    state = BatchState.start(config(pad=64), requests(150, 30))
    join = schedule(state)
    assert (join.padded, join.chunks, len(join.requests)) == (192, (64, 64, 64), 1)
    static = BlockConfig(2, 1, 256, pad=160, chunk=64, refill=False)
    join = schedule(BatchState.start(static, requests(150, 30)))
    assert (join.padded, join.chunks) == (160, (32, 64, 64))  # the remainder first


def test_per_prompt_limits_seeds_and_stop_tokens():
    """Each prompt keeps its own limit, stop tokens and seed; a row that joined later is at
    an earlier PRNG step."""
    mixed = [Request(0, 4, 1, 1, frozenset({EOS}), seed=11),
             Request(1, 4, 3, 3, frozenset({EOS, 5}), seed=12),
             Request(2, 4, 2, 2, frozenset(), seed=13)]
    state = BatchState.start(config(rows=2), mixed)
    state, ended = state.joined(schedule(state), [EOS, 9], 0.0, 1.0)  # EOS ends 0 only
    assert [row.reason for row in ended] == [STOP]
    state, ended = state.joined(schedule(state), [EOS], 1.0, 2.0)  # EOS is no stop for 2
    mb = state.micro_batches[0]
    assert [(row.request.seed, row.drawn) for row in mb.rows] == [(13, 1), (12, 1)]
    state, ended = state.decoded(0, [5, 5], now=3.0)  # 5 stops 1; 2 reaches its limit
    assert sorted((row.request.index, row.reason, row.tokens) for row in ended) == [
        (1, STOP, (9,)), (2, LENGTH, (EOS, 5))]
    assert schedule(state) is None


def test_once_no_prompt_waits_micro_batches_shrink_to_a_power_of_two_of_rows():
    state = BatchState.start(config(rows=8, micro_batches=2), requests(*[4] * 16, limit=5))
    state, decision = join_all(state)
    assert decision.shrinks == () and decision.blocks == ((0, 1),)
    state, _ = state.decoded(0, [9] * 8, now=2.0)
    state, _ = state.decoded(1, [EOS, 9, EOS, 9, EOS, EOS, EOS, EOS], now=2.0)
    decision = schedule(state)
    assert decision.shrinks == (Shrink(1, (1, 3)),)
    assert decision.blocks == ((0,), (1,))  # 8 rows and 2 rows step apart
    state = state.shrunk(decision.shrinks[0])
    assert [row.request.index for row in state.micro_batches[1].rows] == [9, 11]
    # 3 live rows of 8 keep 4: the live ones, then the first free one
    state = BatchState.start(config(rows=8), requests(*[4] * 3, limit=5))
    _, decision = join_all(state)
    assert decision.shrinks == (Shrink(0, (0, 1, 2, 3)),)
    state = BatchState.start(config(rows=8), requests(*[4] * 5, limit=5))
    assert join_all(state)[1].shrinks == ()  # 5 live rows: the power of two is all 8


def test_a_static_batch_joins_at_once_in_place_and_idles_ended_rows():
    static = BlockConfig(3, 1, 64, pad=32, chunk=16, refill=False)
    state = BatchState.start(static, requests(5, 20, 9, limit=4))
    join = schedule(state)
    assert join == Join(tuple(state.waiting), ((0, 0), (0, 1), (0, 2)), 32, (16, 16),
                        (Reframe(0, 32),), in_place=True)
    state, _ = state.joined(join, [7, 7, 7], 0.0, 1.0)
    mb = state.micro_batches[0]
    assert (mb.frontier, mb.kv_starts(64), mb.positions(64)) == (32, [27, 12, 23], [5, 20, 9])
    state, ended = state.decoded(0, [EOS, 8, 8], now=2.0)
    assert [row.request.index for row in ended] == [0]
    decision = schedule(state)  # the ended row idles in place: no shrink, the whole batch
    assert decision == Decode((), (), ((0,),))
    assert state.micro_batches[0].positions(64) == [6, 21, 10]
    for now in (3.0, 4.0):
        state, ended = state.decoded(0, [8, 8, 8], now)
    assert [row.request.index for row in ended] == [1, 2] and schedule(state) is None
    with pytest.raises(ValueError, match="static batch"):
        BatchState.start(static, requests(5, 20))
