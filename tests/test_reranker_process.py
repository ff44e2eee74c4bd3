"""The shared reranker of ``serve --workers N``: one process owns the model and scores every worker's
pairs (serving/reranker_process.py). On the CPU with the tests' small cross-encoder, in the same
process layout as on a GPU: the process alone behind the channel, then ``serve --workers 2``."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from engine.rerank.loading import load_reranker
from engine.rerank.pair_assembly import PassageTokens
from engine.retrieval.encoder import encode, load_encoder
from engine.store.index_dir import read_manifest
from offline.dataset import load_dataset
from offline.server_process import (
    free_port,
    serve_args,
    sigkill,
    start_server,
    stop_server,
    worker_client,
    workers_up,
)
from serving.remotes import RemoteQueryEncoder, RemoteReranker
from serving.reranker_process import RERANKER, run_reranker
from serving.settings import Settings
from serving.transport import ChannelTransport, Unreachable
from serving.worker_channel import Channel
from tests.helpers import fails_to_serve


def _jobs(beir_dir) -> list[tuple[str, list[str]]]:
    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    topics = ["soy", "coffee", "rice", "meat"]
    return [(f"question {i} about {topics[i % 4]}", docs[i : i + 3 + i % 4]) for i in range(12)]


def _spawned(settings: Settings, tmp_path) -> tuple[multiprocessing.Process, Channel, dict]:
    """The reranker process as the supervisor starts it, once it says it is ready."""
    channel = Channel(tmp_path, os.urandom(32))
    context = multiprocessing.get_context("spawn")
    messages, sender = context.Pipe(duplex=False)
    process = context.Process(target=run_reranker, args=(channel, settings, sender, {"": logging.WARNING}))
    process.start()
    sender.close()
    assert messages.poll(120), "the reranker process did not say it was ready"
    kind, described = messages.recv()
    assert kind == "ready", described
    return process, channel, described


def _encodes_as_the_index_encoder(channel: Channel, described: dict, index_dir) -> None:
    """16 callers at once (``--shared-query-encoder on``): each gets its own row, the encoder's."""
    remote = RemoteQueryEncoder(ChannelTransport(channel, RERANKER, "reranker"), described["query_encoder"], 60)
    model = load_encoder(read_manifest(index_dir).encoder, "cpu")
    queries = [f"question {i} about {topic}" for i, topic in enumerate(["soy", "coffee", "rice", "meat"] * 4)]
    with ThreadPoolExecutor(max_workers=len(queries)) as pool:
        rows = list(pool.map(remote, queries))
    for query, row in zip(queries, rows, strict=True):
        assert row.shape == (1, model.get_embedding_dimension()) and row.dtype == np.float32
        assert row == pytest.approx(encode(model, [query]), abs=1e-5)  # batched or alone, the same row


def test_the_process_scores_each_callers_pairs_and_encodes_their_queries_as_one_process_does(
    index_dir, reranker_dir, beir_dir, tmp_path
):
    settings = Settings().with_values(
        index_dir=index_dir,
        device="cpu",
        reranker=reranker_dir,
        rerank_batch_wait_ms=200,
        rerank_batch_tokens=1 << 20,
        shared_query_encoder="on",
    )
    process, channel, described = _spawned(settings, tmp_path)
    try:
        assert described["device"] == "cpu" and described["max_length"] == 96
        assert described["query_encoder"] == "shared torch-cpu"
        shared = RemoteReranker(ChannelTransport(channel, RERANKER, "reranker"), described, settings.engine, 60)
        local = load_reranker(settings.engine, reranker_dir, "cpu", cache=False)  # as one process serves it
        assert shared.text_tokens.fingerprint == local.text_tokens.fingerprint  # the index's ids fit its pairs

        jobs = _jobs(beir_dir)
        alone = [local.score(q, p) for q, p in jobs]

        def from_ids(job: tuple[str, list[str]]) -> list[float]:  # as a worker makes them: from stored ids
            query, passages = job
            ids = [PassageTokens(t, len(p)) for t, p in zip(shared.text_tokens(passages), passages, strict=True)]
            return shared.score(query, passages, ids)

        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            together = list(pool.map(from_ids, jobs))
        # bf16 (a CPU that multiplies it natively) rounds a pair differently as its batch's padding
        # differs, and merged batches pad differently from one query's own
        tolerance = 1e-3 if described["running"]["precision"] == "bf16" else 1e-5
        for mine, reference in zip(together, alone, strict=True):
            assert mine == pytest.approx(reference, abs=tolerance)
        status = shared.status()
        assert status["reachable"] and status["pid"] == process.pid and status["batches"] < len(jobs)  # merged
        assert shared.score(*jobs[0]) == together[0]  # the worker's cache: no call at all
        assert shared.score("nothing", []) == []
        _encodes_as_the_index_encoder(channel, described, index_dir)
        status = shared.status()
        assert status["queries_encoded"] == 16 and 1 <= status["encode_batches"] <= 16

        process.kill()
        process.join()
        with pytest.raises(Unreachable):
            shared.score("soy after the process died", jobs[1][1])
        assert shared.status()["reachable"] is False
    finally:
        if process.is_alive():
            process.kill()
            process.join()


@pytest.fixture(scope="module")
def shared_server(index_dir, reranker_dir, tmp_path_factory):
    """``serve --workers 2`` with the reranker in a process of its own."""
    folder = tmp_path_factory.mktemp("shared-reranker")
    index = folder / "index"
    shutil.copytree(index_dir, index)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(index, port, "--workers", "2", "--reranker", reranker_dir, "--shared-reranker", "on")
    proc = start_server(args + ["--query-timeout", "20"], f"{url}/health", folder / "log")
    workers_up(url)
    yield {"url": url, "log": folder / "log"}
    assert stop_server(proc) == 0, "SIGTERM must stop the workers and the reranker process cleanly"
    assert "Traceback" not in (folder / "log").read_text()


def _search(client: httpx.Client, query: str) -> list[tuple[str, float]]:
    reply = client.post("/search", json={"query": query, "top_k": 5})
    assert reply.status_code == 200, reply.text
    return [(hit["doc_id"], hit["score"]) for hit in reply.json()["results"]]


@pytest.fixture(scope="module")
def alone(index_dir, reranker_dir):
    """The same index searched in this process: reranked by its own reranker, and not reranked."""
    from engine.search import HybridEngine
    from engine.settings import EngineSettings

    engines = {
        rerank: HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank=rerank))
        for rerank in (True, False)
    }
    yield {
        rerank: lambda query, e=engine: [(h.doc_id, h.score) for h in e.search(query, 5)]
        for rerank, engine in engines.items()
    }
    for engine in engines.values():
        engine.close()


def _same(served: list[tuple[str, float]], expected: list[tuple[str, float]]) -> None:
    assert [d for d, _ in served] == [d for d, _ in expected]
    assert [s for _, s in served] == pytest.approx([s for _, s in expected], abs=1e-5)


QUERIES = ("soy isoflavones prostate", "coffee and liver disease", "vitamin d bone", "rice arsenic")


@pytest.mark.slow
def test_workers_rerank_through_the_shared_process_as_one_process_would(shared_server, reranker_dir, alone):
    url = shared_server["url"]
    for role in ("writer", "follower"):
        client, health = worker_client(url, role)
        assert health["status"] == "ok" and health["reranker"] == reranker_dir, health
        assert health["reranker_process"]["reachable"] is True
        for query in QUERIES:
            _same(_search(client, query), alone[True](query))
        client.close()


@pytest.mark.slow
def test_a_killed_reranker_process_leaves_queries_answered_in_fused_order_and_comes_back(shared_server, alone):
    url = shared_server["url"]
    client, health = worker_client(url, "follower")
    before = health["reranker_process"]
    sigkill(before["pid"])
    asked = "soy isoflavones prostate, asked anew"  # no cached scores: the process is called
    _same(_search(client, asked), alone[False](asked))
    health = client.get("/health").json()
    assert health["status"] == "degraded" and health["reranker_process"]["reachable"] is False
    assert health["reranker_health"]["status"] == "failing"
    deadline = time.time() + 90
    while not (after := client.get("/health").json()["reranker_process"])["reachable"]:
        assert time.time() < deadline, "the supervisor did not start the reranker process again"
        time.sleep(0.5)
    assert after["pid"] != before["pid"]
    asked = "coffee and liver disease, asked anew"
    _same(_search(client, asked), alone[True](asked))
    assert client.get("/health").json()["status"] == "ok"
    client.close()


def test_a_reranker_that_cannot_load_stops_serve_with_its_reason(index_dir, tmp_path):
    args = serve_args(index_dir, free_port(), "--workers", "2", "--shared-reranker", "on")
    stderr = fails_to_serve(args + ["--reranker", str(tmp_path / "missing")])
    assert "hybrid-search: error: the reranker process" in stderr and "missing" in stderr
