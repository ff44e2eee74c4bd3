"""Passages that answer (issue 64): each hit's best sentences, scored by the index's bi-encoder, sit
at their offsets in its text; the chunks around a hit come from its document and section only."""

from __future__ import annotations

import shutil

import pytest

from engine.documents import DocumentIn, SearchRequest
from engine.settings import EngineSettings

SECTIONS = ["intro", "intro", "intro", "methods", "methods"]


@pytest.fixture(scope="module")
def engine(index_dir, tmp_path_factory):
    from engine.search import HybridEngine

    target = tmp_path_factory.mktemp("passages") / "live"
    shutil.copytree(index_dir, target)
    engine = HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank=False), writable=True)
    chunks = [
        {
            "chunk_id": f"p{i}",
            "content": f"Part {i} opens here. Kiwi orchards need winter pruning in {section} {i}. The weather was mild.",
            "metadata": {"section": section, "page": i},
        }
        for i, section in enumerate(SECTIONS)
    ]
    engine.live.upsert(DocumentIn.model_validate({"document_id": "kiwi", "chunks": chunks}))
    engine.live.refresh()
    yield engine
    engine.close()


def _search(engine, **asked):
    request = SearchRequest(query="kiwi orchard pruning", top_k=5, **asked)
    return engine.search(request.query, 5, options=engine.options_for(request))


def test_highlights_sit_at_their_offsets_and_the_best_answers(engine) -> None:
    hits = _search(engine, highlight={"sentences": 2})
    assert hits and all(h.highlights is not None and 0 < len(h.highlights) <= 2 for h in hits)
    for hit in hits:
        assert all(hit.text[x.start : x.end] == x.text for x in hit.highlights)
        assert [x.score for x in hit.highlights] == sorted((x.score for x in hit.highlights), reverse=True)
    kiwi = [h for h in hits if h.document_id == "kiwi"]
    assert kiwi and all("pruning" in h.highlights[0].text for h in kiwi)
    assert _search(engine)[0].highlights is None  # only when asked


def test_context_holds_the_neighbours_in_the_same_section(engine) -> None:
    hits = {h.doc_id: h for h in _search(engine, context={"neighbors": 2})}
    before, after = hits["kiwi#p2"].context
    assert [c.chunk_id for c in before] == ["p0", "p1"] and after == []  # p3 opens another section
    before, after = hits["kiwi#p3"].context
    assert before == [] and [c.chunk_id for c in after] == ["p4"]
    assert all(h.context is not None for h in hits.values())
