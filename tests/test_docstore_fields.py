"""engine.store.docstore: equality on any metadata key (a value among a list's) through the
chunk_fields index finds what reading every row's JSON finds, through rewrites and deletes, and
SQLite plans it by the index; a key held in a shape filters cannot read is refused by name."""

from __future__ import annotations

import pytest

from engine.documents import Filters, unit_id
from engine.store.docstore import DocStore, UnfilterableKey, matching_sql


def _document(doc_id: str, meta: dict, chunk_metas: list[dict]) -> dict:
    chunks = [{"chunk_id": f"c{i}", "content": f"text {i}", "metadata": m} for i, m in enumerate(chunk_metas)]
    return {"document_id": doc_id, "document_name": doc_id, "metadata": meta, "chunks": chunks}


def test_indexed_equality_matches_the_json_scan(tmp_path) -> None:
    store = DocStore(tmp_path / "docs.sqlite")
    documents = [
        _document("a", {"source": "pubmed", "year": 2021, "open": True}, [{}, {"source": "trial"}]),
        _document("b", {"source": "trial", "score": 2.5}, [{"open": False}, {"source": None}]),
        _document("c", {"nested": {"x": 1}, "source": "pubmed"}, [{"year": 2021}]),
        _document("d", {}, [{"source": "pubmed", "open": True}]),
        _document("e", {"tags": ["x", "y", None], "year": [2021, "2022"]}, [{"tags": ["z"]}, {"tags": None}, {}]),
    ]
    rows = iter(range(100))
    for document in documents:
        store.write_document(document, [next(rows) for _ in document["chunks"]], seq=1)
    store.write_document(documents[0] | {"metadata": {"source": "web"}}, [next(rows), next(rows)], seq=2)
    store.delete_document("b", seq=3)
    store.write_document(documents[1], [next(rows), next(rows)], seq=4)  # back, on new rows
    cases = [
        Filters(source="pubmed"),
        Filters(source="trial"),
        Filters(source="web"),
        Filters(year=2021),
        Filters(year=2021.0),
        Filters(open=True),
        Filters(open=False),
        Filters(score=2.5),
        Filters(source="pubmed", open=True),
        Filters(source="pubmed", document_ids=["c"]),
        Filters(source="nobody"),
        Filters(year="2021"),  # a string is not the number
        Filters(tags="x"),  # a value among a list's, the chunk's own list over its document's
        Filters(tags="z"),
        Filters(year="2022", tags="y"),
    ]
    conn = store._conn()
    for f in cases:
        scanned = dict(conn.execute(*matching_sql(f, fields_indexed=False)))
        assert store.matching(f) == scanned, f
    assert store.matching(Filters(source="pubmed")) and store.matching(Filters(open=False))
    assert set(store.matching(Filters(tags="x"))) == {unit_id("e", "c1"), unit_id("e", "c2")}
    assert set(store.matching(Filters(year=2021))) == {unit_id("c", "c0")} | {unit_id("e", f"c{i}") for i in range(3)}
    plan = " ".join(store.plan(*matching_sql(Filters(source="pubmed"))))
    assert "chunk_fields" in plan and "SCAN c" not in plan and "SCAN chunks" not in plan, plan


def test_a_key_held_in_a_shape_filters_cannot_read_is_refused_by_name(tmp_path) -> None:
    store = DocStore(tmp_path / "docs.sqlite")
    store.write_document(_document("a", {"evidence": {"4": ["SUPPORT"]}, "source": "web"}, [{}]), [0], seq=1)
    store.write_document(_document("b", {"evidence": "none", "grades": [[1]], "big": 2**64}, [{}]), [1], seq=2)
    for key in ("evidence", "grades", "big"):
        with pytest.raises(UnfilterableKey, match=rf"filter '{key}': some documents hold metadata\.{key}"):
            store.matching(Filters(**{key: "none"}, source="web"))
    store.delete_document("a", seq=3)
    assert store.matching(Filters(evidence="none")) == {unit_id("b", "c0"): 1}  # none holds an object now


def test_a_store_written_before_the_fields_scans_the_rows(tmp_path) -> None:
    path = tmp_path / "docs.sqlite"
    store = DocStore(path)
    store.write_document(_document("a", {"source": "pubmed"}, [{}]), [0], seq=1)
    conn = store._conn()
    conn.execute("DELETE FROM chunk_fields")  # as older code left it: chunks, no fields, no flag
    conn.execute("DELETE FROM meta WHERE key = 'fields_indexed'")
    store.close()
    reopened = DocStore(path)
    assert reopened.matching(Filters(source="pubmed")) == {unit_id("a", "c0"): 0}  # read from the rows
    assert "SCAN c" in reopened.plan(*matching_sql(Filters(source="pubmed"), False))
    reopened.write_document(_document("b", {"source": ["pubmed", "web"]}, [{}]), [1], seq=2)  # lists: since then
    assert reopened.matching(Filters(source="pubmed")) == {unit_id("a", "c0"): 0, unit_id("b", "c0"): 1}
    assert reopened.index_fields() == 2 and reopened.index_fields() == 0  # what `compact` does, once
    assert reopened.matching(Filters(source="pubmed")) == {unit_id("a", "c0"): 0, unit_id("b", "c0"): 1}


def test_date_range_and_type_read_only_what_they_mean(tmp_path) -> None:
    """A ``date`` or ``document_type`` kept as sent (not an ISO date, not a string) is matched by
    neither filter, as Lucene's terms leave it out (tests/test_lucene.py)."""
    store = DocStore(tmp_path / "docs.sqlite")
    odd = ["2024-02-30", "yesterday", 2024, ["2024-05-01"], {"day": "2024-05-01"}]
    for row, day in enumerate([*odd, "2024-05-01"]):
        store.write_document(_document(f"d{row}", {"date": day, "document_type": [day]}, [{}]), [row], seq=row + 1)
    for start, end in (("2000-01-01", None), (None, "2030-01-01"), (None, None)):
        assert store.matching(Filters(date_range=[start, end])) == {unit_id("d5", "c0"): 5}
    assert store.matching(Filters(document_types=["2024-05-01"])) == {}
