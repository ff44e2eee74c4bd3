"""End-to-end load through one of a running server's doors (REST, MCP or A2A), sent as their
clients send it: ``hybrid-search bench rest|mcp|a2a``. Bounded in requests and time; talks only to
the URL given."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Mapping

from engine.documents import SEARCH_TOOL
from offline.latency import percentiles


def a2a_v03_send(part: dict) -> dict:
    """An A2A 0.3 JSON-RPC ``message/send`` request with ``part`` as its one part, as the
    benchmark's evaluator sends it: ``{"kind": "text", "text": ...}`` or ``{"kind": "data", "data": ...}``."""
    message = {"role": "user", "messageId": uuid.uuid4().hex, "kind": "message", "parts": [part]}
    return {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": "message/send", "params": {"message": message}}


async def door_load(
    door: str,
    url: str,
    queries: list[str],
    concurrency: int,
    top_k: int,
    timeout: float,
    documents: list[str] = (),
    bodies: Mapping[str, Mapping] | None = None,
) -> dict:
    """``queries`` sent by ``concurrency`` clients at once (MCP: one session each): QPS and percentiles.
    The ``rerank`` door (``/v1/rerank``) sends each query with ``documents`` and asks for ``top_k``.
    ``bodies`` (REST): each query sent once per named body, these fields added to it, one after the
    other (each body first in turn), so that what they cost is timed under one load; percentiles by
    name under ``bodies``. A server's caches (``--rerank-cache-size 0``) still favour whichever
    body comes second: time bodies with them off.

    REST and A2A go through aiohttp, kept-alive connections, one a client: the load client shares the
    server's cores here, and httpx spent several times aiohttp's CPU a request (docs/experiments.md,
    "The load client"), CPU the server's figures then lacked. MCP goes through the official client (httpx inside)."""
    import aiohttp

    if bodies is not None and door != "rest":
        raise ValueError(f"bodies are sent to the rest door only, not {door}")
    named = dict(bodies or {"": {}})
    latencies: dict[str, list[float]] = {name: [] for name in named}
    errors: Counter[str] = Counter()  # what failed, so that a run with errors says why
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for i, query in enumerate(queries):  # each body first for as many queries as the others: a query's
        order = list(named)  # second sending finds what the first left in the server's caches
        for name in order[i % len(order) :] + order[: i % len(order)]:
            queue.put_nowait((name, query))

    async def worker(client: aiohttp.ClientSession, session) -> None:
        while not queue.empty():
            name, query = queue.get_nowait()
            started = time.perf_counter()
            try:
                await _one_request(door, url, client, session, query, top_k, documents, named[name])
                latencies[name].append(time.perf_counter() - started)
            except Exception as exc:
                errors[f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"] += 1

    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        if door == "mcp":
            from mcp import Client

            async with contextlib.AsyncExitStack() as stack:  # sessions close in reverse, as anyio requires
                opened = [await stack.enter_async_context(Client(url)) for _ in range(concurrency)]
                await asyncio.gather(*(worker(client, s) for s in opened))
        else:
            await asyncio.gather(*(worker(client, None) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "door": door,
        "concurrency": concurrency,
        "errors": sum(errors.values()),
        **({"error_kinds": dict(errors.most_common(5))} if errors else {}),
        "qps": sum(map(len, latencies.values())) / wall,
        **(
            percentiles(latencies[""] or [0.0])
            if bodies is None
            else {"bodies": {name: percentiles(found or [0.0]) for name, found in latencies.items()}}
        ),
    }


async def _one_request(
    door: str, url: str, client, session, query: str, top_k: int, documents: list[str], extra: Mapping
) -> None:
    if door in ("rest", "rerank"):
        if door == "rerank":
            body = {"query": query, "top_n": top_k, "documents": documents}
        else:
            body = {"query": query, "top_k": top_k, **extra}
        async with client.post(url, json=body) as reply:
            reply.raise_for_status()
            found = len((await reply.json())["results"])
        if found != top_k:
            raise ValueError(f"{found} results where {top_k} were asked for")
    elif door == "mcp":
        result = await session.call_tool(SEARCH_TOOL, {"query": query, "top_k": top_k})
        if result.is_error:
            raise ValueError(f"tool error: {result.content[0].text if result.content else ''}")
    elif door == "a2a":
        body = a2a_v03_send({"kind": "text", "text": json.dumps({"query": query, "top_k": top_k})})
        async with client.post(url, json=body) as reply:
            reply.raise_for_status()
            text = await reply.text()
        state = json.loads(text).get("result", {}).get("status", {}).get("state")
        if state != "completed":
            raise ValueError(f"task {state or 'missing'}: {text[:160]}")
    else:
        raise ValueError(f"unknown front door {door!r} (rest, rerank, mcp or a2a)")


def bench_http(
    door: str,
    url: str,
    queries: list[str],
    concurrency: list[int],
    top_k: int = 5,
    timeout: float = 60,
    documents: list[str] = (),
    bodies: Mapping[str, Mapping] | None = None,
) -> dict:
    """End-to-end latency through one front door at each concurrency level (``bodies``: :func:`door_load`)."""
    runs = [asyncio.run(door_load(door, url, queries, c, top_k, timeout, documents, bodies)) for c in concurrency]
    return {"door": door, "url": url, "queries": len(queries), "runs": runs}
