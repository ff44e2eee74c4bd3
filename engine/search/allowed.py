"""What a filter lets through, found once per filter and store version.

The store finds a filter's chunks through its indexes (document type and date), in proportion to
the matches rather than the corpus; but a filter matching a tenth of a million chunks is still
100,000 rows out of SQLite and into Python each time. Users repeat their filters (a document type,
a source), so each one's set is kept, in the forms the retrievers take, until the store changes
(its ``applied_seq``, moved by every live write) or it falls out of a bounded LRU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from engine.documents import Filters
from engine.retrieval.dense import EXACT_WITHIN
from engine.retrieval.protocol import Rows
from engine.store.docstore import DocStore

T = TypeVar("T")
KEPT_ROWS = 2_000_000  # rows held over every kept filter (~200 MB at most)
VECTOR_WEIGHT = 16  # a row kept with its vector, in rows kept without


class Allowed:
    """The chunks one filter allows: unit ids for Lucene and the judgment memory, rows for FAISS."""

    def __init__(self, units: dict[str, int]) -> None:
        self.units = units
        self.rows = Rows(np.fromiter(units.values(), dtype=np.int64, count=len(units)))
        self._forms: dict[str, object] = {}
        self._making = threading.Lock()

    def form(self, name: str, make: Callable[[], T]) -> T:
        """``make()``, made once for this set and kept with it: a retriever's own form of the
        filter (Lucene's query of its ids), reused while the set is."""
        with self._making:
            if name not in self._forms:
                self._forms[name] = make()
            return self._forms[name]  # type: ignore[return-value]

    def __contains__(self, unit_id: object) -> bool:
        return unit_id in self.units

    def contains(self, units: Sequence[str]) -> np.ndarray:
        return np.fromiter((u in self.units for u in units), dtype=bool, count=len(units))

    def __iter__(self) -> Iterator[str]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)


class AllowedSets:
    """``allowed(filters)``: the store's chunks matching ``filters``, kept per store version."""

    def __init__(self, store: DocStore, kept_rows: int = KEPT_ROWS) -> None:
        self.store, self.kept_rows = store, kept_rows
        self._kept: OrderedDict[tuple[str, int], Allowed] = OrderedDict()
        self._rows = 0
        self._lock = threading.Lock()

    def __call__(self, filters: Filters) -> Allowed:
        key = (filters.model_dump_json(), self.store.meta("applied_seq"))
        with self._lock:
            if (found := self._kept.get(key)) is not None:
                self._kept.move_to_end(key)
                return found
        found = Allowed(self.store.matching(filters))
        with self._lock:
            if key not in self._kept and _weight(found) <= self.kept_rows:
                self._kept[key] = found
                self._rows += _weight(found)
                while self._rows > self.kept_rows:
                    _, dropped = self._kept.popitem(last=False)
                    self._rows -= _weight(dropped)
        return found


def _weight(allowed: Allowed) -> int:
    """What a kept set counts against ``kept_rows``: its rows, and a set small enough to be scored
    exactly by an approximate dense index keeps its rows' vectors too (:meth:`DenseRetriever.
    _score_within`: 1.5 KB a row of 384 floats, against ~100 bytes an id), so it counts 16 times."""
    return len(allowed) * (VECTOR_WEIGHT if len(allowed) <= EXACT_WITHIN else 1)
