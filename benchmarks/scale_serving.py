"""``serve --workers 2`` on an index, measured through REST as a user's clients would see it: the
figures the million-chunk issue asks for, and the same on a small index in the same run.

    python -m benchmarks.scale_serving --index-dir /tmp/hybrid-search-scale/index-1000000 --baseline indexes/nfcorpus

Per index (served without a reranker, on a copy when ``--copy``): start-up to both workers
answering; each worker's resident and proportional memory (PSS counts pages the workers share
once); dev queries at 1 client (p50/p95) and at 64 (queries/s, errors); a filter on
``document_type`` at 1 client; then live writes: 10 documents a second through REST for 60 s
while 4 clients search, each acknowledged document looked for on the follower until found
(acknowledgement to visible, and each POST's own time), the writer's bytes written per refresh,
every document read back; and the writer killed with SIGKILL: the time until it serves again,
what it replayed, and the documents still there; last, the dense files the checkpoint at the
clean stop wrote.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx

from benchmarks import options
from offline.dataset import load_dataset
from offline.door_load import bench_http
from offline.latency import percentiles
from offline.records import write_result
from offline.server_process import (
    free_port,
    serve_args,
    sigkill,
    start_server,
    stop_server,
    worker_client,
    workers_up,
)

WRITE_RATE, WRITE_SECONDS, SEARCHERS = 10, 60, 4


def _memory(pid: int) -> dict:
    """Resident and proportional set sizes in MiB (``smaps_rollup``)."""
    found = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, *value = line.split()
        if key in ("Rss:", "Pss:"):
            found[key[:-1].lower() + "_mib"] = round(int(value[0]) / 1024, 1)
    return found


def _written(pid: int) -> int:
    return int(
        next(
            line.split()[1]
            for line in Path(f"/proc/{pid}/io").read_text().splitlines()
            if line.startswith("write_bytes")
        )
    )


def _timed(client: httpx.Client, body: dict) -> float:
    began = time.perf_counter()
    reply = client.post("/search", json=body)
    reply.raise_for_status()
    return time.perf_counter() - began


def _document(i: int) -> dict:
    return {
        "document_id": f"scale-live-{i}",
        "document_name": f"live note {i}",
        "metadata": {"document_type": "live-bench"},
        "chunks": [{"chunk_id": "a", "content": f"live benchmark note {i} about quokka marsupial diets {i * 7919}"}],
    }


def live_writes(url: str, queries: list[str]) -> dict:
    """Writes at ``WRITE_RATE`` a second for ``WRITE_SECONDS`` with ``SEARCHERS`` clients searching."""
    writer, health = worker_client(url, "writer")
    follower, _ = worker_client(url, "follower")
    pid = health["worker"]["pid"]
    stop = threading.Event()
    searched: list[float] = []

    def search() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            for i in range(10**9):
                if stop.is_set():
                    return
                searched.append(_timed(client, {"query": queries[i % len(queries)], "top_k": 10}))

    searchers = [threading.Thread(target=search) for _ in range(SEARCHERS)]
    for thread in searchers:
        thread.start()
    visible: list[float] = []
    acked: dict[str, float] = {}  # acknowledged, not yet seen on the follower: id -> when
    lock, writing, given_up = threading.Lock(), threading.Event(), threading.Event()

    def probe() -> None:  # every acknowledged document looked for on the follower, 50 in one search
        while (writing.is_set() or acked) and not given_up.is_set():
            with lock:
                ids = list(acked)[:50]
            if ids:
                body = {"query": "live benchmark note", "top_k": len(ids), "filters": {"document_ids": ids}}
                seen = {hit["document_id"] for hit in follower.post("/search", json=body).json()["results"]}
                now = time.perf_counter()
                with lock:
                    visible.extend(now - acked.pop(doc_id) for doc_id in seen & set(ids))
            time.sleep(0.01)

    writing.set()
    prober = threading.Thread(target=probe)
    prober.start()
    written_before, began = _written(pid), time.perf_counter()
    n = WRITE_RATE * WRITE_SECONDS
    acknowledging: list[float] = []  # each POST's own time: a write that waits behind a refresh shows here
    for i in range(n):
        time.sleep(max(0.0, began + i / WRITE_RATE - time.perf_counter()))
        sent = time.perf_counter()
        writer.post("/documents", json=_document(i)).raise_for_status()
        with lock:
            acked[f"scale-live-{i}"] = time.perf_counter()
        acknowledging.append(acked[f"scale-live-{i}"] - sent)
    writing.clear()
    prober.join(timeout=30)
    given_up.set()
    prober.join()
    seconds = time.perf_counter() - began
    written = _written(pid) - written_before
    stop.set()
    for thread in searchers:
        thread.join()
    missing = [i for i in range(n) if writer.get(f"/documents/scale-live-{i}").status_code != 200]
    live = writer.get("/health").json().get("live", {})
    writer.close()
    follower.close()
    return {
        "documents": n,
        "seconds": round(seconds, 1),
        "acknowledged_ms": percentiles(acknowledging),
        "ack_to_visible_on_follower_ms": percentiles(visible),
        "searches_meanwhile": {"clients": SEARCHERS, "n": len(searched), **percentiles(searched)},
        "writer_bytes_written": written,
        "writer_bytes_per_document": round(written / n),
        "lost": len(missing),
        "not_seen_on_follower_within_30_s": len(acked),
        "writer_status": live,
    }


def writer_killed(url: str, n: int) -> dict:
    """SIGKILL the writer; the time until a writer answers again, its replay, and the documents kept."""
    _, health = worker_client(url, "writer")
    killed = time.perf_counter()
    sigkill(health["worker"]["pid"])
    client, health = worker_client(url, "writer", seconds=300)
    back = time.perf_counter() - killed
    missing = [i for i in range(n) if client.get(f"/documents/scale-live-{i}").status_code != 200]
    client.close()
    return {"back_in_s": round(back, 1), "recovered": health.get("live", {}).get("recovered"), "lost": len(missing)}


def measure(index: Path, queries: list[str], log: Path, live: bool) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started, began_wall = time.perf_counter(), time.time()
    server = start_server(serve_args(index, port, "--workers", "2", "--no-rerank"), f"{url}/health", log)
    pids = workers_up(url, seconds=300)
    found: dict = {"start_s": round(time.perf_counter() - started, 1)}
    try:
        found["memory"] = {role: _memory(pid) for role, pid in pids.items()}
        found["documents"] = httpx.get(f"{url}/health", timeout=30).json()["documents"]
        bench_http("rest", f"{url}/search", queries[:40], [8], top_k=10)  # warm: both workers
        found["rest"] = bench_http("rest", f"{url}/search", queries, [1, 64], top_k=10)["runs"]
        with httpx.Client(base_url=url, timeout=30) as client:
            body = {"top_k": 10, "filters": {"document_types": ["review"]}}
            cold = _timed(client, {**body, "query": queries[0]})  # the filter's chunks found, then kept
            times = [_timed(client, {**body, "query": q}) for q in queries[:100]]
        found["filter_review_1_client"] = {"first_ms": round(cold * 1000, 1), **percentiles(times)}
        if live:
            found["live"] = live_writes(url, queries)
            found["writer_killed"] = writer_killed(url, found["live"]["documents"])
        found["memory_after"] = {role: _memory(pid) for role, pid in workers_up(url, seconds=300).items()}
    finally:
        found["exit_code"] = stop_server(server)
    if live:  # the checkpoint at the clean stop: what it wrote of the dense index
        found["dense_checkpoint_at_stop"] = {
            p.name: p.stat().st_size
            for p in [*index.glob("dense*.faiss"), *index.glob("delta-*.npz")]
            if p.stat().st_mtime > began_wall
        }
    return found


def main() -> None:
    p = options.parser(__doc__, "data_dir", output="{machine}/scale-serving.json", help={"data_dir": "the dev queries"})
    # required, not the setting's default: the index measured is a large one made for it
    p.add_argument("--index-dir", type=Path, required=True, help="the index measured (written to by --live)")
    p.add_argument("--baseline", type=Path, help="a small index measured the same way first (a copy)")
    p.add_argument("--no-live", dest="live", action="store_false", help="leave out the live writes")
    args, _ = options.load(p)
    queries = list(load_dataset(args.data_dir).split_queries("dev").values())[:200]
    work = Path("/tmp/hybrid-search-scale-serving")
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    if args.baseline is not None:
        copy = work / "baseline"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(args.baseline, copy)
        report["baseline"] = measure(copy, queries, work / "baseline.log", False)
        print(report["baseline"], flush=True)
    report["index"] = measure(args.index_dir, queries, work / "index.log", args.live)
    print(report["index"], flush=True)
    write_result(args.output, report, vars(args))


if __name__ == "__main__":
    main()
