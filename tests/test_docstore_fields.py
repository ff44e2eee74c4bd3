"""engine.store.docstore: equality on any metadata key through the chunk_fields index finds what
reading every row's JSON finds, through rewrites and deletes, and SQLite plans it by the index."""

from __future__ import annotations

from engine.documents import Filters, unit_id
from engine.store.docstore import DocStore, matching_sql


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
    ]
    conn = store._conn()
    for f in cases:
        scanned = dict(conn.execute(*matching_sql(f, fields_indexed=False)))
        assert store.matching(f) == scanned, f
    assert store.matching(Filters(source="pubmed")) and store.matching(Filters(open=False))
    plan = " ".join(store.plan(*matching_sql(Filters(source="pubmed"))))
    assert "chunk_fields" in plan and "SCAN c" not in plan and "SCAN chunks" not in plan, plan


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
    assert "chunk_fields" not in " ".join(reopened.plan(*matching_sql(Filters(source="pubmed"), False)))
    assert reopened.index_fields() == 1 and reopened.index_fields() == 0  # what `compact` does, once
    assert reopened.matching(Filters(source="pubmed")) == {unit_id("a", "c0"): 0}  # through the index
