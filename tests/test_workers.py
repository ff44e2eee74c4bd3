"""``serve --workers 2``: two processes on one port and one index, one writing and one following.
Real servers started through the CLI, driven over REST, MCP and A2A with the official clients; a
new connection may reach either worker, and ``/health`` says which one answered (so a request sent
on that connection next reaches the same worker). The writer killed under load, with writes through
every door: tests/test_faults.py (the fault benchmark's scenario, run small)."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import socket
import threading
import time

import httpx
import pytest

from engine.errors import ServiceError
from engine.live.writer import DocumentNotFound
from offline.server_process import (
    free_port,
    serve_args,
    sigkill,
    start_server,
    stop_server,
    wait_until_up,
    worker_client,
    workers_up,
)
from serving.admission import Overloaded
from serving.remotes import RemoteWriter
from serving.transport import ChannelTransport
from serving.worker_channel import Channel, ChannelServer, WorkerFailed, WorkerUnreachable, call
from serving.workers import bind
from tests.helpers import a2a_v1_send, fails_to_serve, only_doc_ids


@pytest.fixture(scope="module")
def workers(index_dir, tmp_path_factory):
    """Two workers serving a copy of the tiny index (the writer writes into it), every door on: REST
    and MCP (with its write tools) on one port, A2A on another."""
    folder = tmp_path_factory.mktemp("workers")
    index = folder / "index"
    shutil.copytree(index_dir, index)
    port, a2a_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(
        index, port, "--workers", "2", "--query-timeout", "20", "--mcp-writes", "--page-pins", "4", a2a_port=a2a_port
    )
    proc = start_server(args, f"{url}/health", folder / "log")
    wait_until_up(f"http://127.0.0.1:{a2a_port}/")
    workers_up(url)
    yield {"url": url, "a2a": f"http://127.0.0.1:{a2a_port}", "proc": proc, "log": folder / "log"}
    assert stop_server(proc) == 0, "SIGTERM must stop every worker cleanly"
    assert "Traceback" not in (folder / "log").read_text()


def _doc(document_id: str, words: str) -> dict:
    return {
        "document_id": document_id,
        "document_name": f"{document_id}.txt",
        "chunks": [{"chunk_id": "p1", "content": words}],
    }


def _ingestion(document: dict) -> dict:
    """The agent protocol's DOCUMENT_INGESTION of ``document``, acknowledged once searchable."""
    payload = {**document, "embedding_model": "all-MiniLM-L6-v2", "total_chunks": 1}
    return {
        "type": "DOCUMENT_INGESTION",
        "sender": "IngestionAgent",
        "receiver": "RetrievalAgent",
        "metadata": {"wait": True},
        "payload": payload,
    }


def _top(client: httpx.Client, query: str) -> list[str]:
    reply = client.post("/search", json={"query": query, "top_k": 3})
    assert reply.status_code == 200, reply.text
    return [hit["document_id"] for hit in reply.json()["results"]]


def test_both_workers_explain_alike(workers):
    """A follower explains a hit as the writer does: the same stages, ranks and scores."""
    asked = {"query": "soy isoflavones", "top_k": 3, "explain": True, "fusion": {"weights": {"dense": 0.5}}}
    replies = []
    for role in ("writer", "follower"):
        client, _ = worker_client(workers["url"], role)
        try:
            reply = client.post("/search", json=asked)
        finally:
            client.close()
        assert reply.status_code == 200, reply.text
        replies.append([(hit["doc_id"], hit["explanation"]) for hit in reply.json()["results"]])
    assert replies[0] == replies[1] and replies[0][0][1]["retrievers"]["dense"]["weight"] == 0.5


def test_both_workers_answer_and_a_write_through_either_is_visible_on_both(workers):
    url = workers["url"]
    answered = {}
    for _ in range(40):  # new connections spread over the port's two sockets
        with httpx.Client(base_url=url) as client:
            health = client.get("/health").json()
        answered[health["worker"]["pid"]] = health["worker"]["role"]
    assert sorted(answered.values()) == ["follower", "writer"], answered
    assert health["workers"] == 2 and health["worker"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    follower, _ = worker_client(url, "follower")
    writer, _ = worker_client(url, "writer")
    assert follower.get("/health").json()["live"]["reachable"] is True  # the writer's status, through the channel

    # REST through the follower: the writer logs it, and after wait_for both workers find it
    ack = follower.post("/documents?refresh=wait_for", json=_doc("okapi-1", "okapi giraffid forest ossicones"))
    assert ack.status_code == 201, ack.text
    assert _top(follower, "okapi ossicones")[0] == "okapi-1" and _top(writer, "okapi ossicones")[0] == "okapi-1"
    assert follower.get("/documents/okapi-1").json()["document_id"] == "okapi-1"

    # a delete through the writer is gone from the follower once acknowledged
    assert writer.delete("/documents/okapi-1?refresh=wait_for").status_code == 200
    assert "okapi-1" not in _top(follower, "okapi ossicones")
    assert follower.get("/documents/okapi-1").status_code == 404  # DocumentNotFound crossed the channel

    # the agent protocol's DOCUMENT_INGESTION through the follower
    reply = follower.post("/v1/messages", json=_ingestion(_doc("tapir-1", "tapir proboscis lowland")))
    assert reply.status_code == 200 and reply.json()["type"] == "INGESTION_ACK", reply.text
    assert _top(writer, "tapir proboscis")[0] == "tapir-1" and _top(follower, "tapir proboscis")[0] == "tapir-1"

    # one /metrics for both workers, each series labelled with its worker
    metrics = follower.get("/metrics").text
    assert 'search_requests_total{door="rest",worker="0"}' in metrics
    assert 'search_requests_total{door="rest",worker="1"}' in metrics
    follower.close()
    writer.close()


def test_mcp_and_a2a_answer_from_both_workers_and_mcp_writes_reach_both(workers):
    """MCP (the official client, stateless: a session's requests may land on either worker) searches,
    adds and deletes; each change is then seen by both workers' REST and by A2A (the official
    client) over new connections, which the port spreads over both workers."""
    from a2a.helpers.proto_helpers import new_data_part
    from mcp import Client

    url = workers["url"]
    follower, _ = worker_client(url, "follower")
    writer, _ = worker_client(url, "writer")

    async def mcp(tool: str, arguments: dict):
        async with Client(url + "/mcp") as client:
            return await client.call_tool(tool, arguments)

    def a2a_top(query: str) -> list[str]:
        return only_doc_ids(a2a_v1_send(workers["a2a"], [new_data_part({"query": query, "top_k": 3})]))

    for _ in range(3):
        found = asyncio.run(mcp("search_nfcorpus", {"query": "soy isoflavones", "top_k": 3}))
        assert not found.is_error and found.structured_content["results"][0]["doc_id"].startswith("D-soy")
    assert a2a_top("soy isoflavones")[0].startswith("D-soy")

    added = asyncio.run(mcp("add_document", _doc("pangolin-1", "pangolin scales keratin anteater")))
    assert not added.is_error, added  # acknowledged once searchable on every worker (the tool waits)
    assert _top(follower, "pangolin keratin")[0] == "pangolin-1" and _top(writer, "pangolin keratin")[0] == "pangolin-1"
    for _ in range(12):  # twelve new connections each: both workers answer some (all on one: p = 2^-11)
        assert a2a_top("pangolin keratin")[0] == "pangolin-1#p1"  # A2A answers NFCorpus' ids: a chunk's
        found = asyncio.run(mcp("search", {"query": "pangolin keratin", "top_k": 3}))
        assert found.structured_content["results"][0]["document_id"] == "pangolin-1", found

    deleted = asyncio.run(mcp("delete_document", {"document_id": "pangolin-1"}))
    assert not deleted.is_error, deleted
    assert "pangolin-1" not in _top(follower, "pangolin keratin") + _top(writer, "pangolin keratin")
    for _ in range(6):
        assert "pangolin-1#p1" not in a2a_top("pangolin keratin")
    gone = asyncio.run(mcp("delete_document", {"document_id": "pangolin-1"}))
    assert gone.is_error and "no document 'pangolin-1'" in str(gone.content)  # the writer's 404, via the channel
    follower.close()
    writer.close()


def test_an_a2a_task_is_found_from_either_worker(workers):
    """``tasks/get`` over new connections (which the port spreads over both workers) finds every
    task, whichever worker ran it: its id names that worker, and the other one asks it."""
    from a2a.helpers.proto_helpers import new_data_part

    from serving.a2a_tasks import worker_of

    tasks = [a2a_v1_send(workers["a2a"], [new_data_part({"query": "soy isoflavones", "top_k": 3})]) for _ in range(12)]
    assert {worker_of(task.id) for task in tasks} == {0, 1}  # both ran some (all on one: p = 2^-11)
    for task in tasks:
        for _ in range(3):  # a new connection each: about half reach the worker that did not run it
            request = {"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"id": task.id}}
            found = httpx.post(workers["a2a"] + "/", json=request, timeout=30).json()
            assert found["result"]["id"] == task.id, found
            assert found["result"]["artifacts"][0]["parts"][0]["data"]["doc_ids"][0].startswith("D-soy"), found


def test_pages_hold_whichever_worker_answers_with_writes_between(workers):
    """Pages 1-5 of size 10, answered by the writer and the follower in turn with a document written
    between pages (one that ranks first), are the one top-50 list: the pin and its key are the
    server's (one SQLite file), not the worker's. A forged token is a 422 on either worker; pins
    made on one worker push another's out (--page-pins 4), which is then a 410 on the other."""
    writer, _ = worker_client(workers["url"], "writer")
    follower, _ = worker_client(workers["url"], "follower")
    chunks = [{"chunk_id": f"p{i}", "content": f"kelp iodine note {i} seaweed thyroid"} for i in range(40)]
    notes = {"document_id": "kelp-notes", "chunks": chunks}  # the tiny index holds 34 chunks: 50 need more
    assert writer.post("/documents?refresh=wait_for", json=notes).status_code == 201
    asked = {"query": "kelp iodine thyroid", "retrievers": {"bm25": {"depth": 100}, "dense": {"depth": 100}}}
    whole = [hit["doc_id"] for hit in writer.post("/search", json={**asked, "top_k": 50}).json()["results"]]
    pages, token = [], None
    for page in range(5):
        client = (writer, follower)[page % 2]
        reply = client.post("/search", json={**asked, "top_k": 10, "paginate": True, "page_token": token})
        assert reply.status_code == 200, reply.text
        pages += [hit["doc_id"] for hit in reply.json()["results"]]
        token = reply.json()["next_page_token"]
        written = writer.post("/documents?refresh=wait_for", json=_doc(f"kelp-{page}", "kelp iodine thyroid kelp"))
        assert written.status_code == 201, written.text
    assert pages == whole and len(set(pages)) == 50  # no duplicate, no gap
    assert _top(follower, "kelp iodine thyroid")[0].startswith("kelp-")  # the writes did land

    forged = follower.post("/search", json={**asked, "page_token": token[:-1] + "01"[token.endswith("0")]})
    assert forged.status_code == 422 and forged.json()["error"].startswith("page_token"), forged.text
    for _ in range(4):  # the follower's pins push out the one the pages above kept
        assert follower.post("/search", json={**asked, "top_k": 1, "paginate": True}).status_code == 200
    expired = writer.post("/search", json={**asked, "page_token": token})
    assert expired.status_code == 410 and "expired" in expired.json()["error"], expired.text
    for document in ["kelp-notes", *(f"kelp-{page}" for page in range(5))]:
        assert writer.delete(f"/documents/{document}?refresh=wait_for").status_code == 200
    writer.close()
    follower.close()


@pytest.mark.slow
def test_a_killed_follower_leaves_the_other_answering_and_comes_back(workers):
    url = workers["url"]
    pids = workers_up(url)
    sigkill(pids["follower"])
    for _ in range(20):  # each on a new connection: only live workers' sockets take them
        assert httpx.post(f"{url}/search", json={"query": "coffee liver", "top_k": 3}, timeout=20).status_code == 200
    assert workers_up(url)["follower"] != pids["follower"]  # the supervisor started another


@pytest.mark.slow
def test_a_writer_killed_under_writes_refuses_them_until_it_is_back_and_loses_none(workers):
    """Writes keep arriving at the follower (each crosses the channel to the writer) while the
    writer is killed: the ones acknowledged survive, the rest are refused with 503 + Retry-After
    until the writer is back, and searches on new connections are answered throughout."""
    url = workers["url"]
    pids = workers_up(url)
    follower, _ = worker_client(url, "follower")
    outcomes: list[tuple[str, httpx.Response]] = []
    stop = threading.Event()

    def write() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            doc_id = f"numbat-{i}"
            outcomes.append((doc_id, follower.post("/documents", json=_doc(doc_id, f"numbat zq{i}marker"))))
            time.sleep(0.1)

    def writer_back() -> bool:  # a write acknowledged after one was refused
        refused = [i for i, (_, reply) in enumerate(outcomes) if reply.status_code != 201]
        return bool(refused) and any(reply.status_code == 201 for _, reply in outcomes[refused[0] :])

    writing = threading.Thread(target=write)
    writing.start()
    try:
        while sum(reply.status_code == 201 for _, reply in outcomes) < 3:
            time.sleep(0.05)
        sigkill(pids["writer"])
        started, searched, agent_refusal = time.time(), 0, None
        while not writer_back():
            if agent_refusal is None and any(reply.status_code != 201 for _, reply in outcomes):
                agent_refusal = follower.post("/v1/messages", json=_ingestion(_doc("numbat-v1", "numbat via v1")))
            assert time.time() - started < 90, "the writer did not come back"
            search = httpx.post(f"{url}/search", json={"query": "vitamin bone", "top_k": 3}, timeout=20)
            assert search.status_code == 200, search.text
            searched += 1
            time.sleep(0.1)
    finally:
        stop.set()
        writing.join()
    refused = [reply for _, reply in outcomes if reply.status_code != 201]
    assert refused and searched > 0
    for reply in refused:
        assert reply.status_code == 503 and int(reply.headers["retry-after"]) > 0, reply.text
        assert "writer (worker 0) is restarting" in reply.json()["error"]
    # the agent protocol's door refuses the same way, with the same Retry-After (ingestions are writes)
    assert agent_refusal is not None and agent_refusal.status_code == 503, agent_refusal.text
    assert (
        agent_refusal.json()["payload"]["error_code"] == "OVERLOADED" and int(agent_refusal.headers["retry-after"]) > 0
    )
    assert workers_up(url)["writer"] != pids["writer"]
    acked = [doc_id for doc_id, reply in outcomes if reply.status_code == 201]
    for role in ("writer", "follower"):
        client, _ = worker_client(url, role)
        for doc_id in acked:
            assert client.get(f"/documents/{doc_id}").status_code == 200, f"{doc_id} lost on the {role}"
            deadline = time.time() + 10  # replayed, then checkpointed within a refresh interval
            while _top(client, f"zq{doc_id.split('-')[1]}marker")[0] != doc_id:
                assert time.time() < deadline, f"the acknowledged {doc_id} is not searchable on the {role}"
                time.sleep(0.3)
        client.close()
    follower.close()


def test_a_worker_that_cannot_start_stops_serve_with_its_reason(tmp_path):
    stderr = fails_to_serve(serve_args(tmp_path / "missing", free_port(), "--workers", "2"))
    assert "hybrid-search: error: worker" in stderr and "missing" in stderr


def test_a_workers_connections_send_without_waiting_for_acknowledgements():
    """Nagle's algorithm off on the connections a worker's socket takes (a two-part reply waited 40 ms)."""

    async def run() -> int:
        sock = bind("127.0.0.1", 0, listen=True)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        server = await asyncio.get_running_loop().create_server(lambda: _Accepted(accepted), sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        transport = await accepted
        nodelay = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(run()) == 1


class _Accepted(asyncio.Protocol):
    def __init__(self, accepted: asyncio.Future) -> None:
        self.accepted = accepted

    def connection_made(self, transport) -> None:
        self.accepted.set_result(transport)


def test_the_channel_carries_a_callers_errors_and_refuses_strangers(tmp_path):
    channel = Channel(tmp_path, b"k" * 32)

    def missing(document_id: str) -> None:
        raise DocumentNotFound(document_id)

    def broken() -> None:
        raise ZeroDivisionError("bug")

    slow = threading.Event()
    server = ChannelServer(channel, 0, {"echo": lambda x: x, "document": missing, "status": broken, "wait": slow.wait})
    try:
        assert call(channel, 0, "echo", {"a": 1}, timeout_s=5) == {"a": 1}
        with pytest.raises(DocumentNotFound) as found:
            call(channel, 0, "document", "nope", timeout_s=5)
        assert found.value.status == 404
        with pytest.raises(WorkerFailed, match="ZeroDivisionError: bug"):
            call(channel, 0, "status", timeout_s=5)
        with pytest.raises(WorkerUnreachable):  # the wrong key: hung up on, nothing run
            call(Channel(tmp_path, b"x" * 32), 0, "echo", 1, timeout_s=5)
        with pytest.raises(WorkerUnreachable):  # no answer within the caller's time
            call(channel, 0, "wait", timeout_s=0.3)
        slow.set()
    finally:
        server.close(5)
    client = RemoteWriter(ChannelTransport(channel, 0, "worker 0"), timeout_s=5)
    with pytest.raises(Overloaded) as refused:  # nobody listens: a write is refused, with when to come back
        client.document("any")
    assert isinstance(refused.value, ServiceError) and refused.value.status == 503
    assert refused.value.headers["Retry-After"] == "5"
    assert client.status()["reachable"] is False


def test_a_client_keeps_its_connection_counts_its_bytes_and_outlives_a_restarted_callee(tmp_path):
    """Calls share one kept connection (one thread in the callee, not one a call); a callee started
    again since is reached on a new connection without the caller seeing the old one fail."""
    from serving.worker_channel import ChannelClient

    channel = Channel(tmp_path, b"k" * 32)
    seen: list[str] = []
    handlers = {"echo": lambda x: (seen.append(threading.current_thread().name), x)[1]}
    server = ChannelServer(channel, 0, handlers)
    client = ChannelClient(channel, 0)
    try:
        assert [client.call("echo", i, timeout_s=5) for i in range(5)] == list(range(5))
        assert len({name for name in seen}) == 1 and len(client._idle) == 1  # one connection, one thread
        stats = client.stats()
        assert stats["calls"] == 5 and 0 < stats["bytes_sent"] < 5 * 200 and stats["bytes_received"] > 0
        server.close(5)
        server = ChannelServer(channel, 0, handlers)  # the callee back: the kept connection is stale
        assert client.call("echo", "again", timeout_s=5) == "again"
    finally:
        client.close()
        server.close(5)
    with pytest.raises(WorkerUnreachable):  # nobody listens: no retry hides that
        client.call("echo", 1, timeout_s=1)
