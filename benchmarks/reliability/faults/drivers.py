"""The load the faults strike: a writer that writes and deletes until its server is killed, readers
searching without pause, and a writer through every door that takes writes. Each notes every
answer as a client would see it (and the writers what was acknowledged, in a :class:`Ledger`),
since what a fault costs is what the clients in the middle of their work were told."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import threading
import time
from typing import Any

import httpx

from benchmarks.reliability.faults.harness import QUERIES, Ledger, document

WRITE_DOORS = ("rest", "mcp", "v1")  # the doors that take writes (A2A takes none)
RESTARTING = "writer (worker 0) is restarting"  # the refusal while a killed writer comes back


def write_until_killed(
    client: httpx.Client, proc: subprocess.Popen, round_: int, rng: random.Random, ledger: Ledger
) -> None:
    """Write (every fourth request deletes an acknowledged document) until the server dies: SIGKILL
    at a random moment 0.2-1.2 s after this round's third acknowledged write."""
    killer = None
    for i in range(1000):
        doc_id, word = f"r{round_}-{i}", f"zx{round_}q{i}marker"
        victim = sorted(ledger.acked)[0] if i % 4 == 3 and ledger.acked else None
        try:
            if victim is not None:
                if client.delete(f"/documents/{victim}").status_code == 200:
                    ledger.deleted.add(victim)
                    del ledger.acked[victim]
                continue
            reply = client.post("/documents", json=document(doc_id, f"{word} chunk"))
        except httpx.HTTPError:  # killed mid-request: logged or not, never half
            if victim is not None:
                del ledger.acked[victim]
            ledger.in_doubt.add(victim or doc_id)
            break
        if reply.status_code == 201:
            ledger.acked[doc_id] = word
            ledger.writes += 1
        if killer is None and sum(d.startswith(f"r{round_}-") for d in ledger.acked) == 3:
            killer = threading.Timer(rng.uniform(0.2, 1.2), proc.send_signal, [signal.SIGKILL])
            killer.start()
    proc.wait(timeout=60)


class Readers:
    """``clients`` threads searching over REST without pause, each on a kept-alive connection made
    again every ``per_connection`` searches or after an error, so that the port spreads them over
    the workers. Each answer is noted as ``(time, pid, kind)``: the pid of the worker the connection
    reached (its ``/health``; None when even that failed), and ``ok``, ``busy`` (503: admission),
    ``HTTP <status>`` or the exception's name."""

    def __init__(self, url: str, clients: int, per_connection: int = 20) -> None:
        self.url, self.per_connection = url, per_connection
        self.outcomes: list[tuple[float, int | None, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._search, args=(i,), daemon=True) for i in range(clients)]

    def _search(self, offset: int) -> None:
        asked = offset
        while not self.stop.is_set():
            pid = None
            try:
                with httpx.Client(base_url=self.url, timeout=30) as client:
                    pid = client.get("/health").json()["worker"]["pid"]
                    for _ in range(self.per_connection):
                        if self.stop.is_set():
                            return
                        asked += 1
                        reply = client.post("/search", json={"query": QUERIES[asked % len(QUERIES)], "top_k": 10})
                        kind = {200: "ok", 503: "busy"}.get(reply.status_code, f"HTTP {reply.status_code}")
                        self.outcomes.append((time.perf_counter(), pid, kind))
            except httpx.HTTPError as exc:
                self.outcomes.append((time.perf_counter(), pid, type(exc).__name__))
                time.sleep(0.05)


class DoorWriter:
    """One thread writing through REST, MCP (the official client, its ``add_document`` and
    ``delete_document`` tools) and ``/v1`` DOCUMENT_INGESTION in turn, each on a new connection;
    every fourth write deletes an acknowledged document (REST or MCP in turn). The ledger keeps what
    was acknowledged; ``outcomes`` each answer as ``(sent, answered, door, kind)``: ``acked``,
    ``refused`` (a 503, a tool error or an OVERLOADED message saying the writer is restarting),
    ``HTTP <status>`` or the exception's name (the write is then in doubt: either outcome is right,
    never half)."""

    def __init__(self, url: str, ledger: Ledger, pause_s: float = 0.2) -> None:
        self.url, self.ledger, self.pause_s = url, ledger, pause_s
        self.outcomes: list[tuple[float, float, str, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write, daemon=True)]

    def _write(self) -> None:
        for i in range(1_000_000):
            if self.stop.is_set():
                return
            door = WRITE_DOORS[i % len(WRITE_DOORS)]
            victim = sorted(self.ledger.acked)[0] if i % 4 == 3 and self.ledger.acked else None
            doc_id, word = f"w{i}", f"zxw{i}marker"
            sent = time.perf_counter()
            try:
                if victim is not None:
                    door = "mcp" if door == "mcp" else "rest"  # /v1 has no delete
                    kind = self._delete(door, victim)
                else:
                    kind = self._add(door, document(doc_id, f"{word} chunk"))
            except Exception as exc:  # whatever a client meets (the MCP client's own errors too), by name
                kind = type(exc).__name__
            self.outcomes.append((sent, time.perf_counter(), door, kind))
            if victim is not None:
                del self.ledger.acked[victim]
                (self.ledger.deleted if kind == "acked" else self.ledger.in_doubt).add(victim)
            elif kind == "acked":
                self.ledger.acked[doc_id] = word
                self.ledger.writes += 1
            elif kind != "refused":
                self.ledger.in_doubt.add(doc_id)
            time.sleep(self.pause_s)

    def _add(self, door: str, body: dict[str, Any]) -> str:
        if door == "rest":
            return _kind(httpx.post(f"{self.url}/documents", json=body, timeout=30), 201)
        if door == "mcp":
            return _mcp_call(self.url, "add_document", body)
        message = {
            "type": "DOCUMENT_INGESTION",
            "sender": "IngestionAgent",
            "receiver": "RetrievalAgent",
            "payload": {**body, "embedding_model": "all-MiniLM-L6-v2", "total_chunks": len(body["chunks"])},
        }
        reply = httpx.post(f"{self.url}/v1/messages", json=message, timeout=30)
        if reply.status_code == 200 and reply.json()["type"] == "INGESTION_ACK":
            return "acked"
        return _kind(reply, 200)

    def _delete(self, door: str, doc_id: str) -> str:
        if door == "mcp":
            return _mcp_call(self.url, "delete_document", {"document_id": doc_id})
        return _kind(httpx.delete(f"{self.url}/documents/{doc_id}", timeout=30), 200)


def _kind(reply: httpx.Response, ok_status: int) -> str:
    """``acked``, ``refused`` (503 saying the writer is restarting: REST with Retry-After, ``/v1`` an
    OVERLOADED message without one) or ``HTTP <status>``."""
    if reply.status_code == ok_status:
        return "acked"
    if reply.status_code == 503 and RESTARTING in reply.text:
        return "refused"
    return f"HTTP {reply.status_code}"


def _mcp_call(url: str, tool: str, arguments: dict[str, Any]) -> str:
    from mcp import Client

    async def call():
        async with Client(url + "/mcp") as client:
            return await client.call_tool(tool, arguments)

    result = asyncio.run(call())
    if not result.is_error:
        return "acked"
    return "refused" if RESTARTING in str(result.content) else "tool error"
