"""What every first-stage retriever answers to, pyserini's ``search(q, k)`` shape: the top ``k``
(unit id, score) for a query, best first, within what the search may return.

Lucene's BM25, the dense index and the judgment memory each take from a :class:`Query` what they
search by (its text, its vector) and from :class:`Within` the form of a filter they search fastest
(unit ids, store rows); a search's stages run them in one loop (``engine/search/stages.py``), so a
retriever added, or one index split in shards, is one more entry, not another code path.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.documents import Filters

Ranking = list[tuple[str, float]]  # (unit id, score), best first


class Rows:
    """Store rows a search is held to (a filter's), with the FAISS selector over them made once
    for every search that shares them (100,000 rows: milliseconds a search otherwise). The selector
    is a bitmap over the rows up to the highest: one bit a row, a test in a few nanoseconds where a
    hash set's took tens, which an inverted file pays for every vector of every list it probes
    (docs/filters.md, "At a million chunks")."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self._selector = None
        self._bitmap: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def selector(self):
        import faiss

        if self._selector is None:
            bits = self._bits()  # kept as long as the selector, which points into it
            self._selector = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
        return self._selector

    def holds(self, rows: np.ndarray) -> np.ndarray:
        """A mask: which of ``rows`` are among these (the selector's bitmap, read in NumPy)."""
        bits = self._bits()
        rows = np.asarray(rows, dtype=np.int64)
        inside = (rows >= 0) & (rows < len(bits) * 8)
        at = np.where(inside, rows, 0)
        return inside & ((bits[at >> 3] >> (at & 7)) & 1).astype(bool)

    def _bits(self) -> np.ndarray:
        if self._bitmap is None:
            bits = np.zeros(int(self.ids.max()) // 8 + 1 if len(self.ids) else 1, dtype=np.uint8)
            np.bitwise_or.at(bits, self.ids >> 3, np.left_shift(1, self.ids & 7).astype(np.uint8))
            self._bitmap = bits
        return self._bitmap


@dataclass(frozen=True)
class Query:
    """One query as every retriever takes it: its text, its vector (encoded once, before any
    retriever runs) and, when learning on judged queries, the one whose judgments stay unseen."""

    text: str
    vector: np.ndarray
    exclude: str | None = None


class Live(Protocol):
    """The chunks a search may return (the view's :class:`~engine.store.unit_map.UnitMap`, a
    filter's set), asked of one chunk or of a whole ranking at once."""

    def __contains__(self, unit: object) -> bool: ...

    def contains(self, units: Sequence[str]) -> np.ndarray:
        """A mask: which of ``units`` may be returned."""
        ...


def live_only(ranking: Ranking, live: Live) -> Ranking:
    """``ranking`` without the chunks ``live`` does not hold."""
    if not ranking:
        return ranking
    keep = live.contains([unit for unit, _ in ranking]).tolist()
    return [hit for hit, kept in zip(ranking, keep, strict=True) if kept]


class _Everything:
    """Every chunk: what a retriever asked alone, outside an engine's view, may return."""

    def __contains__(self, unit: object) -> bool:
        return True

    def contains(self, units: Sequence[str]) -> np.ndarray:
        return np.ones(len(units), dtype=bool)


EVERYTHING: Live = _Everything()


@dataclass(frozen=True)
class Within:
    """What a search may return: ``live`` (a filter's chunks, else every chunk the engine's view
    holds; by default anything the retriever holds); a filter's chunks again as ``allowed`` (None:
    no filter) for a retriever that searches within them itself, as store ``rows`` for FAISS's
    selector, and the ``filters`` themselves for one that holds the filtered fields (Lucene)."""

    live: Live = EVERYTHING
    allowed: Collection[str] | None = None
    rows: Rows | None = None
    filters: Filters | None = None


class Retriever(Protocol):
    def retrieve(self, query: Query, k: int, within: Within) -> Ranking:
        """The top ``k`` (unit id, score), best first."""
        ...
