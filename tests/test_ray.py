"""``serve --ray`` on a real local Ray cluster: the same answers through every door as the single
process (``build --ray``, its encoding on Ray Data and its shards as Ray tasks: tests/test_ray_shards.py)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from engine.rerank.cross_encoder import native_bf16
from engine.settings import EngineSettings
from offline.server_process import ROOT, free_port, start_server, stop_server
from tests.helpers import a2a_v1_send, only_doc_ids

pytest.importorskip("ray", reason="the optional Ray extra is not installed (pip install -e '.[ray]')")
pytestmark = pytest.mark.slow  # a local Ray cluster per test module

QUERIES = ["arsenic in rice", "soy and breast cancer", "broccoli sulforaphane", "red meat"]


@pytest.fixture(scope="module")
def ray_server(index_dir, reranker_dir, tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("ray")
    log, index = work / "serve.log", work / "index"
    shutil.copytree(index_dir, index)  # the writer deployment changes it
    args = ["serve", "--ray", "--index-dir", str(index), "--mcp-port", str(port), "--device", "cpu"]
    args += ["--reranker", reranker_dir, "--search-replicas", "2", "--replica-cpus", "0.5"]
    # a local Ray cluster starts slowly on cores the other test worker shares
    proc = start_server(args, f"http://127.0.0.1:{port}/health", log, timeout_s=600)
    yield {"url": f"http://127.0.0.1:{port}", "log": log}
    assert stop_server(proc) == 0, "SIGTERM must take the deployment down cleanly"


def _rest(url: str, query: str, top_k: int = 5) -> list[dict]:
    reply = httpx.post(url + "/search", json={"query": query, "top_k": top_k}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["results"]


def test_ray_ranks_like_the_single_process(ray_server, index_dir, reranker_dir):
    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir))
    for query in QUERIES:
        local = engine.search(query, 5)
        served = _rest(ray_server["url"], query)
        assert [h["doc_id"] for h in served] == [h.doc_id for h in local], query
        assert [h["score"] for h in served] == pytest.approx([h.score for h in local], abs=1e-4)
        assert all(h.rerank_score is not None for h in local)  # so the deployment's scores are in the served ones


def test_ray_health_names_the_reranker_deployment(ray_server, reranker_dir):
    health = httpx.get(ray_server["url"] + "/health").json()
    runtime = "torch-bf16" if native_bf16() else "onnx"  # rerank_quantize auto on this CPU
    assert health["reranker"] == reranker_dir and health["reranker_runtime"] == runtime
    assert health["writable"] is True and health["rerank_depth"] == 20 and health["status"] == "ok"
    assert health["follower"]["checkpoint"] == 0  # the built index, no write yet


def test_ray_mcp_and_a2a_doors_answer_the_same(ray_server):
    from a2a.helpers.proto_helpers import new_data_part
    from mcp import Client

    url = ray_server["url"]
    expected = [h["doc_id"] for h in _rest(url, "arsenic in rice")]

    async def mcp_ids() -> list[list[str]]:
        async with Client(url + "/mcp") as client:  # stateless: each call may reach another replica
            calls = [await client.call_tool("search_nfcorpus", {"query": "arsenic in rice"}) for _ in range(3)]
        return [[r["doc_id"] for r in c.structured_content["results"]] for c in calls]

    assert asyncio.run(mcp_ids()) == [expected] * 3
    card = httpx.get(url + "/a2a/.well-known/agent-card.json").json()
    assert card["supportedInterfaces"][0]["url"] == url + "/a2a/"
    task = a2a_v1_send(url + "/a2a/", [new_data_part({"query": "arsenic in rice"})])
    assert only_doc_ids(task) == expected


def _doc(doc_id: str, text: str) -> dict:
    return {"document_id": doc_id, "chunks": [{"chunk_id": "c1", "content": text}]}


def _everywhere(url: str, query: str, tries: int = 8) -> set[bool]:
    """Whether each of several searches (spread over the replicas) ranked the live document written
    with ``query`` as its text first."""
    return {_rest(url, query, 1)[0]["text"] == query for _ in range(tries)}


def test_ray_live_writes_are_seen_by_every_replica(ray_server):
    url = ray_server["url"]
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
    assert httpx.get(f"{url}/health").json()["follower"]["write"] >= 3  # published writes, no checkpoint needed


def test_ray_acknowledged_write_survives_the_writer_replica_dying(ray_server):
    """A write acknowledged without waiting, then the writer replica killed: Serve starts another,
    which replays the log, and the document is there (read back, then searchable on every replica)."""
    import ray

    from engine.retrieval.java import jvm_signals_kept
    from serving.ray_app import APP_NAME

    url = ray_server["url"]
    httpx.post(f"{url}/documents", json=_doc("durable-1", "axolotl gill regeneration"), timeout=60).raise_for_status()
    with jvm_signals_kept():  # this test process runs a JVM (the engine fixtures): Ray must not take its handlers
        ray.init(address="auto", namespace="serve", logging_level="ERROR")
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        writer = next(n for n in names if n.startswith(f"SERVE_REPLICA::{APP_NAME}#writer#"))
        ray.kill(ray.get_actor(writer, namespace="serve"), no_restart=True)
    finally:
        with jvm_signals_kept():
            ray.shutdown()
    read = httpx.get(f"{url}/documents/durable-1", timeout=120)  # held by Serve until a writer runs again
    assert read.status_code == 200 and read.json()["chunks"][0]["content"] == "axolotl gill regeneration", read.text
    deadline = time.time() + 60
    while _everywhere(url, "axolotl gill regeneration") != {True} and time.time() < deadline:
        time.sleep(0.5)
    assert _everywhere(url, "axolotl gill regeneration") == {True}


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
