"""Reliability, the fast subset of ``python -m benchmarks.reliability``: every door fuzzed (seeded,
bounded), JSON-RPC envelopes the SDK would call internal errors, and admission control."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil

import httpx
import pytest

from benchmarks.reliability import fuzz
from offline.server_process import free_port, serve_args, start_server, stop_server, wait_until_up
from tests.helpers import jsonrpc_send

pytestmark = pytest.mark.slow  # fuzzing and load against real servers
SEED = 20261123


@pytest.fixture(scope="module")
def fuzz_server(index_dir, tmp_path_factory):
    """A writable server on a copy of the tiny index, rate limit out of the way."""
    work = tmp_path_factory.mktemp("fuzz")
    index = shutil.copytree(index_dir, work / "index")
    mcp, a2a = free_port(), free_port()
    extra = ("--mcp-writes", "--agent-rate", "100000/minute", "--trace-db", str(work / "traces.sqlite"))
    proc = start_server(serve_args(index, mcp, *extra, a2a_port=a2a), f"http://127.0.0.1:{mcp}/health", work / "log")
    wait_until_up(f"http://127.0.0.1:{a2a}/")
    yield {"mcp": f"http://127.0.0.1:{mcp}", "a2a": f"http://127.0.0.1:{a2a}/"}
    assert stop_server(proc) == 0


def test_every_rest_route_holds_under_schemathesis(index_dir, tmp_path):
    """In-process, every door keyed: no 5xx, replies as documented, auth enforced where declared."""
    from agents.messages import PAYLOADS
    from agents.system import SYSTEM_ID
    from serving.app import build_apps
    from serving.protocol_routes import hash_key
    from serving.settings import Settings

    key = secrets.token_urlsafe(16)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[agents.{SYSTEM_ID}]\nkey_sha256 = "{hash_key(key)}"\nmessage_types = {json.dumps(sorted(PAYLOADS))}\n'
    )
    settings = Settings(
        index_dir=shutil.copytree(index_dir, tmp_path / "index"),
        device="cpu",
        trace_db=tmp_path / "traces.sqlite",
        agent_keys=keys,
        agent_rate="100000/minute",
        key_all_doors=True,
        max_queue_s=30,
    )
    service, apps = build_apps(settings, mcp=True, a2a=False, writable=True)
    try:
        report = fuzz.fuzz_rest(apps["mcp"][0], 12, SEED, headers={"Authorization": f"Bearer {key}"})
    finally:
        service.close()
    routes = {label.split(" ", 1)[1] for label in report}
    assert {"/search_nfcorpus", "/search", "/documents", "/api/a2a/purple-agent", "/v1/messages", "/health"} <= routes
    failed = [f"{label}: {text}" for label, op in report.items() for text in op["failures"].values()]
    assert not failed, "\n\n".join(failed)
    assert sum(op["statuses"].get("401", 0) for op in report.values()) > 0  # the keyed doors did refuse


def test_mcp_a2a_and_messages_hold_under_fuzzing(fuzz_server):
    assert fuzz.fuzz_mcp(fuzz_server["mcp"] + "/mcp", 120, SEED)["failures"] == {}
    assert fuzz.fuzz_jsonrpc(fuzz_server["a2a"], 150, SEED)["failures"] == {}
    assert fuzz.fuzz_a2a_client(fuzz_server["a2a"], 15, SEED)["failures"] == {}
    assert fuzz.fuzz_messages(fuzz_server["mcp"] + "/v1/messages", 150, SEED)["failures"] == {}
    bombs = fuzz.regex_bombs(fuzz_server["mcp"] + "/api/a2a/purple-agent")
    assert all(b["status"] in (200, 422) and b["ms"] < 5000 for b in bombs.values()), bombs
    assert httpx.get(fuzz_server["mcp"] + "/health", timeout=10).json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, headers, code",
    [
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, {}, -32700),
        (json.dumps({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {}}).encode("utf-16"), {}, -32700),
        (b'{"jsonrpc":"2.0","id":1,"method":"\xff\xfe"}', {}, -32700),
        (b'{"jsonrpc":"2.0","id":1,"method":"message/send"', {}, -32700),
        (
            json.dumps(jsonrpc_send({"a": json.loads('{"a":' * 80 + "1" + "}" * 80)})).encode(),
            {"A2A-Version": "0.3"},
            -32600,
        ),
        (json.dumps(jsonrpc_send({"query": "soy"})).encode(), {"A2A-Version": "1.0"}, -32600),
        (b"[1, 2]", {}, -32600),
    ],
    ids=["nested-5000", "utf-16", "not-utf-8", "truncated", "nested-data-part", "0.3-method-1.0-header", "batch"],
)
def test_malformed_jsonrpc_gets_the_error_json_rpc_names(fuzz_server, body, headers, code):
    reply = httpx.post(fuzz_server["a2a"], content=body, headers={"content-type": "application/json", **headers})
    assert reply.status_code == 200
    error = reply.json()["error"]
    assert error["code"] == code and error["message"], error
    assert "Traceback" not in error["message"]


def test_over_capacity_is_refused_fast_at_every_door(index_dir, tmp_path):
    """One slot, no queue: of 12 concurrent searches some are admitted and the rest refused, each
    door in its own words (503 + Retry-After, a tool error, a failed task), and counted."""
    mcp, a2a = free_port(), free_port()
    args = serve_args(index_dir, mcp, "--read-only", "--max-in-flight", "1", "--max-queue", "0", a2a_port=a2a)
    proc = start_server(
        args + ["--trace-db", str(tmp_path / "t.sqlite")], f"http://127.0.0.1:{mcp}/health", tmp_path / "log"
    )
    try:
        base = f"http://127.0.0.1:{mcp}"

        async def burst(send):
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(send(client, i) for i in range(12)))

        async def rest(client, i):
            return await client.post(base + "/search_nfcorpus", json={"query": f"vitamin bone density {i}"})

        replies = asyncio.run(burst(rest))
        refused = [r for r in replies if r.status_code == 503]
        assert refused and len(refused) < len(replies)
        assert all(r.status_code == 200 for r in replies if r not in refused)
        assert all(int(r.headers["Retry-After"]) >= 1 and "server busy" in r.json()["error"] for r in refused)

        async def a2a_send(client, i):
            body = jsonrpc_send({"query": f"statins cholesterol {i}"})
            return (await client.post(f"http://127.0.0.1:{a2a}/", json=body)).json()["result"]

        tasks = asyncio.run(burst(a2a_send))
        failed = [t for t in tasks if t["status"]["state"] == "failed"]
        assert failed and all("server busy" in json.dumps(t["status"]["message"]) for t in failed)
        assert any(t["status"]["state"] == "completed" for t in tasks)
        metrics = httpx.get(base + "/metrics").text
        assert 'admission_refused_total{door="rest"}' in metrics and 'admission_refused_total{door="a2a"}' in metrics
    finally:
        assert stop_server(proc) == 0
