"""Pair rows as three flat arrays, and as they cross to the reranker process.

A list of :class:`~engine.rerank.pair_tokens.PairRow` holds two int64 arrays a pair: 100 pairs at 256
tokens pickled to ~416 KB a call to the reranker process. A row's token type ids are 0 up to the end
of its query (``[CLS]`` query ``[SEP]``) and 1 after, so its length and its query's length say them
all; and a query's 100 pairs share their query's tokens. So :class:`TokenRows` keeps every row's ids
in one small-integer array (uint16 while the vocabulary fits) with each row's length and query
length, which the one-pass CUDA path pads in one vectorised step; and :class:`WireRows`, what a call
carries, holds the first row's query tokens once and, for each row that shares them, only the
tokens after them (a row with a query of its own, as a cut long query can give, carries it whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.rerank.pair_tokens import PairRow

SMALL_IDS = np.uint16  # ids below 65,536: BERT's 30,522 WordPieces


def _small(ids: np.ndarray) -> np.ndarray:
    """``ids`` as uint16 when they fit, else int32."""
    return ids.astype(SMALL_IDS if not len(ids) or int(ids.max()) < 1 << 16 else np.int32, copy=False)


def _starts(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


@dataclass(frozen=True)
class TokenRows:
    """Pair rows: ``ids`` every row's token ids one after another, ``lengths`` each row's tokens,
    ``query_lengths`` each row's tokens up to its first ``[SEP]`` (token type 0)."""

    ids: np.ndarray
    lengths: np.ndarray
    query_lengths: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[PairRow]) -> TokenRows:
        if not rows:
            return cls(np.empty(0, SMALL_IDS), np.empty(0, np.int32), np.empty(0, np.int32))
        lengths = np.fromiter((len(row.ids) for row in rows), dtype=np.int32, count=len(rows))
        types = np.add.reduceat(np.concatenate([row.types for row in rows]), _starts(lengths))
        ids = _small(np.concatenate([row.ids for row in rows]))
        return cls(ids, lengths, (lengths - types).astype(np.int32))

    @classmethod
    def joined(cls, parts: Sequence[TokenRows]) -> TokenRows:
        """Several callers' rows as one batch, in order."""
        if len(parts) == 1:
            return parts[0]
        ids = np.concatenate([p.ids for p in parts])
        return cls(ids, np.concatenate([p.lengths for p in parts]), np.concatenate([p.query_lengths for p in parts]))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def take(self, order: np.ndarray) -> TokenRows:
        """The rows at ``order``, in that order."""
        starts, lengths = _starts(self.lengths)[order], self.lengths[order]
        positions = np.repeat(starts - _starts(lengths), lengths) + np.arange(int(lengths.sum()))
        return TokenRows(self.ids[positions], lengths, self.query_lengths[order])

    def features(self, pad_id: int) -> dict[str, np.ndarray]:
        """``input_ids``, ``attention_mask`` and ``token_type_ids`` padded to the longest row, in one
        vectorised step (what :func:`~engine.rerank.pair_tokens.pad_rows` makes of the same rows)."""
        positions = np.arange(int(self.lengths.max()))
        mask = positions < self.lengths[:, None]
        ids = np.full(mask.shape, pad_id, dtype=np.int64)
        ids[mask] = self.ids
        types = (positions >= self.query_lengths[:, None]) & mask
        return {"input_ids": ids, "attention_mask": mask.astype(np.int64), "token_type_ids": types.astype(np.int64)}

    def padded(self, into: np.ndarray, pad_id: int) -> None:
        """The rows written into the first rows of ``into`` (rows x width), padded with ``pad_id``."""
        into.fill(pad_id)
        into[: len(self)][np.arange(into.shape[1]) < self.lengths[:, None]] = self.ids

    def wire(self) -> WireRows:
        """What a call carries: the first row's query tokens once, the rest of each row."""
        if not len(self):
            return WireRows(self.ids, self.ids, self.lengths, self.query_lengths, np.zeros(0, bool))
        q = int(self.query_lengths[0])
        query = self.ids[:q]
        starts = _starts(self.lengths)
        heads = self.ids[starts[:, None] + np.arange(q)] if (self.lengths >= q).all() else None
        own = ~((self.query_lengths == q) & (heads == query).all(axis=1)) if heads is not None else np.ones(len(self), bool)
        own[0] = False
        keep = np.ones(self.tokens, dtype=bool)
        shared = np.flatnonzero(~own)
        keep[(starts[shared, None] + np.arange(q)).ravel()] = False
        return WireRows(query, self.ids[keep], self.lengths, self.query_lengths, own)


@dataclass(frozen=True)
class WireRows:
    """:class:`TokenRows` with their query's tokens once: ``query`` the first row's query tokens,
    ``rest`` each row's tokens after them (the whole row where ``own``: a query of its own)."""

    query: np.ndarray
    rest: np.ndarray
    lengths: np.ndarray
    query_lengths: np.ndarray
    own: np.ndarray

    def rows(self) -> TokenRows:
        q = len(self.query)
        total = int(self.lengths.sum())
        ids = np.empty(total, dtype=self.rest.dtype)
        is_query = np.zeros(total, dtype=bool)
        shared = np.flatnonzero(~self.own)
        positions = (_starts(self.lengths)[shared, None] + np.arange(q)).ravel()
        is_query[positions] = True
        ids[positions] = np.tile(self.query, len(shared))
        ids[~is_query] = self.rest
        return TokenRows(ids, self.lengths, self.query_lengths)
