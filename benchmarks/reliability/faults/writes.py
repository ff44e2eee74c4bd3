"""Writes that a fault interrupts: kill -9 while a server writes, and a disk that fills. What an
acknowledgement promises is tested only when the process or the disk fails right after it, so both
count, after a restart, every acknowledged write lost, every one half-applied and every refused or
deleted one that came back."""

from __future__ import annotations

import random
import resource
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.reliability.faults.drivers import write_until_killed
from benchmarks.reliability.faults.harness import Ledger, copy_index, document, in_process
from benchmarks.reliability.faults.results import DiskFull, FullHealth, SigkillRounds
from offline.server_process import free_port, serve_args, start_server, stop_server


def sigkill_rounds(index_dir: Path, work_dir: Path, rounds: int = 20, seed: int = 7) -> SigkillRounds:
    """``rounds`` times: start a server on a copy of the index, check what the earlier rounds
    acknowledged (all by id, the last round's also by its own word), then write and delete until
    the server is SIGKILLed. Last, the copy is opened in-process as a start opens it (the log
    replayed) and every acknowledged document is checked by id and by word. Without the reranker:
    durability does not depend on it, and a start is quicker."""
    index = copy_index(index_dir, work_dir / "sigkill")
    rng, ledger = random.Random(seed), Ledger()
    port, replayed, started = free_port(), 0, time.perf_counter()
    url = f"http://127.0.0.1:{port}"
    for round_ in range(rounds):
        proc = start_server(serve_args(index, port, "--no-rerank"), f"{url}/health", work_dir / f"sigkill-{round_}.log")
        with httpx.Client(base_url=url, timeout=30) as client:
            replayed += client.get("/health").json()["live"]["recovered"]["records"]
            ledger.check(client, [d for d in ledger.acked if d.startswith(f"r{round_ - 1}-")])
            write_until_killed(client, proc, round_, rng, ledger)
    with in_process(index, work_dir, writable=True, rerank=False) as (client, service):
        replayed += service.engine.live.recovery["records"]
        ledger.check(client, ledger.acked)
    return SigkillRounds(rounds, ledger.counts(), replayed, round(time.perf_counter() - started, 1))


def _file_size_limit(limit_bytes: int) -> Callable[[], None]:
    """For the child: files may not grow past ``limit_bytes``, and a write past it fails (EFBIG)
    instead of killing the process with SIGXFSZ: a full disk, for this process only."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


def disk_full(index_dir: Path, work_dir: Path, limit_bytes: int = 512 << 10) -> DiskFull:
    """Write to a server whose files may not grow past ``limit_bytes`` until it refuses (every tenth
    write waits to be searchable, which a store that cannot grow fails: a 503 that says the write
    is logged, and so must survive); check that it still searches, then restart it without the
    limit and check every acknowledged write."""
    index = copy_index(index_dir, work_dir / "disk-full")
    port = free_port()
    url, ledger, logged_only = f"http://127.0.0.1:{port}", Ledger(), 0
    args = serve_args(index, port, "--refresh-interval", "0.2", "--no-rerank")
    proc = start_server(args, f"{url}/health", work_dir / "disk-full.log", _file_size_limit(limit_bytes))
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for i in range(100_000):
                doc_id, word = f"full-{i}", f"zxfull{i}marker"
                wait = {"refresh": "wait_for"} if i % 10 == 9 else {}
                reply = client.post("/documents", json=document(doc_id, f"{word} chunk"), params=wait)
                if reply.status_code == 503 and "logged as write" in _error_of(reply):
                    logged_only += 1
                elif reply.status_code not in (200, 201):
                    refused = reply
                    break
                ledger.acked[doc_id] = word
            ledger.deleted.add(doc_id)  # refused, so it must not appear
            searches = [client.post("/search", json={"query": "vitamin D", "top_k": 5}) for _ in range(5)]
            time.sleep(0.5)  # a refresh or two under the limit
            health = client.get("/health").json()
    finally:
        exit_code = stop_server(proc)
    with in_process(index, work_dir, writable=True, rerank=False) as (client, _):  # restarted, no limit
        ledger.check(client, ledger.acked)
    return DiskFull(
        limit_bytes=limit_bytes,
        acknowledged_before=len(ledger.acked),
        refused_status=refused.status_code,
        refused_error=_error_of(refused),
        logged_not_yet_searchable=logged_only,
        searches_while_full=sum(r.status_code == 200 and len(r.json()["results"]) == 5 for r in searches),
        health_while_full=FullHealth(health["status"], health["live"]["refresh_error"]),
        exit_code_while_full=exit_code,
        lost=len(ledger.lost),
        half_applied=len(ledger.half_applied),
        refused_present=len(ledger.resurrected),
    )


def _error_of(reply: httpx.Response) -> str:
    try:
        return reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return reply.text[:300]
