"""What tests share besides fixtures: a small BEIR dataset, a short training run's settings, and
A2A requests made and read the way the official clients do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np

from engine.retrieval.protocol import Query, Ranking, Within
from offline.door_load import a2a_v03_send
from offline.server_process import CLI, ROOT, free_port

TOPICS = {
    "vitamin": "vitamin D supplements bone density falls elderly calcium",
    "statin": "statins cholesterol breast cancer survival cohort",
    "soy": "soy isoflavones prostate cancer risk men",
    "coffee": "coffee caffeine liver enzymes hepatitis",
    "broccoli": "broccoli sulforaphane cruciferous vegetables detoxification",
    "arsenic": "arsenic rice brown rice contamination children",
    "meat": "processed meat nitrites colorectal cancer",
    "berries": "blueberries anthocyanins memory cognition aging",
}
FILLER = "this study examined participants in a randomized trial and reported outcomes over several years"


def write_beir(root: Path) -> Path:
    """Eight topics, four documents each; rare marker words make BM25 behaviour predictable."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    docs, queries, dev, train = [], [], [], []
    for topic, words in TOPICS.items():
        for i in range(4):
            doc_id = f"D-{topic}-{i}"
            title = "" if i == 3 else f"{topic.title()} report {i}"
            docs.append({"_id": doc_id, "title": title, "text": f"{words} {FILLER} marker{topic}{i}"})
        queries.append({"_id": f"Q-dev-{topic}", "text": f"does {words.split()[0]} {words.split()[1]} matter"})
        queries.append({"_id": f"Q-train-{topic}", "text": f"{words.split()[2]} and {words.split()[3]} effects"})
        dev += [(f"Q-dev-{topic}", f"D-{topic}-0", 2), (f"Q-dev-{topic}", f"D-{topic}-1", 1)]
        train += [(f"Q-train-{topic}", f"D-{topic}-{i}", 1 + (i == 0)) for i in range(2)]
    with open(root / "corpus.jsonl", "w", newline="") as fh:
        fh.writelines(json.dumps(d) + "\r\n" for d in docs)
    with open(root / "queries.jsonl", "w") as fh:
        fh.writelines(json.dumps(q) + "\n" for q in queries)
    for name, rows in (("dev", dev), ("train", train)):
        with open(root / "qrels" / f"{name}.tsv", "w", newline="") as fh:
            fh.write("query-id\tcorpus-id\tscore\r\n")
            fh.writelines(f"{q}\t{d}\t{s}\r\n" for q, d, s in rows)
    return root


def short_training(index_dir: Path, beir_dir: Path, tmp_path: Path, **options):
    """A copy of the tiny index to train into, its settings (64 tokens, depth 8) and the options of a
    short run (4 queries of 4 documents a step, from each query's top 12), ``options`` on top."""
    import shutil

    from engine.settings import EngineSettings
    from index_build.train_reranker import TrainOptions

    work = tmp_path / "idx"
    shutil.copytree(index_dir, work)
    settings = EngineSettings(index_dir=work, device="cpu", max_length=64, rerank_depth=8)
    return settings, TrainOptions(**{"batch_queries": 4, "group_size": 4, "mine_depth": 12, **options})


def jsonrpc_send(data: dict) -> dict:
    """An A2A 0.3 ``message/send`` request carrying ``data`` as its one data part."""
    return a2a_v03_send({"kind": "data", "data": data})


def a2a_v1_send(url: str, parts) -> object:
    """Send ``parts`` with the official a2a-sdk 1.x client; the final task."""
    from a2a.client import ClientConfig, create_client
    from a2a.types.a2a_pb2 import Message, Role, SendMessageRequest

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            client = await create_client(url, client_config=ClientConfig(httpx_client=http, streaming=False))
            message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=parts)
            task = None
            async for event in client.send_message(SendMessageRequest(message=message)):
                if event.HasField("task"):
                    task = event.task
            return task

    return asyncio.run(run())


def only_doc_ids(task) -> list[str]:
    """The doc ids of an A2A task that completed with exactly one data part and no text anywhere."""
    from a2a.types.a2a_pb2 import TaskState
    from google.protobuf.json_format import MessageToDict

    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    assert not task.status.HasField("message") or not task.status.message.parts
    assert len(task.artifacts) == 1 and len(task.artifacts[0].parts) == 1
    part = task.artifacts[0].parts[0]
    assert part.HasField("data") and not part.text
    data = MessageToDict(part.data)
    assert set(data) == {"doc_ids"}
    return data["doc_ids"]


def fails_to_serve(args: list[str]) -> str:
    """``hybrid-search`` run with ``args`` (a ``serve`` meant to fail at start): it must exit 2 with a
    CLI error, no traceback; its stderr."""
    run = subprocess.run(
        CLI + args, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    return run.stderr


@contextlib.contextmanager
def chat_completions_server(reply: Callable[[dict], str | None]) -> Iterator[tuple[str, list, Callable[[], None]]]:
    """A stand-in for an OpenAI-compatible server on 127.0.0.1: the real chat-completions wire
    format, ``reply(request body)`` as the assistant's text (None: a 500), every request body kept.
    Yields its base URL (``.../v1``), the bodies, and a call that stops it early."""
    import threading

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[dict] = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        text = reply(body)
        if text is None:
            return JSONResponse({"error": {"message": "stand-in failure", "type": "server_error"}}, status_code=500)
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(seen)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49},
            }
        )

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])]),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    try:
        yield f"http://127.0.0.1:{port}/v1", seen, stop
    finally:
        stop()


def writable_engine(index_dir: Path, folder: Path):
    """A CPU engine that writes into its own copy of ``index_dir`` (in ``folder``), no reranker:
    live documents a test adds reach no other test."""
    import shutil

    from engine.search import HybridEngine
    from engine.settings import EngineSettings

    target = folder / "live"
    shutil.copytree(index_dir, target)
    return HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank=False), writable=True)


def retrieved(
    retriever, query: str | np.ndarray, k: int, allowed=None, rows=None, exclude: str | None = None
) -> Ranking:
    """``retriever``'s top ``k`` for a text or a vector, through its one API (``retrieve``)."""
    asked = Query(query, None, exclude) if isinstance(query, str) else Query("", query, exclude)
    return retriever.retrieve(asked, k, Within(allowed=allowed, rows=rows))
