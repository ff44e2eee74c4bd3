"""``serve --workers 2``: two processes on one port and one index, one writing and one following.
Real servers started through the CLI; a new connection may reach either worker, and ``/health``
says which one answered (so a request sent on that connection next reaches the same worker)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from benchmarks.reliability.server import CLI, ROOT, free_port, serve_args, start_server, stop_server
from engine.errors import ServiceError
from engine.live.writer import DocumentNotFound
from serving.admission import Overloaded
from serving.worker_channel import Channel, ChannelServer, WorkerFailed, WorkerUnreachable, WriterClient, call
from serving.workers import bind


@pytest.fixture(scope="module")
def workers(index_dir, tmp_path_factory):
    """Two workers serving a copy of the tiny index (the writer writes into it)."""
    folder = tmp_path_factory.mktemp("workers")
    index = folder / "index"
    shutil.copytree(index_dir, index)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(
        serve_args(index, port, "--workers", "2", "--query-timeout", "20"), f"{url}/health", folder / "log"
    )
    _both_up(url)
    yield {"url": url, "proc": proc, "log": folder / "log"}
    assert stop_server(proc) == 0, "SIGTERM must stop every worker cleanly"
    assert "Traceback" not in (folder / "log").read_text()


def _connect(url: str, role: str, seconds: float = 60) -> tuple[httpx.Client, dict]:
    """A client whose kept-alive connection reaches the worker of ``role``, and that worker's health."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        client = httpx.Client(base_url=url, timeout=20)
        try:
            health = client.get("/health").json()
            if health["worker"]["role"] == role:
                return client, health
        except httpx.HTTPError:
            time.sleep(0.2)
        client.close()
    raise AssertionError(f"no {role} answered within {seconds:g} s")


def _both_up(url: str, seconds: float = 90) -> dict[str, int]:
    """The pid of each role, once both answer over new connections."""
    pids = {}
    for role in ("writer", "follower"):
        client, health = _connect(url, role, seconds)
        client.close()
        pids[role] = health["worker"]["pid"]
    return pids


def _once_more_if_reset(url: str, method: str, path: str, body: dict) -> httpx.Response:
    """A request on a new connection, sent again on another if the first is reset, as HTTP clients
    retry an idempotent request (a search; a write by document id replaces): a connection made in the
    moment after a worker is killed was seen reset on a loaded machine."""

    def send() -> httpx.Response:
        with httpx.Client(base_url=url, timeout=20) as client:
            return client.request(method, path, json=body)

    try:
        return send()
    except httpx.ReadError:
        return send()


def _killed(pid: int) -> None:
    """SIGKILL, and wait until the process has exited (its sockets closed), reaped or not."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} outlived SIGKILL")


def _doc(document_id: str, words: str) -> dict:
    return {
        "document_id": document_id,
        "document_name": f"{document_id}.txt",
        "chunks": [{"chunk_id": "p1", "content": words}],
    }


def _top(client: httpx.Client, query: str) -> list[str]:
    reply = client.post("/search", json={"query": query, "top_k": 3})
    assert reply.status_code == 200, reply.text
    return [hit["document_id"] for hit in reply.json()["results"]]


def test_both_workers_answer_and_a_write_through_either_is_visible_on_both(workers):
    url = workers["url"]
    answered = {}
    for _ in range(40):  # new connections spread over the port's two sockets
        with httpx.Client(base_url=url) as client:
            health = client.get("/health").json()
        answered[health["worker"]["pid"]] = health["worker"]["role"]
    assert sorted(answered.values()) == ["follower", "writer"], answered
    assert health["workers"] == 2 and health["worker"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    follower, _ = _connect(url, "follower")
    writer, _ = _connect(url, "writer")
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
    message = {
        "type": "DOCUMENT_INGESTION",
        "sender": "IngestionAgent",
        "receiver": "RetrievalAgent",
        "metadata": {"wait": True},
        "payload": {
            **_doc("tapir-1", "tapir proboscis lowland"),
            "embedding_model": "all-MiniLM-L6-v2",
            "total_chunks": 1,
        },
    }
    reply = follower.post("/v1/messages", json=message)
    assert reply.status_code == 200 and reply.json()["type"] == "INGESTION_ACK", reply.text
    assert _top(writer, "tapir proboscis")[0] == "tapir-1" and _top(follower, "tapir proboscis")[0] == "tapir-1"

    # one /metrics for both workers, each series labelled with its worker
    metrics = follower.get("/metrics").text
    assert 'search_requests_total{door="rest",worker="0"}' in metrics
    assert 'search_requests_total{door="rest",worker="1"}' in metrics
    follower.close()
    writer.close()


def test_mcp_is_stateless_across_workers(workers):
    """The official client's session: its requests may land on either worker."""
    from mcp import Client

    async def run():
        for _ in range(3):
            async with Client(workers["url"] + "/mcp") as client:
                found = await client.call_tool("search_nfcorpus", {"query": "soy isoflavones", "top_k": 3})
                assert not found.is_error and found.structured_content["results"][0]["doc_id"].startswith("D-soy")

    asyncio.run(run())


@pytest.mark.slow
def test_a_killed_follower_leaves_the_other_answering_and_comes_back(workers):
    url = workers["url"]
    pids = _both_up(url)
    _killed(pids["follower"])
    for _ in range(20):  # each on a new connection: only live workers' sockets take them
        assert _once_more_if_reset(url, "POST", "/search", {"query": "coffee liver", "top_k": 3}).status_code == 200
    assert _both_up(url)["follower"] != pids["follower"]  # the supervisor started another


@pytest.mark.slow
def test_a_killed_writer_refuses_writes_until_it_is_back_and_loses_none(workers):
    url = workers["url"]
    pids = _both_up(url)
    logged = httpx.post(f"{url}/documents", json=_doc("numbat-1", "numbat termites banded marsupial"))
    assert logged.status_code == 201  # acknowledged: in the log, maybe not applied yet
    _killed(pids["writer"])
    refused, started = 0, time.time()
    while True:
        assert time.time() - started < 90, "the writer did not come back"
        assert _once_more_if_reset(url, "POST", "/search", {"query": "vitamin bone", "top_k": 3}).status_code == 200
        reply = _once_more_if_reset(url, "POST", "/documents", _doc("quoll-1", "quoll spotted carnivore"))
        if reply.status_code == 201:
            break
        assert reply.status_code == 503 and int(reply.headers["retry-after"]) > 0, reply.text
        assert "writer (worker 0) is restarting" in reply.json()["error"]
        refused += 1
        time.sleep(0.2)
    assert refused > 0
    assert _both_up(url)["writer"] != pids["writer"]
    for role in ("writer", "follower"):
        client, _ = _connect(url, role)
        assert client.get("/documents/numbat-1").status_code == 200
        deadline = time.time() + 10  # replayed, then checkpointed within a refresh interval
        while _top(client, "numbat termites")[0] != "numbat-1":
            assert time.time() < deadline, f"the acknowledged write is not searchable on the {role}"
            time.sleep(0.3)
        client.close()


def test_a_worker_that_cannot_start_stops_serve_with_its_reason(tmp_path):
    run = subprocess.run(
        CLI + serve_args(tmp_path / "missing", free_port(), "--workers", "2"),
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "hybrid-search: error: worker" in run.stderr and "missing" in run.stderr
    assert "Traceback" not in run.stderr


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
    client = WriterClient(channel, timeout_s=5)
    with pytest.raises(Overloaded) as refused:  # nobody listens: a write is refused, with when to come back
        client.document("any")
    assert isinstance(refused.value, ServiceError) and refused.value.status == 503
    assert refused.value.headers["Retry-After"] == "5"
    assert client.status()["reachable"] is False
