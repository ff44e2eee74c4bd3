"""Score a running A2A agent the way the NFCorpus green agent does.

Queries with judgments are sampled with ``random.seed(seed); random.sample(queries, n)``, each is
sent as a text part holding ``{"query": ..., "top_k": k}`` through the official A2A client, and the
reply is parsed as the reference parses it: the completion status message's parts and every
artifact's parts joined into one string and read with ``json.loads``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid

import httpx

from offline.dataset import Dataset
from offline.evaluation import evaluate_run, in_list_ndcg, sample_queries
from offline.latency import percentiles


def _part_text(part) -> str:
    if part.HasField("text"):
        return part.text
    if part.HasField("data"):
        from google.protobuf.json_format import MessageToDict

        return json.dumps(MessageToDict(part.data))
    return ""


async def _ask(client, query: str, top_k: int) -> list[str]:
    from a2a.types.a2a_pb2 import Message, Part, Role, SendMessageRequest

    message = Message(
        role=Role.ROLE_USER,
        message_id=uuid.uuid4().hex,
        parts=[Part(text=json.dumps({"query": query, "top_k": top_k}))],
    )
    task = None
    async for event in client.send_message(SendMessageRequest(message=message)):
        if event.HasField("task"):
            task = event.task
    if task is None:
        raise RuntimeError("the agent answered without a task")
    parts = list(task.status.message.parts) if task.status.HasField("message") else []
    parts += [p for artifact in task.artifacts for p in artifact.parts]
    reply = json.loads("".join(_part_text(p) for p in parts))
    doc_ids = reply["doc_ids"]
    if not isinstance(doc_ids, list):
        raise ValueError("'doc_ids' is not a list")
    return [str(d) for d in doc_ids]


async def _run(url: str, queries: list[tuple[str, str]], top_k: int, timeout: float):
    from a2a.client import ClientConfig, create_client

    answers, failures, seconds = {}, {}, []
    async with httpx.AsyncClient(timeout=timeout) as http:
        client = await create_client(url, client_config=ClientConfig(httpx_client=http, streaming=False))
        for qid, text in queries:
            started = time.perf_counter()
            try:
                answers[qid] = await asyncio.wait_for(_ask(client, text, top_k), timeout)
            except Exception as exc:  # any failure scores 0, exactly as the evaluator counts it
                failures[qid] = f"{type(exc).__name__}: {exc}"
            seconds.append(time.perf_counter() - started)
    return answers, failures, seconds


def evaluate_agent(
    url: str, dataset: Dataset, split: str, num_queries: int, seed: int, top_k: int, timeout: float
) -> dict:
    """Per-query in-list NDCG@5 statistics, standard nDCG@5, failures and latency."""
    qrels = dataset.qrels(split)
    queries = sample_queries(dataset.split_queries(split), num_queries, seed)
    answers, failures, seconds = asyncio.run(_run(url, list(queries.items()), top_k, timeout))
    scores = [in_list_ndcg([qrels[q].get(d, 0) for d in answers[q][:5]]) if q in answers else 0.0 for q in queries]
    standard = evaluate_run(qrels, answers) if answers else {}
    return {
        "agent": url,
        "split": split,
        "queries": len(queries),
        "seed": seed,
        "top_k": top_k,
        "in-list NDCG@5": {
            "mean": statistics.fmean(scores),
            "median": statistics.median(scores),
            "std": statistics.pstdev(scores),
            "min": min(scores),
            "max": max(scores),
        },
        "nDCG@5": standard.get("nDCG@5", 0.0) * len(answers) / len(queries),  # a failure scores 0
        "failures": len(failures),
        "failure_examples": dict(list(failures.items())[:5]),
        "latency_ms": percentiles(seconds),
    }
