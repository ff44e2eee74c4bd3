"""``POST /v1/rerank`` in Cohere's shape: the official ``cohere`` client (v1 and v2) against a real
server on 127.0.0.1 with a reranker, its scores the served reranker's own, its bad input a 422
naming the field, and a 503 where the server serves no reranker."""

from __future__ import annotations

import shutil

import httpx
import pytest

cohere = pytest.importorskip("cohere")

from engine.rerank.loading import load_reranker  # noqa: E402
from offline.server_process import free_port, serve_args, start_server, stop_server  # noqa: E402
from serving.settings import Settings  # noqa: E402

QUERY = "does coffee protect the liver?"
DOCUMENTS = [
    "Coffee drinkers had lower liver enzyme levels in a cohort of 10,000 adults.",
    "Soy milk and tofu are sources of plant protein.",
    "Caffeine intake and the risk of liver cirrhosis: a meta-analysis.",
    "Vitamin D supplements and falls in the elderly.",
]


@pytest.fixture(scope="module")
def reranking(index_dir, reranker_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank-api")
    shutil.copytree(index_dir, folder / "index")
    port = free_port()
    args = serve_args(folder / "index", port, "--reranker", reranker_dir, "--read-only")
    proc = start_server(args, f"http://127.0.0.1:{port}/health", folder / "log")
    yield f"http://127.0.0.1:{port}"
    assert stop_server(proc) == 0
    assert "Traceback" not in (folder / "log").read_text()


def test_the_cohere_client_reranks_with_the_served_reranker(reranking, index_dir, reranker_dir):
    settings = Settings().with_values(index_dir=index_dir, device="cpu", reranker=reranker_dir).engine
    expected = load_reranker(settings, reranker_dir, "cpu", cache=False).score(QUERY, DOCUMENTS)
    client = cohere.Client(api_key="unused", base_url=reranking)
    answer = client.rerank(query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True, model="any")
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in answer.results] == best
    assert [r.relevance_score for r in answer.results] == pytest.approx([expected[i] for i in best], abs=1e-4)
    assert [r.document.text for r in answer.results] == [DOCUMENTS[i] for i in best]
    v2 = cohere.ClientV2(api_key="unused", base_url=reranking).rerank(model="any", query=QUERY, documents=DOCUMENTS)
    assert [r.index for r in v2.results][:3] == best and len(v2.results) == len(DOCUMENTS)
    assert all(getattr(r, "document", None) is None for r in v2.results)  # return_documents left out: none back


def test_objects_keep_their_fields_and_rank_fields_choose_what_is_read(reranking):
    documents = [{"title": "liver", "text": DOCUMENTS[0], "id": "a"}, {"title": "soy", "text": DOCUMENTS[1], "id": "b"}]
    reply = httpx.post(
        f"{reranking}/v1/rerank",
        json={"query": QUERY, "documents": documents, "return_documents": True, "rank_fields": ["title", "text"]},
    )
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1]
    assert {r["document"]["id"] for r in results} == {"a", "b"}  # every field back as sent
    assert reply.json()["meta"]["api_version"]["version"] == "1"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": "", "documents": DOCUMENTS}, "query"),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
        ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents.0"),
        ({"query": QUERY, "documents": DOCUMENTS, "topn": 2}, "topn"),
    ],
)
def test_bad_input_is_a_422_naming_the_field(reranking, body, named):
    reply = httpx.post(f"{reranking}/v1/rerank", json=body)
    assert reply.status_code == 422 and named in reply.json()["error"], reply.text


def test_the_client_sees_a_bad_call_as_cohere_would_answer_it(reranking):
    client = cohere.Client(api_key="unused", base_url=reranking)
    with pytest.raises(cohere.errors.UnprocessableEntityError):
        client.rerank(query=QUERY, documents=DOCUMENTS, top_n=0)


def test_a_server_without_a_reranker_says_so(server):
    reply = httpx.post(f"{server['mcp']}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 503 and "no reranker" in reply.json()["error"]
