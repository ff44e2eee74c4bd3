"""engine.store.unit_map: the arrays answer as the two dicts they replace, through live writes and folds."""

from __future__ import annotations

import numpy as np
import pytest

from engine.store import unit_map
from engine.store.unit_map import UnitMap


def test_random_writes_answer_as_dicts_do(monkeypatch) -> None:
    monkeypatch.setattr(unit_map, "FOLD_AT", 16)  # fold often
    rng = np.random.default_rng(7)
    names = {int(r): f"D-{r}#{r % 3}" for r in rng.choice(10_000, 300, replace=False)}
    names[10_001] = "Dokument-ü#0"  # not ASCII
    units = UnitMap.from_pairs(list(names.items())[::-1])
    next_row = 20_000
    for step in range(40):
        held = list(names)
        gone = [held[i] for i in rng.choice(len(held), 7, replace=False)]
        units.remove(gone + [999_999])  # a row it never held is ignored
        for row in gone:
            del names[row]
        new = list(range(next_row, next_row + 9))
        next_row += 9
        ids = [f"N-{step}-{i}#0" for i in range(9)]
        ids[0] = f"D-{gone[0]}#{gone[0] % 3}"  # a removed chunk written again, on a new row
        units.add(new, ids)
        names.update(zip(new, ids, strict=True))

        by_id = {u: r for r, u in names.items()}
        rows = np.array(sorted(names), dtype=np.int64)
        assert len(units) == len(names)
        assert np.array_equal(units.row_array(), rows)
        assert units.names(rows) == [names[int(r)] for r in rows]
        asked = [names[int(r)] for r in rows[::5]] + ["nobody#0", "x" * 80, gone[1] and f"D-{gone[1]}#{gone[1] % 3}"]
        assert units.rows_of(asked).tolist() == [by_id.get(u, -1) for u in asked]
        assert units.contains(asked).tolist() == [u in by_id for u in asked]
        assert all((u in units) == (u in by_id) for u in asked)
        probe = np.concatenate((rows[:20], np.array(gone[:3], dtype=np.int64)))
        assert units.holds_rows(probe).tolist() == [int(r) in names for r in probe]
        assert sorted(units.pairs()) == sorted(names.items())
        assert units.max_row() == max(names)
    with pytest.raises(KeyError):
        units.names([gone[0]])


def test_an_empty_map() -> None:
    units = UnitMap.from_pairs(())
    assert len(units) == 0 and not units and units.max_row() == -1
    assert units.contains(["a"]).tolist() == [False] and units.names([]) == []
    units.add([3], ["a#0"])
    assert units.names([3]) == ["a#0"] and units.get("a#0") == 3


def test_a_copy_changes_apart_from_its_original() -> None:
    units = UnitMap.from_pairs([(0, "a#0"), (1, "b#0"), (2, "c#0")])
    units.add([5], ["e#0"])
    other = units.copy()
    other.remove([1, 5])
    other.add([6], ["f#0"])
    assert sorted(units.pairs()) == [(0, "a#0"), (1, "b#0"), (2, "c#0"), (5, "e#0")]
    assert sorted(other.pairs()) == [(0, "a#0"), (2, "c#0"), (6, "f#0")]
