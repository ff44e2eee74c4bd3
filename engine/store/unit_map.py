"""Store row <-> unit id for every chunk one view of the index holds, in arrays.

Every search names its hits through this map and checks candidates against it, in every worker. As
Python dicts a million chunks took ~175 MB a worker (the id strings, an int and a str object a
chunk, two hash tables); here the chunks the map was made with are four arrays (~50 B a chunk at
NFCorpus's id lengths): the rows ascending, their ids as UTF-8 in fixed-width bytes, the order that
sorts the ids and the ids in that order, so both directions are a binary search, done for a whole
ranking at once (searched through the order instead, a ranking's ids took about twice as long at
300k chunks and more: each step one more cache miss). The live writes since (a writer's, a
follower's) sit in two small dicts beside them, and are folded into the arrays once they outgrow a
fraction of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

FOLD_SHARE = 8  # the writes beside the arrays are folded in past 1/8 of them (at least FOLD_AT)
FOLD_AT = 4096


class UnitMap:
    """The rows and unit ids of one view: ``name``/``names`` (row -> id), ``get``/``rows_of``
    (id -> row), ``in`` and ``contains`` (is this chunk live), ``add`` and ``remove``."""

    def __init__(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """``rows`` ascending and ``ids`` (UTF-8 bytes) aligned with them: :meth:`from_pairs`."""
        self._rows, self._ids = rows, ids
        self._order = np.argsort(ids, kind="stable").astype(np.int64)
        self._sorted = ids[self._order]  # the ids in that order: a lookup's binary search reads them in place
        self._gone = np.zeros(len(rows), dtype=bool)  # positions removed since the arrays were made
        self._removed = 0
        self._added: dict[int, str] = {}  # rows added since, and their ids
        self._added_rows: dict[str, int] = {}

    def copy(self) -> UnitMap:
        """Another map of the same chunks, to change while this one is searched: the arrays are
        shared (never written), the removals and the writes since copied."""
        other = object.__new__(UnitMap)
        other.__dict__.update(self.__dict__)
        other._gone, other._added, other._added_rows = self._gone.copy(), dict(self._added), dict(self._added_rows)
        return other

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, str]], slice_size: int = 65536) -> UnitMap:
        """From (row, unit id) pairs in any order (the store's rows, a checkpoint's), taken a slice
        at a time: a million chunks never stand as Python objects at once (freed, their memory would
        stay with the process)."""
        it = iter(pairs)
        row_parts, id_parts = [], []
        while piece := list(itertools.islice(it, slice_size)):
            rows, units = zip(*piece, strict=True)
            row_parts.append(np.asarray(rows, dtype=np.int64))
            id_parts.append(np.asarray([unit.encode() for unit in units], dtype=bytes))
        if not row_parts:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype="S1"))
        rows, ids = np.concatenate(row_parts), np.concatenate(id_parts)
        order = np.argsort(rows, kind="stable")
        return cls(rows[order], ids[order])

    # size and iteration
    def __len__(self) -> int:
        return len(self._rows) - self._removed + len(self._added)

    def pairs(self) -> Iterator[tuple[int, str]]:
        """Every (row, unit id), the arrays' in row order, then the writes since."""
        for i in np.flatnonzero(~self._gone).tolist():
            yield int(self._rows[i]), self._ids[i].decode()
        yield from self._added.items()

    def unit_ids(self) -> list[str]:
        return [unit for _, unit in self.pairs()]

    def row_array(self) -> np.ndarray:
        """Every row, ascending."""
        rows = self._rows[~self._gone] if self._removed else self._rows
        if not self._added:
            return rows
        return np.sort(np.concatenate((rows, np.fromiter(self._added, dtype=np.int64, count=len(self._added)))))

    def max_row(self, default: int = -1) -> int:
        rows = self.row_array()
        return int(rows[-1]) if len(rows) else default

    # row -> unit id
    def names(self, rows: Sequence[int] | np.ndarray) -> list[str]:
        """Each row's unit id; KeyError for a row this view does not hold."""
        rows = np.asarray(rows, dtype=np.int64)
        found = self._base_positions(rows)
        named = []
        for row, at in zip(rows.tolist(), found.tolist(), strict=True):
            if at >= 0:
                named.append(self._ids[at].decode())
            elif (unit := self._added.get(row)) is not None:
                named.append(unit)
            else:
                raise KeyError(row)
        return named

    def name(self, row: int) -> str:
        return self.names([row])[0]

    def holds_rows(self, rows: np.ndarray) -> np.ndarray:
        """A mask: which of ``rows`` this view holds."""
        rows = np.asarray(rows, dtype=np.int64)
        held = self._base_positions(rows) >= 0
        if self._added:
            held |= np.fromiter((r in self._added for r in rows.tolist()), dtype=bool, count=len(rows))
        return held

    # unit id -> row
    def rows_of(self, units: Sequence[str]) -> np.ndarray:
        """Each unit id's row, -1 where this view does not hold it."""
        at = self._id_positions(units)
        rows = np.where(at >= 0, self._rows[np.maximum(at, 0)], -1) if len(self._rows) else np.full(len(units), -1)
        if self._added:
            for i, unit in enumerate(units):
                if (row := self._added_rows.get(unit)) is not None:
                    rows[i] = row
        return rows.astype(np.int64)

    def get(self, unit: str, default: int | None = None) -> int | None:
        row = int(self.rows_of([unit])[0])
        return row if row >= 0 else default

    def contains(self, units: Sequence[str]) -> np.ndarray:
        """A mask: which of ``units`` this view holds (a ranking checked at once)."""
        return self.rows_of(units) >= 0

    def __contains__(self, unit: object) -> bool:
        return isinstance(unit, str) and self.get(unit) is not None

    # live writes
    def add(self, rows: Sequence[int], units: Sequence[str]) -> None:
        for row, unit in zip(rows, units, strict=True):
            self._added[int(row)] = unit
            self._added_rows[unit] = int(row)
        if len(self._added) > max(FOLD_AT, len(self._rows) // FOLD_SHARE):
            self._fold()

    def remove(self, rows: Sequence[int]) -> None:
        """Drop ``rows`` (those this view does not hold are ignored)."""
        rows = np.asarray(rows, dtype=np.int64)
        for row in rows.tolist():
            if (unit := self._added.pop(row, None)) is not None:
                self._added_rows.pop(unit, None)
        at = self._base_positions(rows)
        at = at[at >= 0]
        self._gone[at] = True
        self._removed = int(self._gone.sum())

    def _fold(self) -> None:
        folded = UnitMap.from_pairs(self.pairs())
        self.__dict__.update(folded.__dict__)

    # binary searches over the arrays, for the positions not removed
    def _base_positions(self, rows: np.ndarray) -> np.ndarray:
        if not len(self._rows) or not len(rows):
            return np.full(len(rows), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._rows, rows), len(self._rows) - 1)
        hit = (self._rows[at] == rows) & ~self._gone[at]
        return np.where(hit, at, -1)

    def _id_positions(self, units: Sequence[str]) -> np.ndarray:
        if not len(self._ids) or not len(units):
            return np.full(len(units), -1, dtype=np.int64)
        encoded = [u.encode() for u in units]
        # at the arrays' width (a wider array would make searchsorted copy them whole); an id cut
        # short to fit is no id of theirs
        fits = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) <= self._ids.dtype.itemsize
        wanted = np.array(encoded, dtype=self._ids.dtype)
        at = np.minimum(np.searchsorted(self._sorted, wanted), len(self._ids) - 1)
        pos = self._order[at]
        hit = fits & (self._sorted[at] == wanted) & ~self._gone[pos]
        return np.where(hit, pos, -1)
