"""The agent message protocol through a real server's /v1 endpoints, keys and limits included,
and the router in-process for what HTTP cannot provoke (timeouts, retries, crashing agents)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import threading
import time

import httpx
import pytest

from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server
from tests.helpers import chat_completions_server, jsonrpc_send

KEYS = {
    "System": "hsk-system-key-0123456789",
    "IngestionAgent": "hsk-ingest-key-0123456789",
    "Slowpoke": "hsk-slow-key-0123456789",
}


@pytest.fixture(scope="module")
def protocol(index_dir, tmp_path_factory):
    from serving.protocol_routes import hash_key

    tmp = tmp_path_factory.mktemp("protocol")
    shutil.copytree(index_dir, tmp / "index")
    types = {
        "System": ["RETRIEVAL_REQUEST", "RESPONSE_REQUEST"],
        "IngestionAgent": ["DOCUMENT_INGESTION"],
        "Slowpoke": ["RETRIEVAL_REQUEST"],
    }
    lines = []
    for agent, key in KEYS.items():
        lines += [f"[agents.{agent}]", f'key_sha256 = "{hash_key(key)}"', f"message_types = {json.dumps(types[agent])}"]
        if agent == "Slowpoke":
            lines.append('rate = "2/minute"')
    (tmp / "keys.toml").write_text("\n".join(lines) + "\n")
    port = free_port()
    args = serve_args(tmp / "index", port, "--agent-keys", str(tmp / "keys.toml"), "--trace-db", str(tmp / "t.sqlite"))
    proc = start_server(args, f"http://127.0.0.1:{port}/health", tmp / "serve.log")
    yield f"http://127.0.0.1:{port}"
    assert stop_server(proc) == 0
    assert "Traceback" not in (tmp / "serve.log").read_text()


def _send(url: str, message: dict, agent: str | None = "System", **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[agent]}"} if agent else {}
    return httpx.post(f"{url}/v1/messages", json=message, headers=headers, timeout=60, **kwargs)


def _msg(kind: str, payload: dict, sender: str = "System", receiver: str = "RetrievalAgent", **extra) -> dict:
    return {"type": kind, "sender": sender, "receiver": receiver, "payload": payload, **extra}


def test_each_message_type_round_trips(protocol):
    found = _send(protocol, _msg("RETRIEVAL_REQUEST", {"query": "soy isoflavones", "top_k": 3}))
    assert found.status_code == 200
    reply = found.json()
    assert reply["type"] == "RETRIEVAL_RESULT" and reply["receiver"] == "System"
    assert reply["trace_id"].startswith("ret-") and reply["payload"]["total_results"] == 3
    chunk = reply["payload"]["retrieved_chunks"][0]
    assert set(chunk) == {"chunk_id", "content", "similarity_score", "source_document", "metadata"}
    asked = {"query": "soy isoflavones", "top_k": 2, "highlight": {"sentences": 1}, "context": {"neighbors": 1}}
    asked |= {"paginate": True, "filters": {"not": {"document_ids": ["D-soy-0"]}}}
    paged = _send(protocol, _msg("RETRIEVAL_REQUEST", asked)).json()["payload"]
    for chunk in paged["retrieved_chunks"]:
        best = chunk["highlights"]
        assert [chunk["content"][x["start"] : x["end"]] for x in best] == [x["text"] for x in best] and best
        assert chunk["context"] == {"before": [], "after": []} and chunk["metadata"]["document_id"] != "D-soy-0"
    assert paged["next_page_token"]

    doc = {
        "document_id": "p1",
        "document_name": "Millet.md",
        "embedding_model": "text-embedding-3-small",
        "total_chunks": 1,
        "chunks": [
            {
                "chunk_id": "c1",
                "content": "millet is a drought tolerant grain",
                "metadata": {"page": 1, "section": "Intro"},
            }
        ],
    }
    ack = _send(
        protocol,
        _msg("DOCUMENT_INGESTION", doc, sender="IngestionAgent", metadata={"wait": True}),
        agent="IngestionAgent",
    ).json()
    assert ack["type"] == "INGESTION_ACK" and ack["trace_id"].startswith("ing-")
    assert ack["payload"]["chunks_indexed"] == 1 and ack["payload"]["durable"]
    assert ack["payload"]["encoder"].endswith("all-MiniLM-L6-v2")
    assert ack["payload"]["embedding_model_sent"] == "text-embedding-3-small"
    again = _send(
        protocol,
        _msg("RETRIEVAL_REQUEST", {"query": "drought tolerant grain", "top_k": 1, "filters": {"section": "Intro"}}),
    ).json()
    assert again["payload"]["retrieved_chunks"][0]["chunk_id"] == "p1#c1"

    asked = _send(
        protocol,
        _msg(
            "RESPONSE_REQUEST",
            {
                "user_query": "Which grain tolerates drought?",
                "context_chunks": [
                    {
                        "content": "Rice needs a lot of water. Millet is a drought tolerant grain.",
                        "source": "Millet.md",
                    },
                    {"content": "Coffee contains caffeine.", "source": "c.txt"},
                ],
            },
            receiver="LLMResponseAgent",
        ),
    ).json()
    assert asked["type"] == "RESPONSE_RESULT"
    payload = asked["payload"]
    assert "Millet is a drought tolerant grain. [1]" in payload["response"]
    assert payload["source_documents"][0] == "Millet.md" and payload["tokens_used"] > 10
    assert 0 <= payload["confidence_score"] <= 1


@pytest.mark.parametrize(
    ("message", "agent", "status", "code", "names"),
    [
        (_msg("RETRIEVAL_REQUEST", {"query": "", "top_k": 3}), "System", 422, "INVALID_MESSAGE", "payload: query"),
        (_msg("RETRIEVAL_REQUEST", {"query": "x", "top_k": 0}), "System", 422, "INVALID_MESSAGE", "top_k"),
        (
            {"type": "RETRIEVAL_REQUEST", "sender": "System", "payload": {}},
            "System",
            422,
            "INVALID_MESSAGE",
            "receiver",
        ),
        (_msg("TELEPORT", {}), "System", 403, "FORBIDDEN", "may not send"),
        (_msg("RETRIEVAL_REQUEST", {"query": "x"}, receiver="Oracle"), "System", 404, "UNKNOWN_RECEIVER", "Oracle"),
        (
            _msg("RESPONSE_REQUEST", {"user_query": "x"}, receiver="RetrievalAgent"),
            "System",
            422,
            "UNKNOWN_MESSAGE_TYPE",
            "does not handle",
        ),
        (
            _msg("RETRIEVAL_REQUEST", {"query": "x"}, sender="IngestionAgent"),
            "System",
            403,
            "FORBIDDEN",
            "sends as 'System'",
        ),
        (_msg("RETRIEVAL_REQUEST", {"query": "x"}), None, 401, "UNAUTHORIZED", "Bearer"),
    ],
)
def test_errors_are_typed_messages(protocol, message, agent, status, code, names):
    reply = _send(protocol, message, agent)
    assert reply.status_code == status
    body = reply.json()
    assert body["type"] == "ERROR_MESSAGE" and body["payload"]["error_code"] == code
    assert names in body["payload"]["error_message"] and body["payload"]["suggested_action"]
    assert body["payload"]["retry_possible"] is False


def test_a_key_decides_what_its_agent_may_send(protocol):
    reply = _send(
        protocol,
        _msg("RETRIEVAL_RESULT", {"query": "x", "retrieved_chunks": [], "total_results": 0, "search_duration_ms": 1}),
        "System",
    )
    assert reply.status_code == 403  # System may not send results: keys decide what a sender may send


def test_rate_and_size_limits(protocol):
    replies = [
        _send(protocol, _msg("RETRIEVAL_REQUEST", {"query": "soy"}, sender="Slowpoke"), "Slowpoke") for _ in range(3)
    ]
    assert [r.status_code for r in replies] == [200, 200, 429]
    assert int(replies[2].headers["Retry-After"]) >= 1
    assert replies[2].json()["payload"]["retry_possible"] is True
    big = _msg("RETRIEVAL_REQUEST", {"query": "x" * 300_000})
    too_big = _send(protocol, big)
    assert too_big.status_code == 413 and too_big.json()["payload"]["error_code"] == "PAYLOAD_TOO_LARGE"
    not_json = httpx.post(
        f"{protocol}/v1/messages", content=b"{nope", headers={"Authorization": f"Bearer {KEYS['System']}"}
    )
    assert not_json.status_code == 422 and not_json.json()["payload"]["error_code"] == "INVALID_MESSAGE"


def test_a_rag_turn_cites_what_retrieval_returned_under_one_trace(protocol):
    headers = {"Authorization": f"Bearer {KEYS['System']}"}
    turn = httpx.post(
        f"{protocol}/v1/rag",
        headers=headers,
        timeout=60,
        json={"question": "does coffee affect liver enzymes?", "top_k": 3, "conversation_id": "conversation-7"},
    ).json()
    kinds = [m["type"] for m in turn["messages"]]
    assert kinds == ["RETRIEVAL_REQUEST", "RETRIEVAL_RESULT", "RESPONSE_REQUEST", "RESPONSE_RESULT"]
    retrieved = {c["source_document"] for c in turn["messages"][1]["payload"]["retrieved_chunks"]}
    cited = turn["messages"][3]["payload"]["source_documents"]
    assert cited and set(cited) <= retrieved and "[1]" in turn["messages"][3]["payload"]["response"]
    relevance = {
        c["source_document"]: c["similarity_score"] for c in turn["messages"][1]["payload"]["retrieved_chunks"]
    }
    assert turn["messages"][3]["payload"]["confidence_score"] == max(relevance[s] for s in cited)
    assert {m["trace_id"] for m in turn["messages"]} == {"ret-conversation-7-001", "llm-conversation-7-001"}
    stored = httpx.get(f"{protocol}/v1/traces/conversation-7").json()["messages"]
    assert [m["type"] for m in stored] == kinds and stored[1]["duration_ms"] > 0
    follow = httpx.post(
        f"{protocol}/v1/rag",
        headers=headers,
        timeout=60,
        json={
            "question": "and hepatitis?",
            "conversation_id": "conversation-7",
            "conversation_history": [{"role": "user", "content": "does coffee affect liver?"}],
        },
    )
    assert {m["trace_id"] for m in follow.json()["messages"]} == {"ret-conversation-7-002", "llm-conversation-7-002"}


def test_traces_are_masked_and_agents_report_health(protocol):
    secret = _msg("RETRIEVAL_REQUEST", {"query": "mail jane.doe@example.org or call +1 415 555 0100 about soy"})
    trace_id = _send(protocol, secret).json()["trace_id"]
    stored = httpx.get(f"{protocol}/v1/traces/{trace_id}").json()["messages"]
    text = json.dumps(stored)
    assert "jane.doe" not in text and "555 0100" not in text and "[masked]" in text
    assert stored[0]["trace_id"] == trace_id  # the envelope's ids are kept whole (their digits are no phone)
    assert httpx.get(f"{protocol}/v1/traces?errors=true").json()["traces"]  # the refused ones are there
    agents = {a["agent_id"]: a for a in httpx.get(f"{protocol}/v1/agents").json()["agents"]}
    retrieval = agents["RetrievalAgent"]
    assert retrieval["messages_processed"] >= 3 and retrieval["average_response_time_ms"] > 0
    assert set(retrieval) >= {"status", "last_heartbeat", "error_rate"}
    assert httpx.get(f"{protocol}/v1/agents/Nobody/health").status_code == 404
    assert httpx.get(f"{protocol}/health").json()["agent_protocol"]["auth"] == "agent keys"
    metrics = httpx.get(f"{protocol}/metrics").text
    assert 'agent_messages_total{agent="RetrievalAgent"}' in metrics and "agent_response_ms_mean" in metrics


def test_schemas_over_http_and_cli(protocol, tmp_path):
    served = httpx.get(f"{protocol}/v1/schemas").json()
    assert {
        "Message",
        "DOCUMENT_INGESTION",
        "RETRIEVAL_REQUEST",
        "RETRIEVAL_RESULT",
        "RESPONSE_REQUEST",
        "RESPONSE_RESULT",
        "ERROR_MESSAGE",
        "INGESTION_ACK",
    } <= set(served)
    run = subprocess.run([*CLI, "schemas", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0
    assert json.loads((tmp_path / "RETRIEVAL_REQUEST.schema.json").read_text()) == served["RETRIEVAL_REQUEST"]


# ---------------------------------------------------------------- the router in-process


class _Flaky:
    """A custom agent registered through the extension point: fails as told, then answers."""

    agent_type, capabilities, message_types = "test", [], {"RETRIEVAL_REQUEST"}

    def __init__(self, agent_id, failures, code=None, delay=0.0):
        self.agent_id, self.failures, self.code, self.delay, self.calls = agent_id, failures, code, delay, 0

    async def handle(self, message, payload):
        from agents.messages import RetrievalResult
        from agents.router import AgentError

        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.calls <= self.failures:
            if self.code is None:
                raise RuntimeError("boom")
            raise AgentError(self.code, "flaked")
        return "RETRIEVAL_RESULT", RetrievalResult(
            query=payload.query, retrieved_chunks=[], total_results=0, search_duration_ms=0
        )


def test_router_retries_times_out_and_contains_crashes(tmp_path):
    from agents.messages import ErrorCode
    from agents.router import Router
    from agents.traces import TraceStore

    router = Router(TraceStore(tmp_path / "t.sqlite"), retries=2, backoff_s=0.01, timeout_s=0.2)
    agents = {
        "flaky": _Flaky("flaky", 2, ErrorCode.VECTOR_SEARCH_FAILED),
        "broken": _Flaky("broken", 9, ErrorCode.LEXICAL_SEARCH_FAILED),
        "final": _Flaky("final", 9, ErrorCode.INGESTION_FAILED),
        "crash": _Flaky("crash", 9),
        "slow": _Flaky("slow", 0, delay=1.0),
    }
    for agent in agents.values():
        router.register(agent)

    def send(receiver):
        message = _msg("RETRIEVAL_REQUEST", {"query": "q"}, receiver=receiver)
        return asyncio.run(router.send(message))

    assert send("flaky").type == "RETRIEVAL_RESULT" and agents["flaky"].calls == 3  # retried twice, then fine
    broken = send("broken")
    assert broken.payload["error_code"] == "LEXICAL_SEARCH_FAILED" and agents["broken"].calls == 3
    assert broken.payload["retry_possible"] is True
    assert send("final").payload["error_code"] == "INGESTION_FAILED"
    crash = send("crash")
    assert crash.payload["error_code"] == "INTERNAL" and agents["crash"].calls == 1  # not retried
    assert "RuntimeError" in crash.payload["error_message"] and "boom" not in crash.payload["error_message"]
    assert send("slow").payload["error_code"] == "TIMEOUT"
    assert router.health("broken")["error_rate"] == 1.0


class _Stuck:
    """An agent whose work runs in a thread, as the retrieval agent's does, and stays there until the
    test lets it go: a try that outlives the router's time limit (a thread cannot be cancelled)."""

    agent_id, agent_type, capabilities, message_types = "stuck", "test", [], {"RETRIEVAL_REQUEST"}

    def __init__(self) -> None:
        self.gate, self.tries = threading.Event(), 0

    async def handle(self, message, payload):
        from agents.messages import RetrievalResult

        self.tries += 1
        await asyncio.to_thread(self.gate.wait)
        return "RETRIEVAL_RESULT", RetrievalResult(
            query=payload.query, retrieved_chunks=[], total_results=0, search_duration_ms=0
        )


def test_a_timed_out_try_is_not_retried_while_it_still_runs(tmp_path):
    from agents.router import Router
    from agents.traces import TraceStore

    router = Router(TraceStore(tmp_path / "t.sqlite"), retries=2, backoff_s=0.01, timeout_s=0.2)
    stuck = _Stuck()
    router.register(stuck)

    async def send():
        try:
            return await router.send(_msg("RETRIEVAL_REQUEST", {"query": "q"}, receiver="stuck"))
        finally:
            stuck.gate.set()  # the abandoned thread ends, so the loop can close

    reply = asyncio.run(send())
    assert reply.payload["error_code"] == "TIMEOUT" and reply.payload["retry_possible"] is True
    assert stuck.tries == 1  # the sender retries later, as the error says; the router did not pile on


def test_trace_rows_are_written_off_the_event_loop_in_order_and_kept_at_close(tmp_path):
    from agents.router import Router
    from agents.traces import TraceStore

    path = tmp_path / "t.sqlite"
    router = Router(TraceStore(path))
    router.register(_Flaky("fine", 0))
    writer = sqlite3.connect(path, isolation_level=None)  # another process writing the file holds its lock
    writer.execute("BEGIN IMMEDIATE")

    async def send_three():
        sent = (_msg("RETRIEVAL_REQUEST", {"query": "q"}, receiver="fine", trace_id=f"t-{i}") for i in range(3))
        return [await router.send(message) for message in sent]

    try:  # answered while no row can be written: the event loop never waited on SQLite
        assert [reply.type for reply in asyncio.run(send_three())] == ["RETRIEVAL_RESULT"] * 3
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    router.traces.close()  # writes what is still queued first
    with sqlite3.connect(path) as stored:
        rows = stored.execute("SELECT trace_id, type FROM messages ORDER BY id").fetchall()
    assert rows == [(f"t-{i}", kind) for i in range(3) for kind in ("RETRIEVAL_REQUEST", "RETRIEVAL_RESULT")]


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="no Debian chromium (`apt-get install chromium`)")
def test_trace_viewer_in_a_real_browser(protocol, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    trace_id = _send(protocol, _msg("RETRIEVAL_REQUEST", {"query": "broccoli sulforaphane", "top_k": 2})).json()[
        "trace_id"
    ]
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        page = browser.new_page()
        page.goto(f"{protocol}/ui")
        row = page.locator(f'tr.trace[data-id="{trace_id}"]')
        row.wait_for(timeout=10_000)
        row.click()
        page.locator("#trace-title").wait_for(timeout=10_000)
        assert page.locator("#trace-title").inner_text() == trace_id
        messages = page.locator("tr.message")
        assert messages.count() == 2
        assert (
            "RETRIEVAL_REQUEST" in messages.nth(0).inner_text() and "RETRIEVAL_RESULT" in messages.nth(1).inner_text()
        )
        messages.nth(1).locator("summary").click()
        assert "broccoli" in messages.nth(1).locator("pre").inner_text()
        page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)
        browser.close()


@pytest.fixture
def chat_server():
    """A stand-in chat server answering with a fixed text citing the first context block."""

    def reply(body: dict) -> str:
        first = body["messages"][-1]["content"].split("\n")[1]  # "[1] <first context block>"
        return f"From the context: {first[4:40]} [1]"

    with chat_completions_server(reply) as (url, seen, stop):
        yield url, seen, stop


def test_llm_backend_and_its_fallback(engine, chat_server, tmp_path):
    from agents.chat_responder import ChatResponder
    from agents.responder import ExtractiveResponder, Question, Source

    url, seen, stop = chat_server
    responder = ChatResponder(
        url, "tiny-llm", None, ExtractiveResponder(engine.dense.encoder, engine.dense.query_encoder), timeout_s=5
    )
    context = [
        Source("Millet is a drought tolerant grain. It grows in Africa.", "millet.md"),
        Source("Coffee contains caffeine.", "coffee.md"),
    ]
    answer = responder.answer(Question("Which grain tolerates drought?", context, max_tokens=64, temperature=0.3))
    assert answer.text.startswith("From the context: Millet is a drought tolerant grain") and answer.text.endswith(
        "[1]"
    )
    assert answer.backend == "llm:tiny-llm" and answer.tokens == 49 and answer.sources[0] == "millet.md"
    sent = seen[-1]
    assert sent["model"] == "tiny-llm" and sent["max_tokens"] == 64 and sent["temperature"] == 0.3
    assert "[2] Coffee contains caffeine." in sent["messages"][-1]["content"]
    stop()
    down = responder.answer(Question("Which grain tolerates drought?", context))
    assert down.text.startswith("(LLM server failed: APIConnectionError; extractive answer)")
    assert "drought tolerant grain" in down.text and down.backend == "extractive-fallback"

    from agents.response_agent import LLMResponseAgent
    from agents.router import Router
    from agents.traces import TraceStore

    strict = ChatResponder(url, "tiny-llm", None, responder.fallback, timeout_s=5, allow_fallback=False)
    router = Router(TraceStore(tmp_path / "t.sqlite"), retries=1, backoff_s=0.01)
    router.register(LLMResponseAgent(strict))
    ask = {"user_query": "Which grain?", "context_chunks": [{"content": "Millet grows in Africa.", "source": "m"}]}
    reply = asyncio.run(router.send(_msg("RESPONSE_REQUEST", ask, receiver="LLMResponseAgent")))
    assert reply.payload["error_code"] == "GENERATION_FAILED" and reply.payload["retry_possible"] is True


def test_all_doors_behind_keys_when_configured(index_dir, tmp_path):
    from serving.protocol_routes import hash_key

    shutil.copytree(index_dir, tmp_path / "index")
    (tmp_path / "keys.toml").write_text(
        f'[agents.Evaluator]\nkey_sha256 = "{hash_key("hsk-evaluator-0123456789")}"\nmessage_types = []\n'
    )
    mcp_port, a2a_port = free_port(), free_port()
    keys = ["--agent-keys", str(tmp_path / "keys.toml"), "--key-all-doors"]
    args = serve_args(
        tmp_path / "index", mcp_port, "--read-only", *keys, "--trace-db", str(tmp_path / "t.sqlite"), a2a_port=a2a_port
    )
    proc = start_server(args, f"http://127.0.0.1:{mcp_port}/health", tmp_path / "serve.log")
    try:
        url, a2a = f"http://127.0.0.1:{mcp_port}", f"http://127.0.0.1:{a2a_port}"
        body = {"query": "soy", "top_k": 2}
        assert httpx.post(f"{url}/search_nfcorpus", json=body).status_code == 401
        good = {"Authorization": "Bearer hsk-evaluator-0123456789"}
        assert httpx.post(f"{url}/search_nfcorpus", json=body, headers=good).status_code == 200
        assert httpx.post(f"{url}/mcp", json={}).status_code == 401
        assert httpx.get(f"{a2a}/.well-known/agent-card.json").status_code == 200  # cards stay public
        rpc = jsonrpc_send(body)
        assert httpx.post(f"{a2a}/", json=rpc).status_code == 401
        reply = httpx.post(f"{a2a}/", json=rpc, headers=good, timeout=60).json()
        assert reply["result"]["status"]["state"] == "completed"
    finally:
        assert stop_server(proc) == 0


def test_a_message_that_timed_out_keeps_its_admission_slot_until_its_thread_ends(tmp_path):
    """The /v1 door answers TIMEOUT at the limit, but the agent's thread runs on: its slot stays
    taken (admission sees the work), so the next message is refused, not queued unseen."""
    import httpx
    from prometheus_client import CollectorRegistry
    from starlette.applications import Starlette

    from agents.router import Router
    from agents.traces import TraceStore
    from serving.admission import Admission
    from serving.protocol_routes import ProtocolDoor

    router = Router(TraceStore(tmp_path / "t.sqlite"), timeout_s=0.2)
    stuck = _Stuck()
    router.register(stuck)
    admission = Admission(1, 0, CollectorRegistry())
    app = Starlette(routes=[op.to_route() for op in ProtocolDoor(router, {}, admission=admission).operations()])
    message = {"type": "RETRIEVAL_REQUEST", "sender": "System", "receiver": "stuck", "payload": {"query": "q"}}

    async def scenario() -> list:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            try:
                first = await client.post("/v1/messages", json=message)
                busy = admission.in_flight._value.get()
                second = await client.post("/v1/messages", json=message)
            finally:
                stuck.gate.set()  # the abandoned thread ends, and gives its slot back
            for _ in range(100):
                if admission.in_flight._value.get() == 0:
                    break
                await asyncio.sleep(0.02)
            third = await client.post("/v1/messages", json=message)
            return [first, busy, second, third]

    first, busy, second, third = asyncio.run(scenario())
    assert first.json()["payload"]["error_code"] == "TIMEOUT" and busy == 1
    assert second.status_code == 503 and second.json()["payload"]["error_code"] == "OVERLOADED"
    assert third.status_code == 200 and third.json()["type"] == "RETRIEVAL_RESULT"


def test_a_v1_search_is_the_search_services_own_timed_and_counted(index_dir, tmp_path):
    """RETRIEVAL_REQUEST searches through the service every door uses: past its time limit the
    reply is TIMEOUT, and /metrics counts the search and its timeout under the door "protocol"."""
    shutil.copytree(index_dir, tmp_path / "index")
    port = free_port()
    args = serve_args(tmp_path / "index", port, "--read-only", "--query-timeout", "0.001")
    proc = start_server(
        args + ["--trace-db", str(tmp_path / "t.sqlite")], f"http://127.0.0.1:{port}/health", tmp_path / "log"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        reply = _send(url, _msg("RETRIEVAL_REQUEST", {"query": "soy isoflavones and breast cancer", "top_k": 3}), None)
        assert reply.json()["payload"]["error_code"] == "TIMEOUT", reply.text
        deadline = time.time() + 10
        while 'search_errors_total{door="protocol",kind="timeout"} 1.0' not in (
            metrics := httpx.get(f"{url}/metrics").text
        ):
            assert time.time() < deadline, metrics
            time.sleep(0.1)
        assert 'search_requests_total{door="protocol"} 1.0' in metrics
    finally:
        assert stop_server(proc) == 0
