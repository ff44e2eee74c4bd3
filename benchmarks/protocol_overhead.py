"""What the agent message protocol costs: the router against calling the engine, and a RAG turn.

    python -m benchmarks.protocol_overhead --queries 100 [--url http://127.0.0.1:8000]

In-process: ``engine.search`` against ``router.send(RETRIEVAL_REQUEST)`` on the same engine (no
reranker, so the router's share shows), and a RAG turn's two legs. With ``--url`` (a running
``hybrid-search serve``): ``POST /search`` against ``POST /v1/messages`` one at a time, and
messages/s with 8 clients. Writes ``benchmarks/results/<machine>/protocol-overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from agents.messages import Message
from agents.settings import AgentSettings
from agents.system import RagRequest, build_responder, build_router, rag_turn
from agents.traces import TraceStore
from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result


def in_process(queries: list[str]) -> dict:
    engine = HybridEngine(EngineSettings(rerank=False))
    with tempfile.TemporaryDirectory() as tmp:
        router = build_router(engine, TraceStore(Path(tmp) / "t.sqlite"), build_responder(engine, AgentSettings()))
        direct, routed, legs = [], [], {"retrieval": [], "response": [], "turn": []}
        engine.search(queries[0], 5)  # warm up before timing

        async def run() -> None:
            for query in queries:
                t0 = time.perf_counter()
                engine.search(query, 5)
                t1 = time.perf_counter()
                message = Message(
                    type="RETRIEVAL_REQUEST",
                    sender="System",
                    receiver="RetrievalAgent",
                    payload={"query": query, "top_k": 5},
                )
                await router.send(message)
                t2 = time.perf_counter()
                direct.append(t1 - t0)
                routed.append(t2 - t1)
                turn = await rag_turn(router, RagRequest(question=query, top_k=5))
                legs["turn"].append(time.perf_counter() - t2)
                stored = router.traces.trace(turn["conversation_id"])
                legs["retrieval"].append(stored[1]["duration_ms"] / 1000)
                legs["response"].append(stored[3]["duration_ms"] / 1000)

        asyncio.run(run())
        router.traces.close()
    overhead = [r - d for r, d in zip(routed, direct, strict=True)]
    return {
        "engine_search": percentiles(direct),
        "router_retrieval": percentiles(routed),
        "router_overhead": percentiles(overhead),
        "rag_turn": {name: percentiles(values) for name, values in legs.items()},
    }


def over_http(url: str, queries: list[str], clients: int = 8) -> dict:
    def message(query: str) -> dict:
        return {
            "type": "RETRIEVAL_REQUEST",
            "sender": "System",
            "receiver": "RetrievalAgent",
            "payload": {"query": query, "top_k": 5},
        }

    rest, routed = [], []
    with httpx.Client(timeout=60) as client:
        for query in queries:
            t0 = time.perf_counter()
            client.post(f"{url}/search", json={"query": query, "top_k": 5}).raise_for_status()
            t1 = time.perf_counter()
            client.post(f"{url}/v1/messages", json=message(query)).raise_for_status()
            rest.append(t1 - t0)
            routed.append(time.perf_counter() - t1)

    async def load() -> float:
        async with httpx.AsyncClient(timeout=120) as client:
            todo = list(queries)

            async def worker() -> None:
                while todo:
                    (await client.post(f"{url}/v1/messages", json=message(todo.pop()))).raise_for_status()

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            return len(queries) / (time.perf_counter() - started)

    return {
        "rest_search": percentiles(rest),
        "v1_messages": percentiles(routed),
        f"messages_per_s_{clients}_clients": round(asyncio.run(load()), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--url", help="a running `hybrid-search serve` (its MCP/REST port)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    queries = list(load_dataset(BuildSettings().data_dir).split_queries("dev").values())[: args.queries]
    out = args.output or Path("benchmarks/results") / machine_name() / "protocol-overhead.json"
    report = {"queries": len(queries), "in_process": in_process(queries)}
    write_result(out, report, vars(args))
    if args.url:  # start the server with a high --agent-rate, or the load part meets the rate limit
        report["http"] = over_http(args.url.rstrip("/"), queries)
        write_result(out, report, vars(args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
