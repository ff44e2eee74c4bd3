"""``serve --ray`` and ``build --ray`` on real local Ray clusters. First what needs no server: a
refusal before any cluster starts, the missing extra named, ``build --shards --ray`` giving the
local sharded build, the KubeRay manifest. Then one server for the rest: the tiny index in shards (a
deployment a shard, two replicas each, and a writer a shard), two search replicas and the reranker's
deployment, answering as the sharded index reranked in one process through every door; live writes
routed to their document's shard and seen by every replica; an acknowledged write surviving its
writer's death; a shard replica lost under load failing no search; a shard down said in the answer
and health."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from engine.rerank.cross_encoder import native_bf16
from engine.settings import EngineSettings
from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE, shard_dir, shard_of
from offline.server_process import ROOT, free_port, start_server, stop_server
from tests.conftest import SHARDS
from tests.helpers import a2a_v1_send, only_doc_ids

pytest.importorskip("ray", reason="the optional Ray extra is not installed (pip install -e '.[ray]')")
pytestmark = pytest.mark.slow  # a local Ray cluster

QUERIES = ["arsenic in rice", "soy and breast cancer", "broccoli sulforaphane", "red meat", "the of"]


# what needs no server first: the build's own local cluster is down before the server's starts


def test_more_replicas_than_the_local_cluster_can_place_is_refused(index_dir):
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", "--ray", "--index-dir", str(index_dir), "--device", "cpu"]
        + ["--search-replicas", "4", "--mcp-port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "need 5 CPUs" in run.stderr and "--replica-cpus" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("command", ["serve", "build"])
def test_without_ray_installed_the_cli_says_how_to_get_it(index_dir, command):
    code = (
        "import sys; sys.modules['ray'] = None; from cli.main import main;"
        f" sys.exit(main([{command!r}, '--ray', '--index-dir', {str(index_dir)!r}, '--device', 'cpu']))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "pip install 'hybrid-search[ray]'" in run.stderr, run.stderr[-2000:]


def test_default_serving_never_imports_ray():
    code = "import sys, cli.main, cli.serve, serving.app; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


def test_build_shards_on_ray_gives_the_local_sharded_build(beir_dir, sharded_index_dir, tmp_path):
    """The corpus encoded in four parts by one Ray Data pipeline (its actors write the vectors), then
    each shard built by a Ray task: the local sharded build's shards, rows and vectors (to float
    noise: a part's batches pad with other neighbours than one part's)."""
    import faiss
    import numpy as np

    target = tmp_path / "on-ray"
    command = [sys.executable, "-m", "cli.main", "build", "--ray", "--data", str(beir_dir), "--index-dir", str(target)]
    command += ["--device", "cpu", "--shards", str(SHARDS), "--part-chunks", "8"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "chunks on Ray: done, 4 parts" in run.stderr and f"shards on Ray: done, {SHARDS} shards" in run.stderr
    for i in range(SHARDS):
        local, on_ray = (faiss.read_index(str(shard_dir(d, i) / "dense.faiss")) for d in (sharded_index_dir, target))
        assert (faiss.vector_to_array(local.id_map) == faiss.vector_to_array(on_ray.id_map)).all()
        vectors = [ix.index.reconstruct_n(0, ix.ntotal) for ix in (local, on_ray)]
        assert np.allclose(*vectors, atol=1e-6)


def test_the_kuberay_manifest_names_an_application_that_builds(sharded_index_dir):
    """docs/kuberay-rayservice.yaml's serveConfigV2: its import path and args make the application
    (on the tiny sharded index in place of the manifest's volume)."""
    import importlib

    import yaml
    from ray.serve import Application

    manifest = yaml.safe_load((ROOT / "docs" / "kuberay-rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    module, _, name = app["import_path"].partition(":")
    built = getattr(importlib.import_module(module), name)({**app["args"], "index_dir": str(sharded_index_dir)})
    assert isinstance(built, Application)


# one server for the rest


@pytest.fixture(scope="module")
def served(sharded_index_dir, reranker_dir, tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("ray")
    index = work / "index"
    shutil.copytree(sharded_index_dir, index)  # the shards' writers change it
    args = ["serve", "--ray", "--index-dir", str(index), "--mcp-port", str(port), "--device", "cpu"]
    args += ["--reranker", reranker_dir, "--search-replicas", "2", "--shard-replicas", "2", "--replica-cpus", "0.1"]
    args += ["--shard-failure", "partial", "--shard-timeout", "2", "--warmup-searches", "300"]
    # a local Ray cluster starts slowly on cores the other test worker shares
    proc = start_server(args, f"http://127.0.0.1:{port}/health", work / "serve.log", timeout_s=600)
    yield {"url": f"http://127.0.0.1:{port}", "index": index}
    assert stop_server(proc) == 0, "SIGTERM must take the deployments down cleanly"


def _search(url: str, query: str, top_k: int = 5) -> dict:
    reply = httpx.post(f"{url}/search", json={"query": query, "top_k": top_k}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ids(url: str, query: str, top_k: int = 5) -> list[str]:
    return [h["doc_id"] for h in _search(url, query, top_k)["results"]]


@contextmanager
def _cluster():
    """This test process joined to the server's Ray cluster (the JVM's signal handlers kept)."""
    import ray

    from engine.retrieval.java import jvm_signals_kept

    with jvm_signals_kept():
        ray.init(address="auto", namespace="serve", logging_level="ERROR")
    try:
        yield ray
    finally:
        with jvm_signals_kept():
            ray.shutdown()


def _replicas(ray, deployment: str) -> list[str]:
    from serving.ray_app import APP_NAME

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n for n in names if n.startswith(f"SERVE_REPLICA::{APP_NAME}#{deployment}#"))


def test_ray_ranks_like_the_sharded_index_reranked_in_one_process(served, sharded_index_dir, reranker_dir):
    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=sharded_index_dir, device="cpu", reranker=reranker_dir))
    try:
        for query in QUERIES:
            local, answer = engine.search(query, 5), _search(served["url"], query)
            assert [h["doc_id"] for h in answer["results"]] == [h.doc_id for h in local], query
            assert [h["score"] for h in answer["results"]] == pytest.approx([h.score for h in local], abs=1e-4)
            assert "missing_shards" not in answer  # said only when a shard did not answer
        assert all(h.rerank_score is not None for h in local)  # so the deployment's scores are in the served ones
    finally:
        engine.close()


def test_ray_health_names_the_shards_and_the_reranker_deployment(served, reranker_dir):
    health = httpx.get(served["url"] + "/health").json()
    runtime = "torch-bf16" if native_bf16() else "onnx"  # rerank_quantize auto on this CPU
    assert health["reranker"] == reranker_dir and health["reranker_runtime"] == runtime
    assert health["writable"] is True and health["rerank_depth"] == 20 and health["status"] == "ok"
    assert health["documents"] == 32 and health["missing_shards"] == [] and len(health["shards"]) == SHARDS


def test_ray_mcp_and_a2a_doors_answer_the_same(served):
    from a2a.helpers.proto_helpers import new_data_part
    from mcp import Client

    url = served["url"]
    expected = _ids(url, "arsenic in rice")

    async def mcp_ids() -> list[list[str]]:
        async with Client(url + "/mcp") as client:  # stateless: each call may reach another replica
            calls = [await client.call_tool("search_nfcorpus", {"query": "arsenic in rice"}) for _ in range(3)]
        return [[r["doc_id"] for r in c.structured_content["results"]] for c in calls]

    assert asyncio.run(mcp_ids()) == [expected] * 3
    card = httpx.get(url + "/a2a/.well-known/agent-card.json").json()
    assert card["supportedInterfaces"][0]["url"] == url + "/a2a/"
    task = a2a_v1_send(url + "/a2a/", [new_data_part({"query": "arsenic in rice"})])
    assert only_doc_ids(task) == expected


def test_ray_pages_pinned_by_one_replica_are_read_by_any(served):
    """Eight pages of two, each request to whichever search replica Serve picks (all eight to the
    one that pinned: 1 in 128), are the one top-16 list (within the rerank depth of 20): the pins
    live in the pages deployment, not in a replica."""
    url = served["url"]
    whole = _ids(url, "arsenic in rice", 16)
    asked, pages = {"query": "arsenic in rice", "top_k": 2, "paginate": True}, []
    for _ in range(8):
        reply = httpx.post(f"{url}/search", json=asked, timeout=60)
        assert reply.status_code == 200, reply.text
        pages += [r["doc_id"] for r in reply.json()["results"]]
        asked["page_token"] = reply.json()["next_page_token"]
    assert pages == whole


def _doc(doc_id: str, text: str) -> dict:
    return {"document_id": doc_id, "chunks": [{"chunk_id": "c1", "content": text}]}


def _everywhere(url: str, query: str, tries: int = 8) -> set[bool]:
    """Whether each of several searches (spread over the replicas) ranked the live document written
    with ``query`` as its text first."""
    return {_search(url, query, 1)["results"][0]["text"] == query for _ in range(tries)}


def test_ray_live_writes_are_seen_by_every_replica(served):
    url = served["url"]
    created = httpx.post(f"{url}/documents?refresh=wait_for", json=_doc("live-1", "quokka marsupial diet"), timeout=60)
    assert created.status_code == 201, created.text
    assert _everywhere(url, "quokka marsupial diet") == {True}  # acknowledged after wait_for: on every replica
    assert httpx.get(f"{url}/documents/live-1").json()["chunks"][0]["content"] == "quokka marsupial diet"

    httpx.post(f"{url}/documents", json=_doc("live-2", "wombat burrow soil"), timeout=60).raise_for_status()
    deadline = time.time() + 30  # no wait: searchable within the writer's refresh interval (1 s)
    while _everywhere(url, "wombat burrow soil") != {True} and time.time() < deadline:
        time.sleep(0.2)
    assert _everywhere(url, "wombat burrow soil") == {True}

    assert httpx.delete(f"{url}/documents/live-1?refresh=wait_for", timeout=60).json()["deleted_chunks"] == 1
    assert _everywhere(url, "quokka marsupial diet") == {False}
    missing = httpx.delete(f"{url}/documents/live-1", timeout=60)
    assert missing.status_code == 404 and "live-1" in missing.json()["error"], missing.text


def test_writes_go_to_their_documents_shard_and_every_search_finds_them(served):
    url, index = served["url"], served["index"]
    ids = [f"okapi-{i}" for i in range(6)]
    assert len({shard_of(d, SHARDS) for d in ids}) > 1
    for doc_id in ids:
        body = {"document_id": doc_id, "chunks": [{"chunk_id": doc_id, "content": f"okapi forest giraffe {doc_id}"}]}
        assert httpx.post(f"{url}/documents?refresh=wait_for", json=body, timeout=60).status_code == 201
    for _ in range(20):  # any search replica, any shard replica: every one shows the writes (in the
        assert set(ids) <= set(_ids(url, "okapi forest giraffe", 20))  # reranked head, whatever its order)
    for doc_id in ids:
        assert httpx.get(f"{url}/documents/{doc_id}").json()["document_id"] == doc_id
        held = [DocStore(shard_dir(index, i) / DOCS_FILE).document(doc_id) is not None for i in range(SHARDS)]
        assert held == [i == shard_of(doc_id, SHARDS) for i in range(SHARDS)], doc_id  # its shard's store alone
    gone = httpx.delete(f"{url}/documents/{ids[0]}?refresh=wait_for", timeout=60)
    assert gone.status_code == 200
    assert ids[0] not in _ids(url, "okapi forest giraffe", 20)


def test_ray_acknowledged_write_survives_the_writer_replica_dying(served):
    """A write acknowledged without waiting, then its shard's writer replica killed: Serve starts
    another, which replays the log, and the document is there (read back, then searchable on every
    replica). Until the writer is back a read of it is a 503 saying so, with when to retry."""
    url = served["url"]
    httpx.post(f"{url}/documents", json=_doc("durable-1", "axolotl gill regeneration"), timeout=60).raise_for_status()
    with _cluster() as ray:
        (writer,) = _replicas(ray, f"writer-{shard_of('durable-1', SHARDS)}")
        ray.kill(ray.get_actor(writer, namespace="serve"), no_restart=True)
    deadline = time.time() + 240  # a replica's start, on cores the other test worker shares
    while (read := httpx.get(f"{url}/documents/durable-1", timeout=120)).status_code == 503 and time.time() < deadline:
        assert "restarting" in read.json()["error"] and int(read.headers["retry-after"]) > 0, read.text
        time.sleep(1)
    assert read.status_code == 200 and read.json()["chunks"][0]["content"] == "axolotl gill regeneration", read.text
    deadline = time.time() + 60
    while _everywhere(url, "axolotl gill regeneration") != {True} and time.time() < deadline:
        time.sleep(0.5)
    assert _everywhere(url, "axolotl gill regeneration") == {True}


def test_a_shard_replica_killed_under_load_fails_no_search(served):
    url, failures, answered = served["url"], [], []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            reply = httpx.post(f"{url}/search", json={"query": "soy and breast cancer", "top_k": 5}, timeout=60)
            body = reply.json()
            if reply.status_code == 200 and "missing_shards" not in body:
                answered.append(time.monotonic())
            else:
                failures.append(body)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2)
        with _cluster() as ray:
            ray.kill(ray.get_actor(_replicas(ray, "shard-0")[0], namespace="serve"), no_restart=True)
        killed = time.monotonic()
        time.sleep(5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    # every search answered whole, and searches kept being answered after the kill (as many as the
    # cores allow: the count is not a speed)
    assert not failures and sum(t > killed for t in answered) >= len(threads)


def test_a_shard_down_is_said_in_the_answer_and_health(served):
    """Every replica of shard 1 killed while its folder is away (Serve cannot start another): the
    answer comes from the other shards, and says so, as /health does. The module's last use of the
    server: its shard 1 stays down."""
    url, away = served["url"], shard_dir(served["index"], 1).with_name("1.away")
    shard_dir(served["index"], 1).rename(away)
    try:
        with _cluster() as ray:
            for name in _replicas(ray, "shard-1"):
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        answer = _search(url, "soy and breast cancer", 8)
        health = httpx.get(url + "/health", timeout=60).json()
    finally:
        away.rename(shard_dir(served["index"], 1))
    assert answer["missing_shards"] == [1] and answer["results"]
    assert all(shard_of(h["document_id"], SHARDS) != 1 for h in answer["results"])
    assert health["status"] == "degraded" and health["missing_shards"] == [1]
