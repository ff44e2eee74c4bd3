"""Snapshots under load: a served copy of the NFCorpus index takes searches from many clients and
writes at a steady rate, a snapshot is taken over REST mid-load, then restored and checked.

    python -m benchmarks.snapshots --clients 64 --writes-per-s 10 --before-s 20 --after-s 10

It measures: the searches that failed (the server is given room to queue them, ``--max-queue``
and ``--query-timeout`` of 300 s, so that a failure is the snapshot's, not load shedding); the
snapshot's seconds, bytes (linked and copied) and how long writes waited for it; search latency
while it was taken against the rest of the run; the restore's seconds. Then it checks the restored
index: it holds every write acknowledged at or before the snapshot's position (``seq``) and none
after, and its top 10 for every dev query is that of a reference made independently of the
snapshot: the original index with the server's own log replayed up to the position (the writes are
new documents, so Lucene's statistics do not depend on how its segments were merged). Works on
copies, never the index itself; writes ``benchmarks/results/<machine>/snapshots.json``.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import options
from engine.settings import EngineSettings
from offline.dataset import Dataset, load_dataset
from offline.latency import percentiles
from offline.records import write_result
from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server

LEFT_OUT = shutil.ignore_patterns("reports", "writer.lock", "published", "*.snapshots")


def replayed_copy(base: Path, records: list[dict], upto: int, target: Path, settings: EngineSettings) -> Path:
    """``base`` copied to ``target`` with the logged ``records`` up to write ``upto`` replayed into
    it and checkpointed: the index as it stood at that write, made without any snapshot."""
    from engine.search import HybridEngine
    from engine.store.index_dir import WAL_FILE
    from engine.store.wal import WriteAheadLog

    shutil.copytree(base, target, ignore=LEFT_OUT)
    log = WriteAheadLog(target / WAL_FILE)
    for record in records:
        if record["seq"] <= upto:
            log.append(record)
    log.close()
    HybridEngine(settings.model_copy(update={"index_dir": target, "rerank": False}), writable=True).close()
    return target


def opened(index_dir: Path, settings: EngineSettings):
    """A read-only engine on ``index_dir``, without the reranker."""
    from engine.search import HybridEngine

    return HybridEngine(settings.model_copy(update={"index_dir": index_dir, "rerank": False}))


def top10(engine, queries: dict[str, str]) -> dict[str, list[str]]:
    """Each query's top 10 chunk ids."""
    return {qid: [hit.doc_id for hit in engine.search(text, 10)] for qid, text in queries.items()}


async def _load(url: str, queries: list[str], documents: list[dict], args) -> dict:
    """``args.clients`` searching without pause and ``args.writes_per_s`` writes a second; a snapshot
    after ``args.before_s``; the load goes on ``args.after_s`` after it is answered."""
    searches: list[tuple[float, float, int]] = []  # (start, seconds, status)
    acks: list[dict] = []
    failed_writes: list[str] = []
    stop = asyncio.Event()
    # a client each: searches, writes (unbounded: they may queue past the clients) and the snapshot, so
    # that none waits for another's connection
    one = {"base_url": url, "timeout": 600}
    async with (
        httpx.AsyncClient(**one, limits=httpx.Limits(max_connections=args.clients)) as http,
        httpx.AsyncClient(**one, limits=httpx.Limits(max_connections=None)) as writes,
        httpx.AsyncClient(**one) as asking,
    ):

        async def client(n: int) -> None:
            i = n
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    status = (
                        await http.post("/search", json={"query": queries[i % len(queries)], "top_k": 10})
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                searches.append((started, time.perf_counter() - started, status))
                i += args.clients

        async def write(document: dict) -> None:
            try:
                reply = await writes.post("/documents", json=document)
                if reply.status_code in (200, 201):
                    acks.append(
                        {"document_id": document["document_id"], "seq": reply.json()["seq"], "at": time.perf_counter()}
                    )
                else:
                    failed_writes.append(f"{reply.status_code}: {reply.text[:200]}")
            except httpx.HTTPError as exc:
                failed_writes.append(str(exc))

        async def writer() -> None:
            pending, n, began = [], 0, time.perf_counter()
            while not stop.is_set() and n < len(documents):
                pending.append(asyncio.create_task(write(documents[n])))
                n += 1
                await asyncio.sleep(max(0.0, began + n / args.writes_per_s - time.perf_counter()))
            await asyncio.gather(*pending)

        tasks = [asyncio.create_task(client(n)) for n in range(args.clients)] + [asyncio.create_task(writer())]
        began = time.perf_counter()
        await asyncio.sleep(args.before_s)
        asked = time.perf_counter()
        reply = await asking.post("/snapshots")
        answered = time.perf_counter()
        await asyncio.sleep(args.after_s)
        stop.set()
        await asyncio.gather(*tasks)
        listed = (await asking.get("/snapshots")).json()
    if reply.status_code != 201:
        raise SystemExit(f"POST /snapshots answered {reply.status_code}: {reply.text}")
    during = [s for start, s, _ in searches if asked <= start <= answered]
    other = [s for start, s, _ in searches if not asked <= start <= answered]
    return {
        "snapshot": reply.json(),
        "snapshot_round_trip_s": round(answered - asked, 3),
        "listed": [s["name"] for s in listed["snapshots"]],
        "run_s": round(time.perf_counter() - began, 1),
        "searches": len(searches),
        "failed_searches": sum(status != 200 for _, _, status in searches),
        "search_ms_while_snapshotting": percentiles(during) | {"n": len(during)} if during else None,
        "search_ms_otherwise": percentiles(other) | {"n": len(other)},
        "writes_acknowledged": len(acks),
        "writes_failed": failed_writes,
        "acks": acks,
    }


def _documents(dataset: Dataset, n: int) -> list[dict]:
    """New documents (``snap-<i>``) made of the corpus's own abstracts, so that they rank among it."""
    texts = [doc for _, doc in zip(range(n), dataset.corpus.values(), strict=False)]
    return [
        {
            "document_id": f"snap-{i}",
            "document_name": f"copy of {doc.title[:80]}",
            "metadata": {"document_type": "snapshot-bench"},
            "chunks": [{"chunk_id": "a", "content": doc.text or doc.title or "empty"}],
        }
        for i, doc in enumerate(texts)
    ]


def main() -> None:
    p = options.parser(__doc__, *options.WHERE, split=True, output="{machine}/snapshots.json")
    p.add_argument("--clients", type=int, default=64, help="searching clients, each without pause (default 64)")
    p.add_argument("--writes-per-s", type=float, default=10.0, help="new documents written a second (default 10)")
    p.add_argument("--before-s", type=float, default=20.0, help="seconds of load before the snapshot (default 20)")
    p.add_argument("--after-s", type=float, default=10.0, help="seconds of load after it is answered (default 10)")
    args, settings = options.load(p)
    engine = settings.engine.model_copy(update={"device": "cpu"})
    dataset = load_dataset(args.data_dir)
    dev = dataset.split_queries(args.split)
    documents = _documents(dataset, int(args.writes_per_s * (args.before_s + args.after_s + 600)))
    with tempfile.TemporaryDirectory(prefix="snapshots-bench-") as tmp:
        work = Path(tmp)
        served, snapshots = work / "served", work / "snapshots"
        shutil.copytree(args.index_dir, served, ignore=LEFT_OUT)
        port = free_port()
        extra = ["--no-rerank", "--max-queue", "300", "--query-timeout", "300", "--snapshots-dir", str(snapshots)]
        proc = start_server(serve_args(served, port, *extra), f"http://127.0.0.1:{port}/health", work / "serve.log")
        try:
            load = asyncio.run(_load(f"http://127.0.0.1:{port}", list(dev.values()), documents, args))
            from engine.store.index_dir import WAL_FILE
            from engine.store.wal import read_records

            records = read_records(served / WAL_FILE)  # before the stop's checkpoint empties it
        finally:
            code = stop_server(proc)
        taken = load["snapshot"]
        served_ms = re.findall(r"POST /snapshots -> 201 in ([\d.]+) ms", (work / "serve.log").read_text())
        load["snapshot_server_ms"] = float(served_ms[0]) if served_ms else None
        seq = taken["seq"]
        if [r["seq"] for r in records[:seq]] != list(range(1, seq + 1)):
            raise SystemExit("the server's log does not hold every write up to the snapshot: no reference")

        started = time.perf_counter()
        restored = work / "restored"
        run = subprocess.run(
            [*CLI, "snapshot", "restore", taken["path"], "--index-dir", str(restored), "--device", "cpu"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        restore_s = time.perf_counter() - started
        if run.returncode:
            raise SystemExit(f"restore failed: {run.stderr[-2000:]}")
        reference = replayed_copy(Path(args.index_dir), records, seq, work / "reference", engine)

        acks = load.pop("acks")
        held = [a for a in acks if a["seq"] <= seq]
        answered = opened(restored, engine)
        try:
            missing = [a["document_id"] for a in held if answered.store.document(a["document_id"]) is None]
            extra = [a["document_id"] for a in acks if a["seq"] > seq and answered.store.document(a["document_id"])]
            got = top10(answered, dev)
        finally:
            answered.close()
        expected = opened(reference, engine)
        try:
            differ = sorted(q for q, ids in top10(expected, dev).items() if got[q] != ids)
        finally:
            expected.close()
    lscpu = subprocess.run("lscpu | head", shell=True, capture_output=True, text=True).stdout.splitlines()
    result = {
        "clients": args.clients,
        "writes_per_s": args.writes_per_s,
        **load,
        "server_exit_code": code,
        "restore": {"cli_seconds": round(restore_s, 2), "said": run.stdout.strip()},
        "restored": {
            "seq": seq,
            "acknowledged_at_or_before": len(held),
            "missing_of_them": missing,
            "acknowledged_after": len(acks) - len(held),
            "present_of_them": extra,
            "dev_queries": len(dev),
            "top10_differ": differ,
        },
        "million_chunks": "not measured: no million-chunk index on this machine",
        "lscpu": lscpu,
    }
    print(
        f"{load['searches']} searches ({load['failed_searches']} failed), {load['writes_acknowledged']} writes;"
        f" snapshot at write {seq}: {taken['files']} files, {taken['bytes'] / 1e6:.1f} MB"
        f" ({taken['linked_bytes'] / 1e6:.1f} MB linked) in {taken['seconds']} s, writes held"
        f" {taken['writes_held_s'] * 1000:.0f} ms; restored in {restore_s:.1f} s: {len(missing)} of {len(held)}"
        f" acknowledged writes missing, {len(extra)} later ones present, {len(differ)} of {len(dev)} dev top-10s differ"
    )
    print(write_result(args.output, result, vars(args)))


if __name__ == "__main__":
    main()
