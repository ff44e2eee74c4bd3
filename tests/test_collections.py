"""``serve --indexes DIR``: collections served by name, aliases swapped under running searches,
made, built in the background and dropped, through REST, the official MCP client and the A2A card."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from offline.server_process import CLI, ROOT, free_port, start_server, stop_server, wait_until_up
from tests.helpers import a2a_v1_send, fails_to_serve, only_doc_ids

FAST = ["--device", "cpu", "--warmup-searches", "0", "--rerank-depth", "4", "--query-timeout", "30"]


@pytest.fixture(scope="module")
def collections_dir(index_dir, reranker_dir, tmp_path_factory):
    """Two copies of the tiny index, each holding its own copy of one reranker (shared when served)."""
    root = tmp_path_factory.mktemp("collections")
    for name in ("alpha", "beta"):
        shutil.copytree(index_dir, root / name)
        shutil.copytree(reranker_dir, root / name / "reranker")
    return root


@pytest.fixture(scope="module")
def served(collections_dir, tmp_path_factory):
    mcp_port, a2a_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("logs") / "collections.log"
    args = ["serve", "--indexes", str(collections_dir), "--mcp-port", str(mcp_port), "--a2a-port", str(a2a_port)]
    proc = start_server([*args, *FAST], f"http://127.0.0.1:{mcp_port}/health", log)
    wait_until_up(f"http://127.0.0.1:{a2a_port}/")
    with httpx.Client(base_url=f"http://127.0.0.1:{mcp_port}", timeout=60) as http:
        yield {"http": http, "mcp": f"http://127.0.0.1:{mcp_port}", "a2a": f"http://127.0.0.1:{a2a_port}", "log": log}
    assert stop_server(proc) == 0
    assert "Traceback" not in log.read_text()


ZEBRA = {"document_id": "Z-1", "chunks": [{"chunk_id": "c1", "content": "okapi zebra giraffe savanna"}]}


def _zebra_in_beta(http: httpx.Client) -> httpx.Response:
    """A document only the collection beta holds (written again: the same, replaced whole)."""
    return http.post("/collections/beta/documents?refresh=wait_for", json=ZEBRA)


def _search(http: httpx.Client, path: str, query: str = "vitamin D falls", top_k: int = 3) -> httpx.Response:
    return http.post(path, json={"query": query, "top_k": top_k})


def test_each_collection_is_listed_with_its_size_and_health_and_the_models_are_loaded_once(served):
    listed = served["http"].get("/collections").json()
    by_name = {c["name"]: c for c in listed["collections"]}
    assert {"alpha", "beta"} <= set(by_name)
    for name in ("alpha", "beta"):
        assert by_name[name]["documents"] == 32 and by_name[name]["status"] == "ok"
        assert by_name[name]["description"] and by_name[name]["bytes"] > 0
    models = {m["kind"]: m for m in listed["models"]}
    # two copies of one reranker, at two paths: one model, used by both
    assert {"alpha", "beta"} <= set(models["reranker"]["collections"])
    assert {"alpha", "beta"} <= set(models["query_encoder"]["collections"])
    assert served["http"].get("/collections/gamma").json() == {
        "error": "no collection 'gamma'; GET /collections lists them"
    }


def test_todays_routes_serve_the_default_alias_and_every_route_works_per_collection(served):
    http = served["http"]
    http.delete("/aliases/default")
    missing = _search(http, "/search_nfcorpus")
    assert missing.status_code == 404 and "no default collection" in missing.json()["error"]
    assert http.put("/aliases/default", json={"collection": "alpha"}).json()["collection"] == "alpha"
    today = _search(http, "/search_nfcorpus")
    assert today.status_code == 200 and today.headers["x-collection"] == "alpha"
    assert today.json()["results"][0]["doc_id"].startswith("D-vitamin")
    per = _search(http, "/collections/beta/search")
    assert per.status_code == 200 and per.headers["x-collection"] == "beta"
    assert _search(http, "/collections/default/search_nfcorpus").headers["x-collection"] == "alpha"  # an alias
    unknown = _search(http, "/collections/nope/search")
    assert unknown.status_code == 404 and "'nope'" in unknown.json()["error"]
    assert http.get("/collections/beta/health").json()["index_dir"].endswith("beta")
    health = http.get("/health").json()
    assert health["default_collection"] == "alpha" and {"alpha", "beta"} <= set(health["collections"])


def test_documents_are_written_to_the_collection_named(served):
    http = served["http"]
    assert _zebra_in_beta(http).status_code in (200, 201)
    assert http.get("/collections/beta/documents/Z-1").json()["document_id"] == "Z-1"
    assert http.get("/collections/alpha/documents/Z-1").status_code == 404
    hits = _search(http, "/collections/beta/search_nfcorpus", "okapi zebra", 1).json()["results"]
    assert hits[0]["doc_id"].startswith("Z-1")  # a chunk's id: Z-1#c1
    assert all(
        not h["doc_id"].startswith("Z-1")
        for h in _search(http, "/collections/alpha/search_nfcorpus", "okapi zebra").json()["results"]
    )


def test_an_alias_swap_under_concurrent_searches_fails_none_and_later_searches_see_the_new(served, collections_dir):
    http, base = served["http"], served["mcp"]
    assert http.put("/aliases/live", json={"collection": "alpha"}).status_code == 200
    answers: list[tuple[float, int, str]] = []  # (started, status, collection)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=base, timeout=60) as own:
            while not stop.is_set():
                started = time.monotonic()
                reply = _search(own, "/collections/live/search_nfcorpus", "coffee liver", 3)
                answers.append((started, reply.status_code, reply.headers.get("x-collection", "")))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    while sum(1 for a in answers) < 12:
        time.sleep(0.05)
    swapped = http.put("/aliases/live", json={"collection": "beta"})
    acknowledged = time.monotonic()
    assert swapped.json() == {"alias": "live", "collection": "beta", "previous": "alpha"}
    while sum(1 for a in answers if a[0] > acknowledged) < 12:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join()
    assert all(status == 200 for _, status, _ in answers)
    assert {c for started, _, c in answers if started > acknowledged} == {"beta"}
    assert "alpha" in {c for started, _, c in answers if started < acknowledged}
    assert json.loads((collections_dir / "aliases.json").read_text())["aliases"]["live"] == "beta"  # survives a restart


def test_a_collection_is_made_empty_written_and_dropped_and_an_aliased_one_is_kept(served, collections_dir):
    http = served["http"]
    made = http.post("/collections", json={"name": "scratch"})
    assert made.status_code == 201 and made.json()["documents"] == 0
    assert http.post("/collections", json={"name": "scratch"}).status_code == 409
    assert http.post("/collections", json={"name": "../etc"}).status_code == 422
    document = {"document_id": "S-1", "chunks": [{"chunk_id": "c1", "content": "a lone note about kelp"}]}
    assert http.post("/collections/scratch/documents?refresh=wait_for", json=document).status_code == 201
    found = _search(http, "/collections/scratch/search_nfcorpus", "kelp", 1).json()["results"]
    assert found[0]["doc_id"].startswith("S-1")
    http.put("/aliases/pinned", json={"collection": "scratch"})
    refused = http.delete("/collections/scratch")
    assert refused.status_code == 409 and "'pinned'" in refused.json()["error"]
    http.delete("/aliases/pinned")
    assert http.delete("/collections/scratch").json() == {"dropped": "scratch", "running": 0}
    assert _search(http, "/collections/scratch/search").status_code == 404
    assert not (collections_dir / "scratch").exists()


def test_a_folder_made_by_the_cli_is_served_from_its_first_request(served, collections_dir):
    run = subprocess.run(
        [*CLI, "init", "--index-dir", str(collections_dir / "from_cli")], cwd=ROOT, capture_output=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    health = served["http"].get("/collections/from_cli/health")
    assert health.status_code == 200 and health.headers["x-collection"] == "from_cli"
    assert health.json()["documents"] == 0


def test_a_collection_is_built_from_a_folder_in_the_background_with_its_progress(served, beir_dir):
    http = served["http"]
    started = http.post("/collections", json={"name": "built", "data": str(beir_dir)})
    assert started.status_code == 202
    job = started.json()
    assert started.headers["location"] == f"/jobs/{job['id']}" and job["state"] == "running"
    seen, deadline = [], time.time() + 240
    while job["state"] == "running" and time.time() < deadline:
        time.sleep(0.2)
        job = http.get(f"/jobs/{job['id']}").json()
        seen.append(job)
    assert job["state"] == "done", job
    assert any(j["stage"] and j["total"] for j in seen)  # a stage with its progress, read while it ran
    assert _search(http, "/collections/built/search_nfcorpus", "soy isoflavones", 1).json()["results"]
    assert http.get("/jobs/build-999-x").status_code == 404
    refused = http.post("/collections", json={"name": "nowhere", "data": "/no/such/folder"})
    assert refused.status_code == 422 and "not a folder" in refused.json()["error"]


def test_mcp_lists_the_collections_and_searches_each(served):
    from mcp import Client

    http = served["http"]
    http.put("/aliases/default", json={"collection": "alpha"})
    _zebra_in_beta(http)

    async def run():
        async with Client(served["mcp"] + "/mcp") as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools[SEARCH_TOOL].input_schema["properties"]) == {"query", "top_k"}  # as ever
            assert "collection" in tools["search"].input_schema["properties"]
            listed = (await client.call_tool("list_collections", {})).structured_content
            names = {c["name"] for c in listed["collections"]}
            assert {"alpha", "beta"} <= names and listed["default"] == "alpha"
            resource = json.loads((await client.read_resource("collections://")).contents[0].text)
            assert {c["name"] for c in resource["collections"]} == names
            for name in ("alpha", "beta"):
                found = await client.call_tool("search", {"query": "okapi zebra", "top_k": 1, "collection": name})
                assert not found.is_error
                top = found.structured_content["results"][0]["document_id"]
                assert (top == "Z-1") == (name == "beta")  # only beta holds the document written to it
            plain = await client.call_tool(SEARCH_TOOL, {"query": "vitamin D falls", "top_k": 2})
            assert plain.structured_content["results"][0]["doc_id"].startswith("D-vitamin")
            unknown = await client.call_tool("search", {"query": "x", "collection": "nope"})
            assert unknown.is_error and "'nope'" in unknown.content[0].text

    asyncio.run(run())


def test_the_a2a_card_lists_one_skill_per_collection_and_a_message_names_one(served):
    from a2a.helpers.proto_helpers import new_data_part

    served["http"].put("/aliases/default", json={"collection": "alpha"})
    _zebra_in_beta(served["http"])
    card = httpx.get(served["a2a"] + "/.well-known/agent-card.json").json()
    ids = [skill["id"] for skill in card["skills"]]
    assert ids[0] == "nfcorpus_retrieval" and "retrieval.beta" in ids and "retrieval.alpha" not in ids
    beta = only_doc_ids(a2a_v1_send(served["a2a"], [new_data_part({"query": "okapi zebra", "collection": "beta"})]))
    assert beta[0].startswith("Z-1")
    alpha = only_doc_ids(a2a_v1_send(served["a2a"], [new_data_part({"query": "okapi zebra"})]))
    assert not any(doc_id.startswith("Z-1") for doc_id in alpha)


@pytest.mark.parametrize("extra", [["--workers", "2"], ["--ray"]])
def test_workers_and_ray_refuse_collections_naming_what_to_use(collections_dir, extra):
    said = fails_to_serve(["serve", "--indexes", str(collections_dir), "--mcp-port", str(free_port()), *extra])
    assert "--indexes serves its collections in one process" in said and extra[0] in said


def test_indexes_must_be_a_directory(tmp_path):
    said = fails_to_serve(["serve", "--indexes", str(tmp_path / "none"), "--mcp-port", str(free_port())])
    assert "not a directory" in said


def test_a_dropped_collection_closes_when_its_last_lease_ends(index_dir, tmp_path):
    """The lease a search holds keeps the collection it reached open through a swap and a drop."""
    from serving.collections import Collections, UnknownCollection
    from serving.settings import Settings

    root = tmp_path / "dir"
    for name in ("old", "new"):
        shutil.copytree(index_dir, root / name)
    settings = Settings.load(indexes=root, device="cpu", warmup_searches=0, rerank=False)
    collections = Collections(settings, writable=True, app_for=lambda service: None)
    try:
        collections.set_alias("docs", "old")
        with collections.lease("docs") as running:
            collections.set_alias("docs", "new")
            with collections.lease("docs") as after:
                assert after.name == "new"
            assert collections.drop("old") == {"dropped": "old", "running": 1}
            with pytest.raises(UnknownCollection):
                collections.lease("old").__enter__()
            assert running.engine.search("vitamin D falls", 1)[0].doc_id.startswith("D-vitamin")  # still open
            assert (root / "old").is_dir()
        deadline = time.time() + 60
        while (root / "old").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert not (root / "old").exists()  # closed and deleted once its last lease ended
    finally:
        collections.close()


SEARCH_TOOL = "search_nfcorpus"
