"""One hit per document (issue 64): a long document whose chunks fill an ungrouped top 5 takes one
place in a grouped answer, with its best chunks in the ungrouped order; every door says so."""

from __future__ import annotations

import pytest

from engine.documents import DocumentIn, SearchRequest
from tests.helpers import writable_engine

PDF = "sorghum harvest yields drought"


@pytest.fixture(scope="module")
def engine(index_dir, tmp_path_factory):
    engine = writable_engine(index_dir, tmp_path_factory.mktemp("groups"))
    long = [{"chunk_id": f"p{i}", "content": f"{PDF} page {i} of the long report"} for i in range(8)]
    engine.live.upsert(DocumentIn.model_validate({"document_id": "long", "chunks": long}))
    for i in range(3):
        short = [{"chunk_id": "c", "content": f"sorghum harvest note {i}"}, {"chunk_id": "d", "content": f"sorghum {i}"}]
        engine.live.upsert(DocumentIn.model_validate({"document_id": f"note{i}", "chunks": short}))
    engine.live.refresh()
    yield engine
    engine.close()


def test_a_grouped_answer_holds_top_k_distinct_documents_with_their_best_chunks(engine) -> None:
    flat = engine.search(PDF, 5)
    assert {h.document_id for h in flat} == {"long"}  # the long report fills the ungrouped top 5
    request = SearchRequest(query=PDF, top_k=5, group_by="document_id", group_size=3)
    grouped = engine.search(PDF, 5, options=engine.options_for(request))
    documents = [h.document_id for h in grouped]
    assert len(documents) == 5 == len(set(documents)) and documents[0] == "long"
    ranked = [d for d, _ in engine.stages(PDF, 5).ranked]
    for hit in grouped:
        chunks = [hit.doc_id, *(member.doc_id for member in hit.group)]
        assert {engine.store.chunks([c])[c].document_id for c in chunks} == {hit.document_id}
        same = [d for d in ranked if engine.store.chunks([d])[d].document_id == hit.document_id]
        assert chunks == same[: len(chunks)] and len(chunks) == min(3, len(same))  # its best, in order
    assert [h.document_id for h in grouped[:1]] == ["long"] and len(grouped[0].group) == 2
    leaders = [d for d in ranked if d in {h.doc_id for h in grouped}]
    assert leaders == [h.doc_id for h in grouped]  # documents in the order of their best chunk


def test_group_size_without_group_by_is_refused_by_name() -> None:
    from pydantic import ValidationError

    from engine.documents import problems

    with pytest.raises(ValidationError) as caught:
        SearchRequest.model_validate({"query": "q", "group_size": 2})
    assert problems(caught.value).startswith("group_size")
    with pytest.raises(ValidationError) as caught:
        SearchRequest.model_validate({"query": "q", "group_by": "section"})
    assert problems(caught.value).startswith("group_by")
