"""Locust users for the three front doors; run by :mod:`benchmarks.reliability.load`.

Each user sends a query in a closed loop and records the outcome under its own name, so the
admitted requests' latency is never mixed with the fast refusals: ``<door> ok``, ``<door>
overloaded`` (503, or a task failed with "server busy") and ``<door> error`` (anything else).
Queries come from the file named by ``LOAD_QUERIES`` (one per line).
"""

from __future__ import annotations

import itertools
import json
import os
import time

import requests
from locust import User, constant, task

from offline.door_load import a2a_v03_send

QUERIES = [q for q in open(os.environ.get("LOAD_QUERIES", "/dev/null")).read().splitlines() if q.strip()] or [
    "does vitamin D prevent falls"
]
_next = itertools.count()


class _Door(User):
    abstract = True
    wait_time = constant(0)
    door = ""

    def on_start(self) -> None:
        self.http = requests.Session()

    def query(self) -> str:
        return QUERIES[next(_next) % len(QUERIES)]

    def record(self, started: float, outcome: str, size: int = 0, error: str | None = None) -> None:
        self.environment.events.request.fire(
            request_type="POST",
            name=f"{self.door} {outcome}",
            response_time=(time.perf_counter() - started) * 1000,
            response_length=size,
            exception=RuntimeError(error) if error else None,
            context={},
        )

    def post(self, path: str, body: dict, headers: dict | None = None) -> requests.Response | None:
        started = time.perf_counter()
        try:
            response = self.http.post(self.host + path, json=body, headers=headers, timeout=60)
        except requests.RequestException as exc:
            self.record(started, "error", error=type(exc).__name__)
            return None
        self.started = started
        return response


class RestUser(_Door):
    door = "rest"

    @task
    def search(self) -> None:
        response = self.post("/search_nfcorpus", {"query": self.query(), "top_k": 10})
        if response is None:
            return
        if response.status_code == 200 and response.json().get("results"):
            self.record(self.started, "ok", len(response.content))
        elif response.status_code == 503 and response.headers.get("Retry-After"):
            self.record(self.started, "overloaded")
        else:
            self.record(self.started, "error", error=f"HTTP {response.status_code}")


class McpUser(_Door):
    """Streamable HTTP by hand (one session per user): initialize, then ``tools/call``."""

    door = "mcp"
    ACCEPT = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}

    def on_start(self) -> None:
        super().on_start()
        hello = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "load", "version": "1"},
            },
        }
        response = self.http.post(self.host + "/mcp", json=hello, headers=self.ACCEPT, timeout=60)
        self.headers = {**self.ACCEPT, "Mcp-Session-Id": response.headers.get("mcp-session-id", "")}
        self.http.post(
            self.host + "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=self.headers
        )

    @task
    def search(self) -> None:
        arguments = {"query": self.query(), "top_k": 10}
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "search_nfcorpus", "arguments": arguments},
        }
        response = self.post("/mcp", body, self.headers)
        if response is None:
            return
        result = _sse_json(response).get("result") or {}
        text = " ".join(c.get("text", "") for c in result.get("content", []))
        if response.status_code == 200 and not result.get("isError") and result.get("structuredContent"):
            self.record(self.started, "ok", len(response.content))
        elif "server busy" in text:
            self.record(self.started, "overloaded")
        else:
            self.record(self.started, "error", error=f"HTTP {response.status_code}: {text[:80]}")


class A2aUser(_Door):
    door = "a2a"

    @task
    def search(self) -> None:
        response = self.post("/", a2a_v03_send({"kind": "data", "data": {"query": self.query(), "top_k": 10}}))
        if response is None:
            return
        task_ = (response.json() if response.status_code == 200 else {}).get("result") or {}
        state = (task_.get("status") or {}).get("state")
        said = json.dumps((task_.get("status") or {}).get("message") or {})
        if state == "completed":
            self.record(self.started, "ok", len(response.content))
        elif state == "failed" and "server busy" in said:
            self.record(self.started, "overloaded")
        else:
            self.record(self.started, "error", error=f"HTTP {response.status_code} state {state}")


def _sse_json(response: requests.Response) -> dict:
    """The JSON-RPC reply in a JSON or a server-sent-events body."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:"):
                return json.loads(line[5:])
        return {}
    try:
        return response.json()
    except ValueError:
        return {}
