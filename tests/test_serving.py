"""Real servers on 127.0.0.1, driven by the official MCP and A2A clients and plain HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator

import httpx
import pytest

from engine.settings import EngineSettings
from offline.door_load import a2a_v03_send, bench_http
from offline.server_process import ROOT, free_port, serve_args, start_server, stop_server
from tests.helpers import a2a_v1_send, only_doc_ids

A2A_V03_PYTHON = ROOT / ".venv-a2a03" / "bin" / "python"


# ---------------------------------------------------------------- REST and health


def test_bench_drives_each_door_and_says_why_requests_failed(server):
    queries = ["soy milk", "coffee caffeine", "vitamin d"]
    for door, url in (("rest", server["mcp"] + "/search_nfcorpus"), ("a2a", server["a2a"] + "/")):
        run = bench_http(door, url, queries, [2], top_k=2)["runs"][0]
        assert run["errors"] == 0 and "error_kinds" not in run and run["qps"] > 0, (door, run)
    wrong = bench_http("rest", server["mcp"] + "/no_such_tool", queries, [1], top_k=2)["runs"][0]
    assert wrong["errors"] == 3 and "404" in next(iter(wrong["error_kinds"])), wrong


def test_health_and_metrics(server):
    health = httpx.get(server["mcp"] + "/health").json()
    assert health["index_loaded"] is True and health["documents"] == 32 and health["device"] == "cpu"
    assert health["dense_search"] == "faiss-cpu" and health["reranker"] is None and health["rerank_depth"] == 0
    from serving.settings import Settings

    # Lucene warmed before serving, as many searches as configured (the tests' conftest: 50)
    assert health["warmup"]["searches"] == Settings().engine.warmup_searches > 0
    httpx.post(server["mcp"] + "/search_nfcorpus", json={"query": "soy", "top_k": 2})
    metrics = httpx.get(server["mcp"] + "/metrics").text
    assert (
        'search_requests_total{door="rest"}' in metrics
        and 'search_stage_seconds_bucket{le="0.001",stage="bm25"}' in metrics
    )


def test_rest_search_returns_full_results(server):
    reply = httpx.post(server["mcp"] + "/search_nfcorpus", json={"query": "markercoffee2 caffeine", "top_k": 4})
    assert reply.status_code == 200 and reply.headers["x-request-id"]
    results = reply.json()["results"]
    assert len(results) == 4 and results[0]["doc_id"].startswith("D-coffee")
    assert set(results[0]) == {"doc_id", "score", "title", "text"}
    assert "markercoffee" in " ".join(r["text"] for r in results)


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"not json", 400, "body must be JSON"),
        (json.dumps({"top_k": 3}).encode(), 422, "query: Field required"),
        (json.dumps({"query": "x", "top_k": 0}).encode(), 422, "top_k: Input should be greater than or equal to 1"),
        (json.dumps({"query": "x", "top_k": "five"}).encode(), 422, "top_k: Input should be a valid integer"),
        (json.dumps({"query": "x" * 4001}).encode(), 422, "query: String should have at most 4000 characters"),
        (json.dumps(["query"]).encode(), 422, "expected a JSON object"),
    ],
)
def test_rest_bad_input(server, body, status, message):
    reply = httpx.post(server["mcp"] + "/search_nfcorpus", content=body)
    assert reply.status_code == status and message in reply.json()["error"]
    assert httpx.get(server["mcp"] + "/health").status_code == 200


def test_openapi_documents_every_rest_route_it_is_served_beside(index_dir, tmp_path):
    """One route table makes both: no route served undocumented (but the document's own), none documented unserved."""
    from starlette.testclient import TestClient

    from serving.app import http_app
    from serving.search_service import SearchService
    from serving.settings import Settings

    service = SearchService(Settings(index_dir=index_dir, device="cpu", trace_db=tmp_path / "traces.sqlite"))
    try:
        app = http_app(service, mcp=False)
        document = TestClient(app).get("/openapi.json").json()
    finally:
        service.close()
    served = {(method.lower(), route.path_format) for route in app.routes for method in route.methods - {"HEAD"}}
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert served - documented == {("get", "/openapi.json")} and documented <= served
    assert document["paths"]["/documents/{document_id}"]["delete"]["parameters"][0]["name"] == "document_id"


def test_32_concurrent_requests_each_get_their_own_answer(server):
    topics = ["vitamin", "statin", "soy", "coffee", "broccoli", "arsenic", "meat", "berries"]
    requests = [{"query": f"{topics[i % 8]} marker{topics[i % 8]}{i % 4}", "top_k": 3 + i % 3} for i in range(32)]
    url = server["mcp"] + "/search_nfcorpus"
    alone = [[r["doc_id"] for r in httpx.post(url, json=body, timeout=60).json()["results"]] for body in requests]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            replies = await asyncio.gather(*(client.post(url, json=body) for body in requests))
        return [[r["doc_id"] for r in reply.json()["results"]] for reply in replies]

    together = asyncio.run(all_at_once())
    assert together == alone
    assert [len(ids) for ids in together] == [body["top_k"] for body in requests]


# ---------------------------------------------------------------- MCP


def _check_tool_listing(tools):
    tool = next(t for t in tools.tools if t.name == "search_nfcorpus")
    props = tool.input_schema["properties"]
    assert tool.input_schema["required"] == ["query"]
    assert props["query"]["type"] == "string" and props["query"]["maxLength"] == 4000
    assert props["top_k"]["minimum"] == 1 and props["top_k"]["maximum"] == 100 and props["top_k"]["default"] == 5
    assert "results" in tool.output_schema["properties"]
    assert tool.description == "Find the tiny documents most relevant to a plain-English query."  # the index's name


async def _exercise_mcp(client):
    _check_tool_listing(await client.list_tools())
    result = await client.call_tool("search_nfcorpus", {"query": "markerberries1 memory", "top_k": 3})
    assert not result.is_error
    results = result.structured_content["results"]
    assert len(results) == 3 and all(r["doc_id"].startswith("D-berries") for r in results)
    assert set(results[0]) == {"doc_id", "score", "title", "text"}
    marked = next(r for r in results if r["doc_id"] == "D-berries-1")
    assert marked["title"] == "Berries report 1" and "markerberries1" in marked["text"]
    bad = await client.call_tool("search_nfcorpus", {"query": "x", "top_k": 500})
    assert bad.is_error and "top_k" in " ".join(c.text for c in bad.content)
    again = await client.call_tool("search_nfcorpus", {"query": "soy"})
    assert len(again.structured_content["results"]) == 5


def test_mcp_over_streamable_http(server):
    from mcp import Client

    async def run():
        async with Client(server["mcp"] + "/mcp") as client:
            await _exercise_mcp(client)

    asyncio.run(run())


def test_mcp_search_then_read_the_whole_document(server):
    """An agent searches, then reads what it found: each hit names its document's resource URI."""
    from mcp import Client
    from mcp.shared.exceptions import MCPError

    async def run():
        async with Client(server["mcp"] + "/mcp") as client:
            templates = await client.list_resource_templates()
            assert [t.uri_template for t in templates.resource_templates] == ["document://{document_id}"]
            found = await client.call_tool("search", {"query": "blueberries memory", "top_k": 1})
            hit = found.structured_content["results"][0]
            assert hit["document_id"].startswith("D-berries")
            assert hit["resource_uri"] == "document://" + hit["document_id"]
            read = await client.read_resource(hit["resource_uri"])
            whole = json.loads(read.contents[0].text)
            assert read.contents[0].mime_type == "application/json"
            assert whole["document_id"] == hit["document_id"] and whole["chunks"][0]["content"].endswith(hit["text"])
            with pytest.raises(MCPError) as missing:
                await client.read_resource("document://no-such-document")
            assert missing.value.code == -32602 and missing.value.data == {"uri": "document://no-such-document"}
            prompts = await client.list_prompts()
            assert [p.name for p in prompts.prompts] == ["answer_from_documents"]
            prompt = await client.get_prompt("answer_from_documents", {"question": "is soy safe?"})
            text = prompt.messages[0].content.text
            assert "is soy safe?" in text and "resource_uri" in text
            with pytest.raises(MCPError) as unknown:
                await client.get_prompt("no_such_prompt", {})
            assert unknown.value.code == -32602

    asyncio.run(run())


def _sse(lines: Iterable[str]) -> Iterator[dict]:
    """Server-sent events as dicts of their fields (``id``, ``data``, ``retry``), read from ``lines``
    until a blank line ends each event; a live stream is read only as far as the caller takes."""
    event: dict = {}
    for line in lines:
        if not line:
            if event:
                yield event
            event = {}
            continue
        field, _, value = line.partition(":")
        event[field] = value.removeprefix(" ")


_POSTS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


def _mcp_session(http: httpx.Client, url: str) -> dict:
    """Open a session over raw HTTP; the headers its requests carry."""
    hello = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    opened = http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}, headers=_POSTS)
    session = {"mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-11-25"}
    http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=_POSTS | session)
    return session


def _mcp_search(http: httpx.Client, url: str, session: dict, request_id: int, top_k: int = 2) -> tuple[dict, dict]:
    """One search tool call's stream: its priming event and its answer."""
    call = {"name": "search_nfcorpus", "arguments": {"query": "soy prostate", "top_k": top_k}}
    reply = http.post(
        url, json={"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": call}, headers=_POSTS | session
    )
    priming, *_, answer = list(_sse(reply.text.splitlines() + [""]))
    return priming, answer


def _resumed(http: httpx.Client, url: str, session: dict, last_event_id: str) -> dict | None:
    """The first event replayed to a client resuming after ``last_event_id`` (priming ones left out),
    or None when the stream ends without one (the store no longer has that event)."""
    resume = session | {"accept": "text/event-stream", "last-event-id": last_event_id}
    with http.stream("GET", url, headers=resume) as resumed:
        return next((event for event in _sse(resumed.iter_lines()) if event.get("data")), None)


def test_an_mcp_stream_that_dropped_resumes_with_last_event_id(server):
    url = server["mcp"] + "/mcp"
    with httpx.Client(timeout=60) as http:
        session = _mcp_session(http, url)
        priming, answer = _mcp_search(http, url, session, 2)
        assert priming["data"] == "" and priming["retry"] == "1000" and priming["id"]
        assert json.loads(answer["data"])["result"]["structuredContent"]["results"]
        # as if the stream had dropped right after its priming event: the client resumes from there
        replayed = _resumed(http, url, session, priming["id"])
        assert json.loads(replayed["data"]) == json.loads(answer["data"])


def test_the_mcp_resume_store_keeps_the_newest_answers_within_its_bytes(index_dir, tmp_path, monkeypatch):
    budget = 16 << 10
    monkeypatch.setenv("HYBRID_SEARCH_MCP_RESUME_BYTES", str(budget))
    port = free_port()
    args = serve_args(index_dir, port, "--read-only", "--trace-db", str(tmp_path / "t.sqlite"))
    proc = start_server(args, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        with httpx.Client(timeout=60) as http:
            session = _mcp_session(http, url)
            first, answer = _mcp_search(http, url, session, 2, top_k=10)
            assert 2 * len(answer["data"]) < budget  # one answer fits, with room to spare
            for request_id in range(3, 4 + budget // len(answer["data"])):  # more answers than fit
                last, answer = _mcp_search(http, url, session, request_id, top_k=10)
            assert _resumed(http, url, session, first["id"]) is None  # the oldest went first
            assert json.loads(_resumed(http, url, session, last["id"])["data"]) == json.loads(answer["data"])
    finally:
        assert stop_server(proc) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_mcp_over_stdio(index_dir):
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "cli.main", "mcp-stdio", "--index-dir", str(index_dir), "--device", "cpu"],
        cwd=str(ROOT),
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )

    async def run():
        # the SDK's default error log is whatever sys.stderr was at import; pytest may have swapped it
        async with Client(stdio_client(params, errlog=sys.__stderr__), read_timeout_seconds=120) as client:
            await _exercise_mcp(client)

    asyncio.run(run())


# ---------------------------------------------------------------- A2A


def test_agent_card_at_well_known_path_and_root(server):
    for path in ("/.well-known/agent-card.json", "/"):
        card = httpx.get(server["a2a"] + path).json()
        assert card["skills"][0]["id"] == "nfcorpus_retrieval"
        assert card["url"].startswith("http://127.0.0.1:") and card["protocolVersion"] == "0.3"
        assert {i["protocolVersion"] for i in card["supportedInterfaces"]} == {"0.3", "1.0"}
        assert card["name"] and card["description"] and card["version"]
        # the index presents itself (its data folder's name), not as NFCorpus
        assert card["name"] == "hybrid-search tiny retriever" and "the documents of tiny" in card["description"]
        assert "nfcorpus" not in card["skills"][0]["tags"] and "tiny" in card["skills"][0]["tags"]


def test_a2a_v1_client_text_and_data_parts(server):
    from a2a.helpers.proto_helpers import new_data_part
    from a2a.types.a2a_pb2 import Part

    task = a2a_v1_send(
        server["a2a"], [Part(text=json.dumps({"query": "broccoli sulforaphane markerbroccoli3", "top_k": 4}))]
    )
    ids = only_doc_ids(task)
    assert len(ids) == 4 and len(set(ids)) == 4 and "D-broccoli-3" in ids
    ids = only_doc_ids(a2a_v1_send(server["a2a"], [new_data_part({"query": "arsenic in rice"})]))
    assert len(ids) == 5 and ids[0].startswith("D-arsenic")
    plain = only_doc_ids(a2a_v1_send(server["a2a"], [Part(text="Hello, is arsenic in rice a problem?")]))
    assert len(plain) == 5 and plain[0].startswith("D-arsenic")  # plain text is the question itself
    narrowed = {"query": "arsenic in rice", "top_k": 5, "filters": {"document_ids": ["D-soy-1", "D-meat-2"]}}
    assert sorted(only_doc_ids(a2a_v1_send(server["a2a"], [new_data_part(narrowed)]))) == ["D-meat-2", "D-soy-1"]


def test_a2a_keeps_the_most_recent_tasks_and_drops_the_oldest(server):
    """A task answers ``tasks/get`` while among the ``--a2a-tasks-kept`` most recent; past them it is
    dropped ("task not found"), so the process does not grow with every query it answers."""
    from a2a.types.a2a_pb2 import Part

    from tests.conftest import A2A_TASKS_KEPT

    def get(task_id: str) -> dict:
        request = {"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"id": task_id}}
        return httpx.post(server["a2a"] + "/", json=request, timeout=30).json()

    first = a2a_v1_send(server["a2a"], [Part(text="arsenic in rice")])
    assert get(first.id)["result"]["id"] == first.id
    tasks = [a2a_v1_send(server["a2a"], [Part(text=f"broccoli sulforaphane {i}")]) for i in range(A2A_TASKS_KEPT)]
    assert get(first.id)["error"]["code"] == -32001  # TaskNotFoundError: the oldest was dropped
    assert all(get(task.id)["result"]["id"] == task.id for task in tasks)  # the most recent are all kept


@pytest.mark.parametrize(
    "text, message",
    [
        (json.dumps({"top_k": 5}), "query: Field required"),
        (json.dumps([1, 2]), "expected a JSON object"),
        (json.dumps({"query": "  "}), "query: Value error, must hold a non-blank character"),
        (json.dumps({"query": "x", "top_k": 101}), "top_k: Input should be less than or equal to 100"),
        (json.dumps({"query": "x", "top_k": 2.5}), "top_k: Input should be a valid integer"),
        (json.dumps({"query": "x" * 5000}), "query: String should have at most 4000 characters"),
        (json.dumps({"query": "x", "filters": {"date_range": "2020"}}), "filters.date_range"),
    ],
)
def test_a2a_bad_input_fails_the_task_with_a_reason(server, text, message):
    from a2a.types.a2a_pb2 import Part, TaskState

    task = a2a_v1_send(server["a2a"], [Part(text=text)])
    assert task.status.state == TaskState.TASK_STATE_FAILED
    assert message in task.status.message.parts[0].text
    assert len(task.artifacts) == 0
    assert httpx.get(server["a2a"] + "/").status_code == 200


def _engine_ids(engine, query: str, top_k: int) -> list[str]:
    """What the engine answers in-process: a server must relay exactly this."""
    return [hit.doc_id for hit in engine.search(query, top_k)]


def test_raw_jsonrpc_in_the_v03_wire_format(server, engine):
    body = a2a_v03_send({"kind": "text", "text": json.dumps({"query": "markermeat0 nitrites", "top_k": 3})})
    result = httpx.post(server["a2a"] + "/", json=body, timeout=60).json()["result"]
    assert result["kind"] == "task" and result["status"]["state"] == "completed"
    assert "message" not in result["status"]
    [artifact] = result["artifacts"]
    assert artifact["parts"] == [{"kind": "data", "data": {"doc_ids": artifact["parts"][0]["data"]["doc_ids"]}}]
    ids = artifact["parts"][0]["data"]["doc_ids"]
    assert ids == _engine_ids(engine, "markermeat0 nitrites", 3)


@pytest.mark.skipif(not A2A_V03_PYTHON.exists(), reason="run .ci/run once to create .venv-a2a03")
def test_a2a_v03_sdk_client_parses_reply_like_the_evaluator(server, engine):
    def ask(payload: str) -> dict:
        out = subprocess.run(
            [str(A2A_V03_PYTHON), str(ROOT / "tests" / "a2a_v03_client.py"), server["a2a"], payload],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    reply = ask(json.dumps({"query": "markerstatin1 cholesterol", "top_k": 5}))
    assert reply["state"] == "completed" and reply["artifacts"] == 1 and reply["parts"] == ["data"]
    assert reply["parsed"]["doc_ids"] == _engine_ids(engine, "markerstatin1 cholesterol", 5)
    failed = ask(json.dumps({"query": ""}))
    assert failed["state"] == "failed" and "query" in failed["joined"]


def test_agent_through_mcp_url_answers_the_same(server, tmp_path):
    port = free_port()
    proc = start_server(
        ["serve", "--no-mcp", "--a2a-port", str(port), "--mcp-url", server["mcp"] + "/mcp"],
        f"http://127.0.0.1:{port}/",
        tmp_path / "relay.log",
    )
    try:
        from a2a.types.a2a_pb2 import Part

        payload = json.dumps({"query": "blueberries and memory", "top_k": 4})
        relayed = only_doc_ids(a2a_v1_send(f"http://127.0.0.1:{port}", [Part(text=payload)]))
        direct = only_doc_ids(a2a_v1_send(server["a2a"], [Part(text=payload)]))
        assert relayed == direct and len(relayed) == 4
    finally:
        assert stop_server(proc) == 0


def test_evaluator_scores_the_agent_like_the_in_process_evaluation(server, beir_dir, index_dir, tmp_path):
    from engine.search import HybridEngine
    from offline.agent_evaluation import evaluate_agent
    from offline.dataset import load_dataset
    from offline.evaluation import evaluate_run, sample_queries, served_stage, stage_runs

    dataset = load_dataset(beir_dir)
    report = evaluate_agent(server["a2a"], dataset, "dev", num_queries=6, seed=42, top_k=5, timeout=60)
    assert report["failures"] == 0 and report["queries"] == 6
    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu"))
    queries = sample_queries(dataset.split_queries("dev"), 6, 42)
    local = evaluate_run(dataset.qrels("dev"), stage_runs(engine, queries, progress=False)[served_stage(engine)])
    assert report["in-list NDCG@5"]["mean"] == pytest.approx(local["in-list NDCG@5"])
    assert report["nDCG@5"] == pytest.approx(local["nDCG@5"])
    assert report["latency_ms"]["p50"] > 0


def test_a_query_past_the_time_limit_fails_cleanly(engine):
    from engine.documents import SearchRequest
    from serving.search_service import QueryTimeout, SearchService
    from serving.settings import Settings

    settings = Settings(index_dir=engine.settings.index_dir, query_timeout_s=1e-4)
    service = SearchService(settings, engine=engine)
    try:
        with pytest.raises(QueryTimeout, match="longer than"):
            asyncio.run(service.search(SearchRequest(query="vitamin d and falls", top_k=5), door="test"))
        assert (
            'door="test",kind="timeout"' in __import__("prometheus_client").generate_latest(service.registry).decode()
        )
    finally:
        service.close()


class _GatedReranker:
    """A reranker handed to the engine (its extension point) that holds each search in its thread
    until the test opens the gate: a search that outlives its time limit, every time."""

    name, device, runtime, max_length, memory_context = "gated", "cpu", "test", 64, 0

    def __init__(self) -> None:
        self.gate = threading.Event()

    def score(self, query: str, passages: list[str]) -> list[float]:
        self.gate.wait()
        return [-float(i) for i in range(len(passages))]  # the fused order


def test_a_timed_out_search_holds_its_slot_until_its_thread_ends(index_dir):
    from engine.documents import SearchRequest
    from engine.search import HybridEngine
    from serving.admission import Overloaded
    from serving.search_service import QueryTimeout, SearchService
    from serving.settings import Settings

    reranker = _GatedReranker()
    settings = Settings(index_dir=index_dir, device="cpu", query_timeout_s=1, max_in_flight=1, max_queue_s=0)
    engine = HybridEngine(settings.engine, reranker=reranker)
    service = SearchService(settings, engine=engine)
    request = SearchRequest(query="vitamin d and falls", top_k=3)

    def in_flight() -> float:
        return service.registry.get_sample_value("admission_in_flight")

    async def run() -> None:
        with pytest.raises(QueryTimeout):  # the caller hears on time, though its thread still runs
            await service.search(request, door="test")
        assert not reranker.gate.is_set() and in_flight() == 1
        with pytest.raises(Overloaded):  # refused where it can be seen, not queued behind that thread
            await service.search(request, door="test")
        reranker.gate.set()
        while in_flight():  # the slot comes back once the thread has ended
            await asyncio.sleep(0.01)
        assert len(await service.search(request, door="test")) == 3

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        reranker.gate.set()
        service.close()
        engine.close()
