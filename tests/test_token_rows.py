"""Pair rows as flat arrays and on the wire to the reranker process: the query's tokens once, every
row back as it was, a row with a query of its own carried whole."""

import pickle

import numpy as np

from engine.rerank.pair_tokens import PairRow, pad_rows
from engine.rerank.token_rows import TokenRows


def _row(query: list[int], passage: list[int]) -> PairRow:
    ids = np.array([101, *query, 102, *passage, 102], dtype=np.int64)
    return PairRow(ids, (np.arange(len(ids)) >= len(query) + 2).astype(np.int64))


def _same(rows: TokenRows, made: list[PairRow]) -> None:
    """``rows`` are ``made``: the model's inputs padded from either are the same arrays."""
    got, want = rows.features(0), pad_rows(made, 0)
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        assert np.array_equal(got[name], want[name]), name


def test_rows_round_trip_through_flat_arrays_and_the_wire():
    made = [_row([7, 8, 9], list(range(200 + i, 230 + i * 3))) for i in range(20)]
    rows = TokenRows.of(made)
    assert rows.ids.dtype == np.uint16 and rows.query_lengths.tolist() == [5] * 20
    _same(rows, made)
    wire = rows.wire()
    assert len(wire.query) == 5 and len(wire.rest) == rows.tokens - 5 * 20  # the query's tokens once
    _same(wire.rows(), made)


def test_a_row_with_a_query_of_its_own_is_carried_whole():
    made = [_row([7, 8, 9], [300, 301]), _row([7, 8], [9, 300, 301]), _row([7, 8, 9], [302]), _row([5], [6])]
    wire = TokenRows.of(made).wire()
    assert wire.own.tolist() == [False, True, False, True]
    _same(wire.rows(), made)


def test_the_wire_is_a_fraction_of_the_rows_it_replaced():
    made = [_row(list(range(1000, 1012)), list(range(2000, 2114))) for _ in range(100)]  # 128 tokens a pair
    before = len(pickle.dumps((made, [500] * 100), protocol=pickle.HIGHEST_PROTOCOL))
    after = len(pickle.dumps(TokenRows.of(made).wire(), protocol=pickle.HIGHEST_PROTOCOL))
    assert after * 8 < before


def test_ids_past_uint16_are_kept_whole_and_rows_are_taken_in_any_order():
    made = [_row([70000], [1, 2, 3]), _row([5, 6], [4]), _row([9], [80000, 8])]
    rows = TokenRows.of(made)
    assert rows.ids.dtype == np.int32
    _same(rows.take(np.array([2, 0])), [made[2], made[0]])
    _same(TokenRows.joined([rows, rows.take(np.array([1]))]), [*made, made[1]])
