"""Stable pages (issue 64): a pinned ranking's pages concatenate to the one longer list, with no
duplicate and no gap, also with documents written between pages, and reach past 100 hits; a token
of another query or of no pin is refused (422, 410); grouped answers page by document. The CLI's
``search --paginate`` pins on disk, so that its next run answers the next page."""

from __future__ import annotations

import json

import pytest

from engine.documents import DocumentIn, SearchRequest
from engine.search.pages import ExpiredPageToken, ForeignPageToken, PinFile, Pins
from tests.helpers import writable_engine

QUERY = "vitamin D supplements and bone density"


@pytest.fixture(scope="module")
def engine(index_dir, tmp_path_factory):
    engine = writable_engine(index_dir, tmp_path_factory.mktemp("pages"))
    for i in range(90):  # past 100 chunks in all
        chunks = [{"chunk_id": f"c{j}", "content": f"vitamin note {i} part {j} bone"} for j in range(2)]
        engine.live.upsert(DocumentIn.model_validate({"document_id": f"n{i}", "chunks": chunks}))
    engine.live.refresh()
    yield engine
    engine.close()


def _pages(engine, size: int, count: int, between=None, **asked) -> list[list[str]]:
    pages, token = [], None
    for page in range(count):
        request = SearchRequest(query=QUERY, top_k=size, paginate=True, page_token=token, **asked)
        hits = engine.search(QUERY, size, request.filters, options=engine.options_for(request))
        pages.append([h.doc_id for h in hits])
        token = hits.next_page_token
        if between is not None:
            between(page)
    return pages


def test_pages_concatenate_to_the_one_longer_list_whatever_is_written_between(engine) -> None:
    whole = [h.doc_id for h in engine.search(QUERY, 50)]
    assert _pages(engine, 10, 5) == [whole[i : i + 10] for i in range(0, 50, 10)]

    def write(page: int) -> None:  # a document that would rank first, and a rewrite of a ranked one
        chunks = [{"chunk_id": "c", "content": f"{QUERY} {QUERY} new {page}"}]
        engine.live.upsert(DocumentIn.model_validate({"document_id": f"new{page}", "chunks": chunks}), wait=True)

    before = [h.doc_id for h in engine.search(QUERY, 50)]
    written = sum(_pages(engine, 10, 5, write), [])
    assert written == before and len(set(written)) == 50  # no duplicate, no gap
    assert engine.search(QUERY, 1)[0].doc_id.startswith("new")  # the writes did land


def test_pages_reach_past_100(engine) -> None:
    asked = {"retrievers": {"bm25": {"depth": 300}, "dense": {"depth": 300}}}
    pages = _pages(engine, 100, 2, **asked)
    assert len(pages[1]) > 0 and not set(pages[0]) & set(pages[1]) and len(pages[0]) == 100


def test_grouped_pages_hold_distinct_documents(engine) -> None:
    pages = _pages(engine, 5, 3, group_by="document_id", group_size=2)
    documents = [d.split("#")[0] for page in pages for d in page]
    assert len(documents) == 15 == len(set(documents))


def test_a_foreign_or_expired_token_is_refused(engine) -> None:
    first = SearchRequest(query=QUERY, top_k=3, paginate=True)
    token = engine.search(QUERY, 3, options=engine.options_for(first)).next_page_token
    other = SearchRequest(query="coffee", top_k=3, page_token=token)
    with pytest.raises(ForeignPageToken, match="page_token: made for another query"):
        engine.search("coffee", 3, options=engine.options_for(other))
    for bad in (token[:-1] + "01"[token.endswith("0")], "é" + token, "x"):
        forged = SearchRequest(query=QUERY, top_k=3, page_token=bad)
        with pytest.raises(ForeignPageToken, match="page_token: not a token this server made"):
            engine.search(QUERY, 3, options=engine.options_for(forged))
    pins, engine.pins = engine.pins, Pins(PinFile(kept=1, seconds=600), 600)
    try:
        token = engine.search(QUERY, 3, options=engine.options_for(first)).next_page_token
        engine.search(QUERY, 3, options=engine.options_for(first))  # pins another, dropping the first
        with pytest.raises(ExpiredPageToken, match="expired"):
            engine.search(QUERY, 3, options=engine.options_for(SearchRequest(query=QUERY, page_token=token)))
    finally:
        engine.pins = pins
    assert ExpiredPageToken.status == 410 and ForeignPageToken.status == 422


def test_the_cli_pages_across_runs_and_refuses_another_indexs_token(index_dir, tmp_path, monkeypatch, capsys) -> None:
    """``search --paginate`` then ``--page-token``, each run a new engine: pages 1-2 of 3 are the
    top 6 of one run; the pins are the index's (a copy of it refuses the token, exit 2)."""
    import shutil

    from cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    flags = ["--json", "--index-dir", str(index_dir), "--no-rerank"]

    def run(*asked: str) -> dict | list:
        assert main(["search", QUERY, *asked, *flags]) == 0
        return json.loads(capsys.readouterr().out)

    whole = [hit["doc_id"] for hit in run("--top-k", "6")]
    first = run("--top-k", "3", "--paginate")
    second = run("--top-k", "3", "--page-token", first["next_page_token"])
    assert [hit["doc_id"] for hit in first["results"] + second["results"]] == whole
    assert oct((tmp_path / "cache" / "hybrid-search").stat().st_mode & 0o777) == "0o700"
    copy = tmp_path / "copy"
    shutil.copytree(index_dir, copy)
    token = ["--page-token", first["next_page_token"], "--json", "--index-dir", str(copy), "--no-rerank"]
    assert main(["search", QUERY, "--top-k", "3", *token]) == 2
    assert "page_token: not a token this server made" in capsys.readouterr().err
