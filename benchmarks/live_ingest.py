"""Live documents on this machine: ingest throughput, acknowledgement to searchable, crash recovery,
and search latency while ingesting against idle.

    python -m benchmarks.live_ingest --documents 300 --recovery 100,1000

Works on a copy of the index (``--index-dir``, default the NFCorpus build), never the index
itself. New documents are made from the corpus's own abstracts (each split into two chunks under
a new id), so they look like what the index holds. Searches run in-process without the reranker,
so the figures are the live index's own cost. Writes
``benchmarks/results/<machine>/live-ingest.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import options
from engine.documents import DocumentIn, Filters
from engine.settings import EngineSettings
from offline.latency import percentiles
from offline.records import write_result


def _documents(settings: EngineSettings, n: int, offset: int = 0) -> list[DocumentIn]:
    from engine.store.docstore import DocStore
    from engine.store.index_dir import DOCS_FILE

    store = DocStore(Path(settings.index_dir) / DOCS_FILE)
    units = sorted(store.unit_map().unit_ids())
    chunks = store.chunks(units[(offset + i) % len(units)] for i in range(n))
    docs = []
    for i, unit in enumerate(units[(offset + j) % len(units)] for j in range(n)):
        words = chunks[unit].text.split() or ["empty"]
        half = max(1, len(words) // 2)
        docs.append(
            DocumentIn(
                document_id=f"live-{offset + i}",
                document_name=chunks[unit].title or unit,
                metadata={"document_type": "live-bench"},
                chunks=[
                    {"chunk_id": "a", "content": " ".join(words[:half])},
                    {"chunk_id": "b", "content": " ".join(words[half:]) or "end"},
                ],
            )
        )
    return docs


def _engine(settings: EngineSettings):
    from engine.search import HybridEngine

    return HybridEngine(settings.model_copy(update={"rerank": False}), writable=True)


def ingest_and_visibility(settings: EngineSettings, n: int, probes: int) -> dict:
    engine = _engine(settings)
    try:
        docs = _documents(settings, n)
        started = time.perf_counter()
        for doc in docs:
            engine.live.upsert(doc)
        acked = time.perf_counter() - started
        engine.live.refresh()
        applied = time.perf_counter() - started
        chunks = sum(len(d.chunks) for d in docs)
        waits = []
        for doc in _documents(settings, probes, offset=n):
            engine.live.upsert(doc)
            t0 = time.perf_counter()
            only = Filters(document_ids=[doc.document_id])
            while not engine.search(doc.chunks[0].content[:200], 1, only):
                time.sleep(0.005)
            waits.append(time.perf_counter() - t0)
        return {
            "documents": n,
            "chunks": chunks,
            "ack_seconds": round(acked, 2),
            "chunks_per_s_acknowledged": round(chunks / acked, 1),
            "chunks_per_s_searchable": round(chunks / applied, 1),
            "visible_ms": percentiles(waits),
            "refresh_interval_s": settings.refresh_interval_s,
        }
    finally:
        engine.close()


def search_latency(settings: EngineSettings, queries: list[str], ingest: bool) -> dict:
    engine = _engine(settings)
    stop = threading.Event()
    written = [0]

    def writer():
        for doc in _documents(settings, 10_000, offset=50_000):
            if stop.is_set():
                return
            engine.live.upsert(doc)
            written[0] += 1

    thread = threading.Thread(target=writer) if ingest else None
    try:
        if thread:
            thread.start()
        times = []
        for query in queries:
            t0 = time.perf_counter()
            engine.search(query, 10)
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        if thread:
            thread.join()
        engine.close()
    return {
        "while_ingesting": ingest,
        "latency_ms": percentiles(times),
        "documents_written_meanwhile": written[0],
    }


def _write_then_die(settings: EngineSettings, n: int) -> None:
    engine = _engine(settings)
    for doc in _documents(settings, n, offset=100_000):
        engine.live.upsert(doc)
    os._exit(0)  # no checkpoint: the next start must replay every record


def recovery(settings: EngineSettings, n: int) -> dict:
    child = multiprocessing.get_context("spawn").Process(target=_write_then_die, args=(settings, n))
    child.start()
    child.join()
    log_bytes = (Path(settings.index_dir) / "wal.log").stat().st_size
    started = time.perf_counter()
    engine = _engine(settings)
    opened = time.perf_counter() - started
    result = {"records": engine.live.recovery["records"], "log_mb": round(log_bytes / 2**20, 1)}
    result.update(replay_seconds=engine.live.recovery["seconds"], open_seconds=round(opened, 2))
    engine.close()
    return result


def main() -> None:
    parser = options.parser(__doc__, *options.WHERE, output="{machine}/live-ingest.json")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--probes", type=int, default=30, help="writes timed from acknowledgement to searchable")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--recovery", default="100,1000", help="logged records to replay after a crash")
    args, _ = options.load(parser)
    from offline.dataset import load_dataset

    queries = list(load_dataset(args.data_dir).split_queries("dev").values())[: args.queries]
    report: dict = {"index": str(args.index_dir)}
    with tempfile.TemporaryDirectory(prefix="live-bench-") as tmp:
        copy = Path(tmp) / "index"

        def fresh() -> EngineSettings:
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(args.index_dir, copy, ignore=shutil.ignore_patterns("reranker"))
            return EngineSettings(index_dir=copy, device="auto")

        report["ingest"] = ingest_and_visibility(fresh(), args.documents, args.probes)
        settings = fresh()
        report["search"] = [search_latency(settings, queries, False), search_latency(settings, queries, True)]
        report["recovery"] = [recovery(fresh(), int(n)) for n in args.recovery.split(",")]
    write_result(args.output, report, vars(args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
