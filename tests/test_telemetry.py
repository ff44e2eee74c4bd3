"""OpenTelemetry through real servers on 127.0.0.1 exporting to a real OTLP/HTTP receiver (a small
HTTP server here that decodes what it is sent with the OTLP protobuf): W3C trace context in and
out at every door, stage and message spans with their attributes, the trace store's link to the
OpenTelemetry trace, masking on the way out, and a collector that is down or slow never holding
a request up."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server
from tests.helpers import jsonrpc_send

STAGES = ["encode", "bm25", "dense", "memory", "fusion"]  # the tiny index has no reranker
SERVER, INTERNAL, ERROR = 2, 1, 2  # OTLP's SPAN_KIND_SERVER, SPAN_KIND_INTERNAL, STATUS_CODE_ERROR


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    status: int
    start: int
    end: int
    scope: str
    attributes: dict = field(default_factory=dict)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP endpoint: ``POST /v1/traces`` with an ExportTraceServiceRequest, kept decoded
    (and the raw bytes too); ``delay_s`` makes it a slow collector."""

    def __init__(self, delay_s: float = 0.0) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.delay_s, self.spans, self.raw, self.posts = delay_s, [], [], 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver.lock:
                    receiver.posts += 1
                time.sleep(receiver.delay_s)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                spans = [
                    Span(
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.kind,
                        s.status.code,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        scope.scope.name,
                        {a.key: _value(a.value) for a in s.attributes},
                    )
                    for resource in request.resource_spans
                    for scope in resource.scope_spans
                    for s in scope.spans
                ]
                with receiver.lock:
                    receiver.raw.append(body)
                    receiver.spans += spans
                reply = ExportTraceServiceResponse().SerializeToString()
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except (BrokenPipeError, ConnectionResetError):  # the exporter gave up on a slow answer
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, *names: str, timeout_s: float = 30) -> list[Span]:
        """The spans of ``trace_id`` once every one of ``names`` has arrived."""
        deadline = time.time() + timeout_s
        while True:
            with self.lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if all(any(s.name == n for s in spans) for n in names):
                return spans
            assert time.time() < deadline, f"waited for {names} in {trace_id}; got {[s.name for s in spans]}"
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


def _serve(index_dir, log, receiver_url: str, *extra: str, a2a_port: int | None = None):
    port = free_port()
    args = serve_args(index_dir, port, "--read-only", "--otlp-endpoint", receiver_url, *extra, a2a_port=a2a_port)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch pace, in ms (default 5000)
        proc = start_server(args, f"http://127.0.0.1:{port}/health", log)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def traced(index_dir, tmp_path_factory):
    """A server with both HTTP ports exporting to a receiver, query texts included (masked)."""
    tmp = tmp_path_factory.mktemp("otel")
    receiver = Receiver()
    a2a = free_port()
    proc, url = _serve(
        index_dir,
        tmp / "serve.log",
        receiver.url,
        "--otlp-query-text",
        "--trace-db",
        str(tmp / "t.sqlite"),
        a2a_port=a2a,
    )
    yield {"url": url, "a2a": f"http://127.0.0.1:{a2a}", "receiver": receiver}
    assert stop_server(proc) == 0
    receiver.close()
    assert "Traceback" not in (tmp / "serve.log").read_text()


def test_rest_search_continues_the_callers_trace_with_stage_spans(traced):
    trace_id, parent, header = _traceparent()
    reply = httpx.post(
        traced["url"] + "/search", json={"query": "vitamin D falls", "top_k": 3}, headers={"traceparent": header}
    )
    assert reply.status_code == 200 and len(reply.json()["results"]) == 3
    version, answered_trace, server_id, flags = reply.headers["traceparent"].split("-")
    assert (version, answered_trace, flags) == ("00", trace_id, "01")

    spans = traced["receiver"].trace(trace_id, "POST /search", "search", *STAGES)
    server = _one(spans, "POST /search")
    assert server.span_id == server_id and server.parent == parent and server.kind == SERVER
    assert server.scope == "hybrid_search"
    assert server.attributes == {
        "http.request.method": "POST",
        "url.path": "/search",
        "http.route": "/search",
        "http.response.status_code": 200,
        "door": "rest",
    }
    search = _one(spans, "search")
    assert search.parent == server.span_id
    assert search.attributes["door"] == "rest" and search.attributes["search.top_k"] == 3
    assert search.attributes["search.hits"] == 3 and search.attributes["search.query_chars"] == len("vitamin D falls")
    stages = sorted((s for s in spans if s.name in STAGES), key=lambda s: s.start)
    assert sorted(s.name for s in stages) == sorted(STAGES)
    assert all(s.parent == search.span_id and s.kind == INTERNAL for s in stages)
    assert search.start <= stages[0].start and max(s.end for s in stages) <= search.end
    # in pipeline order, laid end to end; the dense search ran beside BM25 and the memory (the spare
    # thread idle at one request), and fusion began once both were done
    in_turn = [s for s in stages if s.name != "dense"]
    assert [s.name for s in in_turn] == [name for name in STAGES if name != "dense"]
    assert all(a.end == b.start for a, b in zip(in_turn, in_turn[1:], strict=False) if b.name != "fusion")
    named = {s.name: s for s in stages}
    dense, fusion = named["dense"], named["fusion"]
    assert named["encode"].end <= dense.start < named["bm25"].end and dense.end <= fusion.start
    assert named["memory"].end <= fusion.start
    by_name = {s.name: s.attributes for s in stages}
    assert all(a["door"] == "rest" and a["search.top_k"] == 3 and a["search.stage"] == n for n, a in by_name.items())
    assert by_name["bm25"]["search.depth"] == 100 and 3 <= by_name["bm25"]["search.candidates"] <= 32
    assert by_name["dense"]["search.depth"] == 100 and by_name["dense"]["search.candidates"] == 32
    assert by_name["fusion"]["search.candidates"] >= 3


def test_without_traceparent_a_request_starts_its_own_trace(traced):
    reply = httpx.post(traced["url"] + "/search_nfcorpus", json={"query": "coffee liver", "top_k": 2})
    _, trace_id, server_id, _ = reply.headers["traceparent"].split("-")
    again = httpx.post(traced["url"] + "/search_nfcorpus", json={"query": "coffee liver", "top_k": 2})
    assert again.headers["traceparent"].split("-")[1] != trace_id
    spans = traced["receiver"].trace(trace_id, "POST /search_nfcorpus", "search", *STAGES)
    server = _one(spans, "POST /search_nfcorpus")
    assert server.span_id == server_id and server.parent == "" and server.attributes["door"] == "rest"

    # a caller that does not sample keeps its trace id, and nothing of it is exported
    unsampled, _, _ = _traceparent()
    reply = httpx.get(traced["url"] + "/health", headers={"traceparent": f"00-{unsampled}-{secrets.token_hex(8)}-00"})
    assert reply.headers["traceparent"].startswith(f"00-{unsampled}-") and reply.headers["traceparent"].endswith("-00")
    later, _, header = _traceparent()
    httpx.get(traced["url"] + "/health", headers={"traceparent": header})
    traced["receiver"].trace(later, "GET /health")  # exported after the unsampled one would have been
    assert not [s for s in traced["receiver"].spans if s.trace_id == unsampled]


MCP_CLIENT = """
import asyncio, sys
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

async def call():
    async with httpx2.AsyncClient(headers={"traceparent": sys.argv[2]}, timeout=60) as http:
        async with Client(streamable_http_client(sys.argv[1], http_client=http)) as client:
            return await client.call_tool("search_nfcorpus", {"query": "soy prostate", "top_k": 2})

sys.exit(1 if asyncio.run(call()).is_error else 0)
"""


def test_an_mcp_tool_call_is_traced(traced):
    trace_id, parent, header = _traceparent()
    # a client process of its own: one with a tracer of its own would put its own span in the
    # request's _meta, which the MCP SDK continues instead of the HTTP header (as it should)
    client = subprocess.run([sys.executable, "-c", MCP_CLIENT, traced["url"] + "/mcp", header], timeout=120)
    assert client.returncode == 0
    spans = traced["receiver"].trace(trace_id, "POST /mcp", "tools/call search_nfcorpus", "search", *STAGES)
    doors = [s for s in spans if s.name == "POST /mcp"]
    assert all(s.parent == parent and s.attributes["door"] == "mcp" for s in doors)
    tool = _one(spans, "tools/call search_nfcorpus")  # the MCP SDK's own span, under the HTTP request
    assert tool.parent in {s.span_id for s in doors}
    search = _one(spans, "search")
    assert search.parent == tool.span_id and search.attributes["door"] == "mcp"
    assert search.attributes["search.top_k"] == 2 and search.attributes["search.hits"] == 2
    assert {s.parent for s in spans if s.name in STAGES} == {search.span_id}


def test_an_a2a_message_is_traced(traced):
    trace_id, parent, header = _traceparent()
    reply = httpx.post(
        traced["a2a"] + "/",
        json=jsonrpc_send({"query": "statins and cancer", "top_k": 3}),
        headers={"traceparent": header},
    )
    assert reply.status_code == 200 and "doc_ids" in reply.text
    assert reply.headers["traceparent"].split("-")[1] == trace_id
    spans = traced["receiver"].trace(trace_id, "POST /", "search", *STAGES)
    server = _one(spans, "POST /")
    assert server.parent == parent and server.attributes["door"] == "a2a"
    search = _one(spans, "search")
    assert (
        search.parent == server.span_id and search.attributes["door"] == "a2a" and search.attributes["search.hits"] == 3
    )
    assert all(s.attributes["door"] == "a2a" for s in spans if s.name in STAGES)
    assert not [s for s in spans if s.scope.startswith("a2a")]  # the SDK's event-queue spans stay off


def test_protocol_messages_are_spans_linked_to_the_trace_store(traced):
    url, receiver = traced["url"], traced["receiver"]
    trace_id, parent, header = _traceparent()
    message = {"type": "RETRIEVAL_REQUEST", "sender": "System", "receiver": "RetrievalAgent"}
    reply = httpx.post(
        url + "/v1/messages",
        json={**message, "payload": {"query": "broccoli", "top_k": 2}},
        headers={"traceparent": header},
    )
    assert reply.status_code == 200
    protocol_trace = reply.json()["trace_id"]
    spans = receiver.trace(trace_id, "POST /v1/messages", "message RETRIEVAL_REQUEST", "search", *STAGES)
    server = _one(spans, "POST /v1/messages")
    assert server.parent == parent and server.attributes["door"] == "protocol"
    span = _one(spans, "message RETRIEVAL_REQUEST")
    assert span.parent == server.span_id
    assert span.attributes == {
        "protocol.message.type": "RETRIEVAL_REQUEST",
        "protocol.sender": "System",
        "protocol.receiver": "RetrievalAgent",
        "protocol.trace_id": protocol_trace,
        "protocol.reply.type": "RETRIEVAL_RESULT",
    }
    search = _one(spans, "search")  # the agent searches by the one entry point every door uses
    assert search.parent == span.span_id and search.attributes["door"] == "protocol"
    assert {s.parent for s in spans if s.name in STAGES} == {search.span_id}

    stored = httpx.get(f"{url}/v1/traces/{protocol_trace}").json()["messages"]
    assert [m["type"] for m in stored] == ["RETRIEVAL_REQUEST", "RETRIEVAL_RESULT"]
    assert {m["otel_trace_id"] for m in stored} == {trace_id}
    listed = next(t for t in httpx.get(f"{url}/v1/traces").json()["traces"] if t["trace_id"] == protocol_trace)
    assert listed["otel_trace_ids"] == [trace_id]
    by_otel = httpx.get(f"{url}/v1/traces/{trace_id}").json()["messages"]  # and back from the OpenTelemetry id
    assert [m["type"] for m in by_otel] == ["RETRIEVAL_REQUEST", "RETRIEVAL_RESULT"]

    failed, _, header = _traceparent()
    wrong = httpx.post(
        url + "/v1/messages",
        json={**message, "receiver": "Nobody", "payload": {"query": "x"}},
        headers={"traceparent": header},
    )
    assert wrong.status_code == 404
    span = _one(receiver.trace(failed, "message RETRIEVAL_REQUEST"), "message RETRIEVAL_REQUEST")
    assert span.attributes["protocol.error_code"] == "UNKNOWN_RECEIVER" and span.status == ERROR
    assert span.attributes["protocol.trace_id"] == wrong.json()["trace_id"]
    assert (
        _one(receiver.trace(failed, "POST /v1/messages"), "POST /v1/messages").attributes["http.response.status_code"]
        == 404
    )

    turn_trace, _, header = _traceparent()
    turn = httpx.post(
        url + "/v1/rag", json={"question": "is soy safe?", "top_k": 2}, headers={"traceparent": header}, timeout=60
    )
    assert turn.status_code == 200
    spans = receiver.trace(turn_trace, "POST /v1/rag", "message RETRIEVAL_REQUEST", "message RESPONSE_REQUEST")
    sent = {m["trace_id"] for m in turn.json()["messages"]}
    assert {s.attributes["protocol.trace_id"] for s in spans if s.name.startswith("message ")} == sent


def test_masking_applies_to_what_is_exported(traced):
    url, receiver = traced["url"], traced["receiver"]
    trace_id, _, header = _traceparent()
    query = "vitamin D for alice.smith@example.com call +44 20 7946 0958"
    assert (
        httpx.post(url + "/search", json={"query": query, "top_k": 2}, headers={"traceparent": header}).status_code
        == 200
    )
    assert httpx.get(url + "/documents/bob.jones@example.org", headers={"traceparent": header}).status_code == 404
    spans = receiver.trace(trace_id, "POST /search", "search", "GET /documents/{document_id:path}")
    assert _one(spans, "search").attributes["search.query"] == "vitamin D for [masked] call [masked]"
    document = _one(spans, "GET /documents/{document_id:path}")
    assert document.attributes["url.path"] == "/documents/[masked]"
    with receiver.lock:
        sent = b"".join(receiver.raw)
    assert b"vitamin D for" in sent  # the query's text was exported, masked:
    assert b"alice.smith" not in sent and b"bob.jones" not in sent and b"7946" not in sent


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="no Debian chromium (`apt-get install chromium`)")
def test_the_trace_viewer_shows_the_opentelemetry_trace(traced):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    trace_id, _, header = _traceparent()
    message = {
        "type": "RETRIEVAL_REQUEST",
        "sender": "System",
        "receiver": "RetrievalAgent",
        "payload": {"query": "meat"},
    }
    protocol_trace = httpx.post(traced["url"] + "/v1/messages", json=message, headers={"traceparent": header}).json()[
        "trace_id"
    ]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(traced["url"] + "/ui")
        row = page.locator(f'tr.trace[data-id="{protocol_trace}"]')
        row.wait_for(timeout=10_000)
        assert trace_id in row.inner_text()
        row.click()
        page.locator("#trace-title").wait_for(timeout=10_000)
        messages = page.locator("tr.message")
        assert messages.count() == 2 and all(trace_id in messages.nth(i).inner_text() for i in range(2))
        browser.close()


def test_the_trace_store_migrates_a_file_written_before(tmp_path):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from agents.messages import Message
    from agents.traces import TraceStore

    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as old:  # the schema before OpenTelemetry, with a message in it
        old.executescript(
            "CREATE TABLE messages (id INTEGER PRIMARY KEY, trace_id TEXT NOT NULL, type TEXT NOT NULL,"
            " sender TEXT NOT NULL, receiver TEXT NOT NULL, timestamp TEXT NOT NULL, duration_ms REAL,"
            " outcome TEXT NOT NULL, body TEXT NOT NULL);"
            "CREATE TABLE counters (day TEXT NOT NULL, prefix TEXT NOT NULL, seq INTEGER NOT NULL,"
            " PRIMARY KEY (day, prefix));"
        )
        body = {"type": "RAG", "sender": "a", "receiver": "b", "trace_id": "old-1", "timestamp": "2026-11-01T00:00:00Z"}
        old.execute(
            "INSERT INTO messages VALUES (1, 'old-1', 'RAG', 'a', 'b', '2026-11-01T00:00:00Z', 1.0, 'ok', ?)",
            (json.dumps({**body, "payload": {}, "metadata": {}}),),
        )
    store = TraceStore(path)
    assert store.trace("old-1")[0]["otel_trace_id"] is None
    trace_id = secrets.token_hex(16)
    context = SpanContext(int(trace_id, 16), int(secrets.token_hex(8), 16), False, TraceFlags(1))
    with trace.use_span(NonRecordingSpan(context)):
        store.add(Message(type="RAG", sender="a", receiver="b", trace_id="new-1", payload={}), outcome="ok")
    assert store.trace("new-1")[0]["otel_trace_id"] == trace_id
    assert [m["trace_id"] for m in store.trace(trace_id)] == ["new-1"]
    assert {t["trace_id"]: t["otel_trace_ids"] for t in store.recent()} == {"new-1": [trace_id], "old-1": []}
    store.close()
    TraceStore(path).close()  # opening a migrated file again changes nothing


@pytest.mark.parametrize("collector", ["refused", "slow"])
def test_a_collector_down_or_slow_never_holds_a_request(index_dir, tmp_path, collector):
    receiver = Receiver(delay_s=8.0) if collector == "slow" else None
    endpoint = receiver.url if receiver else f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc, url = _serve(index_dir, tmp_path / "serve.log", endpoint)
    try:
        took, traces = [], []
        with httpx.Client(timeout=30) as client:
            for i in range(12):
                started = time.perf_counter()
                reply = client.post(url + "/search", json={"query": f"arsenic rice {i}", "top_k": 3})
                took.append(time.perf_counter() - started)
                traces.append(reply.headers["traceparent"].split("-")[1])
                assert reply.status_code == 200 and len(reply.json()["results"]) == 3
                time.sleep(0.25)  # spread over several export rounds
        # an export waits up to 3 s for this collector; a request that waited on one would show it
        assert max(took) < 2.5, took
        deadline = time.time() + 30
        tried = lambda: receiver.posts if receiver else "Failed to export" in (tmp_path / "serve.log").read_text()  # noqa: E731
        while not tried():
            assert time.time() < deadline, "the exporter never tried the collector"
            time.sleep(0.2)
        if receiver:  # what the slow collector kept (it reads a batch, then sleeps) has no query text:
            search = next(s for s in receiver.trace(traces[0], "search", timeout_s=40) if s.name == "search")
            assert "search.query" not in search.attributes and search.attributes["search.query_chars"] == 14
    finally:
        started = time.perf_counter()
        assert stop_server(proc) == 0
        stopping = time.perf_counter() - started
        if receiver:
            receiver.close()
    assert stopping < 20  # queued spans get a bounded time at shutdown
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and log.count("Queue full") <= 1


def test_otlp_settings_from_flags_environment_and_toml(tmp_path, monkeypatch):
    import subprocess

    from cli.flags import settings_from
    from cli.main import build_parser
    from serving.settings import Settings
    from serving.telemetry import traces_url

    args = build_parser().parse_args(["serve", "--otlp-endpoint", "http://collector:4318", "--otlp-query-text"])
    settings = settings_from(args)
    assert settings.telemetry.otlp_endpoint == "http://collector:4318" and settings.telemetry.otlp_query_text is True
    assert settings_from(build_parser().parse_args(["serve"])).telemetry.otlp_endpoint is None  # off by default
    monkeypatch.setenv("HYBRID_SEARCH_OTLP_ENDPOINT", "https://otel.example:4318/custom/path")
    assert Settings().telemetry.otlp_endpoint == "https://otel.example:4318/custom/path"
    monkeypatch.delenv("HYBRID_SEARCH_OTLP_ENDPOINT")
    (tmp_path / "c.toml").write_text('otlp_endpoint = "http://127.0.0.1:4318/"\n')
    monkeypatch.setenv("HYBRID_SEARCH_CONFIG", str(tmp_path / "c.toml"))
    assert Settings().telemetry.otlp_endpoint == "http://127.0.0.1:4318/"
    assert traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://otel.example:4318/custom/path") == "https://otel.example:4318/custom/path"
    monkeypatch.delenv("HYBRID_SEARCH_CONFIG")
    done = subprocess.run(
        CLI + ["serve", "--otlp-endpoint", "collector:4318", "--index-dir", str(tmp_path / "none")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "otlp_endpoint" in done.stderr and "http:// or https://" in done.stderr
