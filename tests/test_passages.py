"""Passages that answer (issue 64): each hit's best sentences, scored by the index's bi-encoder, sit
at their offsets in its text, a chunk's sentences encoded once; the chunks around a hit come from its
document and section only. A2A replies carry them (and groups) as REST does; ``bench rest --body``
times a request's highlights beside the plain body."""

from __future__ import annotations

import shutil

import pytest

from engine.documents import DocumentIn, SearchRequest
from engine.search.highlights import SentenceVectors, highlights, spans
from engine.settings import EngineSettings
from offline.door_load import bench_http
from offline.server_process import free_port, start_server, stop_server
from tests.helpers import a2a_v1_send

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


def test_a_chunks_sentences_are_encoded_once_and_score_as_when_new(engine) -> None:
    """Kept sentence vectors answer what encoding them anew answers, without encoding them again;
    the oldest chunk's are dropped past the bound."""
    texts = [hit.text for hit in _search(engine)]
    real, encoded = engine.dense.query_encoder, []

    def counted(text: str):
        encoded.append(text)
        return real(text)

    query, kept = real("kiwi orchard pruning"), SentenceVectors(kept=3)
    first = highlights(kept, counted, query, texts, 2)
    assert len(encoded) == sum(len(spans(text)) for text in texts) > 0 and len(set(texts)) == len(texts) > 3
    assert highlights(kept, counted, query, texts[-3:], 2) == first[-3:]  # kept: nothing encoded
    assert len(encoded) == sum(len(spans(text)) for text in texts)
    assert highlights(SentenceVectors(), real, query, texts, 2) == first
    highlights(kept, counted, query, texts[:1], 2)  # pushed out by the three since: encoded again
    assert len(encoded) == sum(len(spans(text)) for text in [*texts, texts[0]])


def test_a2a_replies_carry_groups_highlights_and_context_as_rest_does(server) -> None:
    """The a2a-sdk client's data part asking for groups, highlights and context gets REST's results
    beside its doc_ids; a plain one gets doc_ids alone, as before."""
    import httpx

    asked = {"query": "soy isoflavones", "top_k": 3, "group_by": "document_id", "group_size": 2}
    asked |= {"highlight": {"sentences": 1}, "context": {"neighbors": 1}}
    rest = httpx.post(server["mcp"] + "/search", json=asked, timeout=60).json()["results"]

    found = _a2a(server["a2a"], asked)
    assert found["results"] == rest and found["doc_ids"] == [hit["doc_id"] for hit in rest]
    assert len({hit["document_id"] for hit in rest}) == 3 and all(hit["highlights"] for hit in rest)
    for hit in rest:
        assert all(hit["text"][x["start"] : x["end"]] == x["text"] for x in hit["highlights"])
    assert set(_a2a(server["a2a"], {"query": "soy isoflavones", "top_k": 3})) == {"doc_ids"}


def test_an_agent_over_another_servers_mcp_carries_its_results_and_pages(server, tmp_path) -> None:
    """``serve --mcp-url`` (the agent relaying to another server's MCP tools) answers a message asking
    for groups and highlights, and pages, as that server's own agent does."""
    port = free_port()
    args = ["serve", "--no-mcp", "--a2a-port", str(port), "--mcp-url", server["mcp"] + "/mcp"]
    proc = start_server(args, f"http://127.0.0.1:{port}/", tmp_path / "relay.log")
    try:
        relay, query = f"http://127.0.0.1:{port}", "soy isoflavones"
        asked = {"query": query, "top_k": 3, "group_by": "document_id", "highlight": {"sentences": 1}}
        assert _a2a(relay, asked)["results"] == _a2a(server["a2a"], asked)["results"]
        whole = _a2a(server["a2a"], {"query": query, "top_k": 4})["doc_ids"]
        first = _a2a(relay, {"query": query, "top_k": 2, "paginate": True})
        second = _a2a(relay, {"query": query, "top_k": 2, "page_token": first["next_page_token"]})
        assert first["doc_ids"] + second["doc_ids"] == whole and len(whole) == 4
    finally:
        assert stop_server(proc) == 0


def _a2a(url: str, message: dict) -> dict:
    """The one data part of the agent's answer to ``message``, sent by the a2a-sdk client."""
    from a2a.helpers.proto_helpers import new_data_part
    from google.protobuf.json_format import MessageToDict

    task = a2a_v1_send(url, [new_data_part(message)])
    return MessageToDict(task.artifacts[0].parts[0].data)


def test_bench_times_each_body_under_one_load(server) -> None:
    queries = ["soy milk", "coffee caffeine", "vitamin d"]
    bodies = {"none": {}, "highlight": {"highlight": {"sentences": 1}}, "bad": {"top_k": 0}}
    run = bench_http("rest", server["mcp"] + "/search", queries, [1], top_k=2, bodies=bodies)["runs"][0]
    assert set(run["bodies"]) == set(bodies) and run["bodies"]["highlight"]["n"] == run["bodies"]["none"]["n"] == 3
    assert run["errors"] == 3 and "422" in next(iter(run["error_kinds"])), run  # the bad body's, counted apart


def test_bench_refuses_a_body_that_is_not_a_named_json_object(beir_dir, capsys) -> None:
    from cli.main import main

    for given in ("x={", "={}", "x=[1]"):
        flags = ["--url", "http://127.0.0.1:9/search", "--data", str(beir_dir), "--body", given]
        assert main(["bench", "rest", *flags]) == 2
        assert "--body takes NAME=JSON" in capsys.readouterr().err
