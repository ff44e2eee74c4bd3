"""Faults, measured: damaged index files, a full disk, kill -9 and SIGTERM while the server works,
kill -9 of either worker of ``serve --workers 2`` under load, a reranker and an LLM server that
fail. Everything runs on copies of an index (never the index itself) and reports what a client
would see: refused or not and why, writes acknowledged and lost, requests answered while the
server stops.

    python -m benchmarks.reliability.faults --index-dir indexes/nfcorpus --rounds 20 \\
        --out benchmarks/results/reliability-faults.json
    python -m benchmarks.reliability.faults --faults workers      # one part; the file keeps the others

``tests/test_faults.py`` runs the same functions on the tests' tiny index, with fewer rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.settings import EngineSettings
from engine.store.index_dir import BM25_DIR, DOCS_FILE, MANIFEST_FILE, WAL_FILE, IndexDirError, latest_dense
from offline.records import write_result
from offline.server_process import (
    ServerExited,
    free_port,
    serve_args,
    sigkill,
    start_server,
    stop_server,
    worker_client,
    workers_up,
)

if TYPE_CHECKING:
    from starlette.testclient import TestClient

    from serving.search_service import SearchService

ERROR_PREFIX = "hybrid-search: error: "


def document(doc_id: str, text: str) -> dict:
    """A two-chunk document (a half-applied write would show one chunk, or a mix)."""
    return {
        "document_id": doc_id,
        "document_name": f"{doc_id}.txt",
        "chunks": [{"chunk_id": "c1", "content": text}, {"chunk_id": "c2", "content": f"{text} continued"}],
    }


def _copy(index_dir: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(index_dir, target, ignore=shutil.ignore_patterns("writer.lock"))
    return target


# ---------------------------------------------------------------- damaged files


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _overwrite_page(path: Path) -> Path:
    """Garbage over the store's second page (a b-tree page: the damage a bad sector does)."""
    with open(path, "r+b") as fh:
        fh.seek(4096)
        fh.write(random.Random(0).randbytes(4096))
    return path


def _drop_segment_file(index: Path) -> Path:
    victim = max((index / BM25_DIR).glob("_*"), key=lambda p: p.stat().st_size)
    victim.unlink()
    return victim


def _drop_store_row(index: Path) -> Path:
    """One chunk fewer in the store than vectors in the dense index: rows would name wrong documents."""
    with sqlite3.connect(index / DOCS_FILE) as conn:
        conn.execute("DELETE FROM chunks WHERE row = (SELECT max(row) FROM chunks)")
    return index / DOCS_FILE


def _tear_log_tail(index: Path) -> Path:
    """The last record cut short, as a crash mid-append leaves it."""
    wal = index / WAL_FILE
    wal.write_bytes(wal.read_bytes()[:-10])
    return wal


def _damage_log_head(index: Path) -> Path:
    """A byte flipped inside the first record, with whole records after it."""
    wal = index / WAL_FILE
    raw = bytearray(wal.read_bytes())
    raw[20] ^= 0xFF
    wal.write_bytes(bytes(raw))
    return wal


@dataclass(frozen=True)
class Corruption:
    """One way an index breaks. ``logged``: it needs writes still in the log (an index whose server
    crashed); ``recovers``: the server must start anyway (a torn log tail is a crash's, and cut)."""

    name: str
    damage: Callable[[Path], Path]  # damages the copy it is given; returns the file it damaged
    logged: bool = False
    recovers: bool = False


CORRUPTIONS = [
    Corruption("dense index truncated", lambda index: _truncate(latest_dense(index).base)),
    Corruption("manifest damaged", lambda index: _truncate(index / MANIFEST_FILE)),
    Corruption("Lucene segment file missing", _drop_segment_file),
    Corruption("document store page overwritten", lambda index: _overwrite_page(index / DOCS_FILE)),
    Corruption("document store truncated", lambda index: _truncate(index / DOCS_FILE)),
    Corruption("document store disagrees with dense index", _drop_store_row),
    Corruption("log damaged before whole records", _damage_log_head, logged=True),
    Corruption("log tail torn", _tear_log_tail, logged=True, recovers=True),
]


LOGGED = [f"logged-{i}" for i in range(3)]  # the writes a crashed copy holds in its log, oldest first


def crashed_copy(index_dir: Path, target: Path) -> Path:
    """``target``: ``index_dir`` as a server leaves it when killed right after acknowledging the
    ``LOGGED`` writes (in the log, applied to no store)."""
    from engine.documents import DocumentIn
    from engine.search import HybridEngine

    source = _copy(index_dir, target.with_name(target.name + "-writer"))
    settings = EngineSettings(index_dir=source, device="cpu", rerank=False, refresh_interval_s=3600)  # no refresh
    engine = HybridEngine(settings, writable=True)
    try:
        for doc_id in LOGGED:
            engine.live.upsert(DocumentIn.model_validate(document(doc_id, f"{doc_id} kumquat marmalade")))
        _copy(source, target)  # the snapshot a kill -9 leaves: nothing applied, nothing checkpointed
    finally:
        engine.close()
        shutil.rmtree(source)
    return target


def corruption_outcome(
    case: Corruption, index_dir: Path, work_dir: Path, crashed: Path | None = None, via_cli: bool = False
) -> dict:
    """Damage a copy of ``index_dir`` (of ``crashed``, from :func:`crashed_copy`, when the case needs
    a log) and open it as ``serve`` does: in-process, or (``via_cli``) with the real CLI, adding its
    exit code and whether it printed a traceback. ``message``: the refusal; ``logged_present``: how
    many ``LOGGED`` writes a recovery kept."""
    index = _copy(crashed if case.logged else index_dir, work_dir / case.name.replace(" ", "-"))
    damaged = str(case.damage(index).relative_to(index))
    outcome = _serve_outcome(index, work_dir / f"{index.name}.log") if via_cli else _engine_outcome(index)
    shutil.rmtree(index)  # copies of a large index add up; the server's log stays
    names_file = damaged in outcome.get("message", "")
    if case.recovers:
        as_expected = not outcome["refused"] and outcome["logged_present"] == len(LOGGED) - 1
    else:
        as_expected = outcome["refused"] and names_file and not outcome.get("traceback")
    return {"case": case.name, "file": damaged, **outcome, "names_file": names_file, "as_expected": as_expected}


def _engine_outcome(index: Path) -> dict:
    from engine.search import HybridEngine

    try:
        engine = HybridEngine(EngineSettings(index_dir=index, device="cpu", rerank=False), writable=True)
    except IndexDirError as exc:
        return {"refused": True, "message": str(exc)}
    try:
        return {"refused": False, "logged_present": sum(engine.live.document(d) is not None for d in LOGGED)}
    finally:
        engine.close()


def _serve_outcome(index: Path, log: Path) -> dict:
    port = free_port()
    try:
        proc = start_server(serve_args(index, port), f"http://127.0.0.1:{port}/health", log)
    except ServerExited as exc:
        text = log.read_text()
        errors = [line.removeprefix(ERROR_PREFIX) for line in text.splitlines() if line.startswith(ERROR_PREFIX)]
        message = errors[-1] if errors else text[-500:]
        return {"refused": True, "message": message, "exit_code": exc.returncode, "traceback": "Traceback" in text}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            present = sum(client.get(f"/documents/{d}").status_code == 200 for d in LOGGED)
    finally:
        exit_code = stop_server(proc)
    return {
        "refused": False,
        "logged_present": present,
        "exit_code": exit_code,
        "traceback": "Traceback" in log.read_text(),
    }


@contextmanager
def in_process(
    index: Path, work_dir: Path, writable: bool = False, **settings
) -> Iterator[tuple[TestClient, SearchService]]:
    """The REST routes of a server on ``index``, in this process (no ten-second start): a client
    for them and the SearchService behind it, closed (checkpointed) on exit."""
    from starlette.testclient import TestClient

    from serving.app import http_app
    from serving.search_service import SearchService
    from serving.settings import Settings

    config = Settings(index_dir=index, device="cpu", trace_db=work_dir / "traces.sqlite", **settings)
    service = SearchService(config, writable=writable)
    try:
        yield TestClient(http_app(service)), service
    finally:
        service.close()


# ---------------------------------------------------------------- kill -9 and a full disk while writing


@dataclass
class Ledger:
    """What a client was told: acknowledged documents (id -> the word only they hold), deletes, and
    writes a kill cut short (either outcome is right for those, but not half of one)."""

    acked: dict[str, str] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    in_doubt: set[str] = field(default_factory=set)
    writes: int = 0
    lost: set[str] = field(default_factory=set)  # what checks found wrong, by document id
    half_applied: set[str] = field(default_factory=set)
    resurrected: set[str] = field(default_factory=set)

    def counts(self) -> dict[str, int]:
        """What the results file says of the writes: how many were acknowledged, and how many went wrong."""
        return {
            "acknowledged": self.writes,
            "acknowledged_deletes": len(self.deleted),
            "in_doubt": len(self.in_doubt),
            "lost": len(self.lost),
            "half_applied": len(self.half_applied),
            "resurrected": len(self.resurrected),
        }

    def check(self, client: httpx.Client, search: Iterable[str]) -> None:
        """Note what the server lost: acknowledged documents it cannot show by id (``lost``) or not
        whole (``half_applied``: not two chunks), those of ``search`` their own word does not find
        (``lost``), and deleted ones that came back (``resurrected``)."""
        found = {d: client.get(f"/documents/{d}") for d in [*self.acked, *self.deleted, *self.in_doubt]}
        chunks = {d: len(r.json()["chunks"]) for d, r in found.items() if r.status_code == 200}
        self.lost |= {d for d in self.acked if d not in chunks}
        for doc_id in search:
            hits = client.post("/search", json={"query": self.acked[doc_id], "top_k": 5}).json()["results"]
            if doc_id not in {h["document_id"] for h in hits}:
                self.lost.add(doc_id)
        self.half_applied |= {d for d in [*self.acked, *self.in_doubt] if chunks.get(d, 2) != 2}
        self.resurrected |= {d for d in self.deleted if d in chunks}


def _write_until_killed(
    client: httpx.Client, proc: subprocess.Popen, round_: int, rng: random.Random, ledger: Ledger
) -> None:
    """Write (every fourth request deletes an acknowledged document) until the server dies: SIGKILL
    at a random moment 0.2-1.2 s after this round's third acknowledged write."""
    killer = None
    for i in range(1000):
        doc_id, word = f"r{round_}-{i}", f"zx{round_}q{i}marker"
        victim = sorted(ledger.acked)[0] if i % 4 == 3 and ledger.acked else None
        try:
            if victim is not None:
                if client.delete(f"/documents/{victim}").status_code == 200:
                    ledger.deleted.add(victim)
                    del ledger.acked[victim]
                continue
            reply = client.post("/documents", json=document(doc_id, f"{word} chunk"))
        except httpx.HTTPError:  # killed mid-request: logged or not, never half
            if victim is not None:
                del ledger.acked[victim]
            ledger.in_doubt.add(victim or doc_id)
            break
        if reply.status_code == 201:
            ledger.acked[doc_id] = word
            ledger.writes += 1
        if killer is None and sum(d.startswith(f"r{round_}-") for d in ledger.acked) == 3:
            killer = threading.Timer(rng.uniform(0.2, 1.2), proc.send_signal, [signal.SIGKILL])
            killer.start()
    proc.wait(timeout=60)


def sigkill_rounds(index_dir: Path, work_dir: Path, rounds: int = 20, seed: int = 7) -> dict:
    """``rounds`` times: start a server on a copy of the index, check what the earlier rounds
    acknowledged (all by id, the last round's also by its own word), then write and delete until
    the server is SIGKILLed. Last, the copy is opened in-process as a start opens it (the log
    replayed) and every acknowledged document is checked by id and by word. Without the reranker:
    durability does not depend on it, and a start is quicker."""
    index = _copy(index_dir, work_dir / "sigkill")
    rng, ledger = random.Random(seed), Ledger()
    port, replayed, started = free_port(), 0, time.perf_counter()
    url = f"http://127.0.0.1:{port}"
    for round_ in range(rounds):
        proc = start_server(serve_args(index, port, "--no-rerank"), f"{url}/health", work_dir / f"sigkill-{round_}.log")
        with httpx.Client(base_url=url, timeout=30) as client:
            replayed += client.get("/health").json()["live"]["recovered"]["records"]
            ledger.check(client, [d for d in ledger.acked if d.startswith(f"r{round_ - 1}-")])
            _write_until_killed(client, proc, round_, rng, ledger)
    with in_process(index, work_dir, writable=True, rerank=False) as (client, service):
        replayed += service.engine.live.recovery["records"]
        ledger.check(client, ledger.acked)
    return {
        "rounds": rounds,
        **ledger.counts(),
        "replayed_records": replayed,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _file_size_limit(limit_bytes: int) -> Callable[[], None]:
    """For the child: files may not grow past ``limit_bytes``, and a write past it fails (EFBIG)
    instead of killing the process with SIGXFSZ: a full disk, for this process only."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


def disk_full(index_dir: Path, work_dir: Path, limit_bytes: int = 512 << 10) -> dict:
    """Write to a server whose files may not grow past ``limit_bytes`` until it refuses (every tenth
    write waits to be searchable, which a store that cannot grow fails: a 503 that says the write
    is logged, and so must survive); check that it still searches, then restart it without the
    limit and check every acknowledged write."""
    index = _copy(index_dir, work_dir / "disk-full")
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
    return {
        "limit_bytes": limit_bytes,
        "acknowledged_before": len(ledger.acked),
        "refused_status": refused.status_code,
        "refused_error": _error_of(refused),
        "logged_not_yet_searchable": logged_only,
        "searches_while_full": sum(r.status_code == 200 and len(r.json()["results"]) == 5 for r in searches),
        "health_while_full": {"status": health["status"], "refresh_error": health["live"]["refresh_error"]},
        "exit_code_while_full": exit_code,
        "lost": len(ledger.lost),
        "half_applied": len(ledger.half_applied),
        "refused_present": len(ledger.resurrected),
    }


def _error_of(reply: httpx.Response) -> str:
    try:
        return reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return reply.text[:300]


# ---------------------------------------------------------------- SIGTERM under load

QUERIES = ["does vitamin D prevent falls", "statins and breast cancer", "soy and prostate cancer", "coffee and liver"]


def sigterm_drain(index_dir: Path, work_dir: Path, requests: int = 48) -> dict:
    """Fire ``requests`` searches at once (a connection each), SIGTERM the server once a quarter of
    them are answered and the rest are all inside it, and keep opening new connections until it
    exits: how many searches still running at the signal were answered (``completed``: an HTTP
    answer, ``ok`` of them 200), whether new connections were refused meanwhile, the exit code.
    The server takes one search at a time and lets the others queue for a minute (not the default
    two seconds), so that most are waiting for the slot at the signal and are drained too rather
    than refused by admission control."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(index_dir, port, "--read-only", "--max-queue", "60", "--max-in-flight", "1")
    proc = start_server(args, f"{url}/health", work_dir / "sigterm.log")
    outcomes: list[object] = [None] * requests
    ends = [0.0] * requests
    answered = threading.Semaphore(0)
    go = threading.Barrier(requests + 1)

    def search(i: int) -> None:
        with httpx.Client(timeout=60) as client:  # made before the start: all requests leave together
            go.wait()
            try:
                reply = client.post(f"{url}/search", json={"query": QUERIES[i % len(QUERIES)], "top_k": 10})
                outcomes[i] = reply.status_code
            except httpx.HTTPError as exc:
                outcomes[i] = type(exc).__name__
        ends[i] = time.perf_counter()
        answered.release()

    threads = [threading.Thread(target=search, args=(i,)) for i in range(requests)]
    try:
        for thread in threads:
            thread.start()
        go.wait()
        for _ in range(requests // 4):
            answered.acquire()
        _until_all_received(url, requests, lambda: sum(end > 0 for end in ends))
        signalled = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        probes: list[tuple[float, object]] = []
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:  # fresh ones
            while proc.poll() is None:
                try:
                    outcome: object = client.post(f"{url}/search", json={"query": QUERIES[0], "top_k": 1}).status_code
                except httpx.ConnectError:
                    outcome = "refused"
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                probes.append((time.perf_counter() - signalled, outcome))
                time.sleep(0.05)
        exit_code = proc.wait(timeout=30)
    finally:  # a failed run leaves no server behind, nor clients waiting on it
        go.abort()  # frees clients still at the start line (none once the searches left)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join()
    in_flight = [outcomes[i] for i in range(requests) if ends[i] > signalled]
    refusals = [t for t, o in probes if o == "refused"]
    return {
        "requests": requests,
        "in_flight": len(in_flight),
        "completed": sum(isinstance(o, int) for o in in_flight),
        "ok": sum(o == 200 for o in in_flight),
        "in_flight_outcomes": dict(Counter(str(o) for o in in_flight)),
        "new_after_signal": len(probes),
        "refused_after": len(refusals),
        "served_after": sum(o == 200 for _, o in probes),
        "refused_until_exit": all(o == "refused" for t, o in probes if refusals and t >= refusals[0]),
        "first_refusal_s": round(refusals[0], 3) if refusals else None,
        "last_in_flight_answer_s": round(max(ends) - signalled, 3),
        "exit_code": exit_code,
        "traceback": "Traceback" in (work_dir / "sigterm.log").read_text(),
    }


def _until_all_received(url: str, requests: int, answered: Callable[[], int], timeout_s: float = 30) -> None:
    """Return once every search not yet answered is inside the server (waiting for an admission slot
    or in one), by its ``/metrics``: a request the server has not read yet at the signal (its
    connection still in the listen backlog, its bytes not yet parsed) is not one in flight, and
    refusing it is what a draining server should do."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            before = answered()  # read first: an answer in between is then counted nowhere, not twice
            inside = sum(
                sample.value
                for family in text_string_to_metric_families(client.get(f"{url}/metrics").text)
                for sample in family.samples
                if sample.name in ("admission_waiting", "admission_in_flight")
            )
            if before + inside >= requests:
                return
            time.sleep(0.01)  # the searches it waits for share the cores
    raise TimeoutError(f"the server did not receive all {requests} searches within {timeout_s:g} s")


# ---------------------------------------------------------------- a failing reranker and LLM server


def reranker_failure(index_dir: Path, work_dir: Path, reranker: str, queries: int = 3) -> dict:
    """In-process, behind the real REST routes: break the reranker's model (its classifier head, which
    the whole model and the ``[CLS]``-only pass both run, raises) and point answers at an LLM server
    that is not there; searches and answers must still come back (fused results, the extractive
    fallback) and ``/health`` and ``/metrics`` say so."""
    from serving.rest import SOLVER_PATH

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault: the cross-encoder failed")

    nobody = f"http://127.0.0.1:{free_port()}/v1"  # no LLM server listens there
    settings = {"reranker": reranker, "rerank_runtime": "torch", "llm_url": nobody}
    with in_process(index_dir, work_dir, **settings) as (client, service):
        model = service.engine.reranker.model.transformers_model.classifier
        query = {"query": QUERIES[0], "top_k": 5}
        model.forward = broken
        replies = [client.post("/search", json=query) for _ in range(queries)]
        fused = [d for d, _ in service.engine.stages(QUERIES[0], 5).fused[:5]]
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
        answer = client.post(SOLVER_PATH, json={"task_id": "t1", "task": "Does vitamin D prevent falls?"})
        llm = client.get("/health").json().get("llm_health", {})
        llm_metric = _metric(client.get("/metrics").text, "llm_failures_total")
        del model.forward  # the model works again
        client.post("/search", json=query)
        recovered = client.get("/health").json()["reranker_health"]["status"]
    return {
        "queries": queries,
        "answered": sum(r.status_code == 200 and len(r.json()["results"]) == 5 for r in replies),
        "served_fused_order": all([h["doc_id"] for h in r.json()["results"]] == fused for r in replies),
        "health": health["reranker_health"],
        "health_shows": health["reranker_health"]["status"] == "failing" and health["status"] == "degraded",
        "metrics_show": _metric(metrics, "reranker_failures_total") == health["reranker_health"]["failures"] > 0,
        "recovers": recovered == "ok",
        "llm_answered": answer.status_code == 200,
        "llm_health_shows": llm.get("status") == "failing" and llm.get("failures", 0) >= 1,
        "llm_metrics_show": llm_metric == llm.get("failures"),
    }


def _metric(text: str, name: str) -> float | None:
    """A sample's value in Prometheus' text format (None when absent)."""
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(found[0]) if found else None


# ---------------------------------------------------------------- serve --workers 2: kill -9 of a worker under load

WRITE_DOORS = ("rest", "mcp", "v1")  # the doors that take writes (A2A takes none)


class _Readers:
    """``clients`` threads searching over REST without pause, each on a kept-alive connection made
    again every ``per_connection`` searches or after an error, so that the port spreads them over
    the workers. Each answer is noted as ``(time, pid, kind)``: the pid of the worker the connection
    reached (its ``/health``; None when even that failed), and ``ok``, ``busy`` (503: admission),
    ``HTTP <status>`` or the exception's name."""

    def __init__(self, url: str, clients: int, per_connection: int = 20) -> None:
        self.url, self.per_connection = url, per_connection
        self.outcomes: list[tuple[float, int | None, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._search, args=(i,), daemon=True) for i in range(clients)]

    def _search(self, offset: int) -> None:
        asked = offset
        while not self.stop.is_set():
            pid = None
            try:
                with httpx.Client(base_url=self.url, timeout=30) as client:
                    pid = client.get("/health").json()["worker"]["pid"]
                    for _ in range(self.per_connection):
                        if self.stop.is_set():
                            return
                        asked += 1
                        reply = client.post("/search", json={"query": QUERIES[asked % len(QUERIES)], "top_k": 10})
                        kind = {200: "ok", 503: "busy"}.get(reply.status_code, f"HTTP {reply.status_code}")
                        self.outcomes.append((time.perf_counter(), pid, kind))
            except httpx.HTTPError as exc:
                self.outcomes.append((time.perf_counter(), pid, type(exc).__name__))
                time.sleep(0.05)


class _DoorWriter:
    """One thread writing through REST, MCP (the official client, its ``add_document`` and
    ``delete_document`` tools) and ``/v1`` DOCUMENT_INGESTION in turn, each on a new connection;
    every fourth write deletes an acknowledged document (REST or MCP in turn). The ledger keeps what
    was acknowledged; ``outcomes`` each answer as ``(time, door, kind)``: ``acked``, ``refused``
    (a 503, a tool error or an OVERLOADED message saying the writer is restarting), ``HTTP <status>``
    or the exception's name (the write is then in doubt: either outcome is right, never half)."""

    def __init__(self, url: str, ledger: Ledger, pause_s: float = 0.2) -> None:
        self.url, self.ledger, self.pause_s = url, ledger, pause_s
        self.outcomes: list[tuple[float, float, str, str]] = []  # sent, answered, door, outcome
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        for i in range(1_000_000):
            if self.stop.is_set():
                return
            door = WRITE_DOORS[i % len(WRITE_DOORS)]
            victim = sorted(self.ledger.acked)[0] if i % 4 == 3 and self.ledger.acked else None
            doc_id, word = f"w{i}", f"zxw{i}marker"
            sent = time.perf_counter()
            try:
                if victim is not None:
                    door = "mcp" if door == "mcp" else "rest"  # /v1 has no delete
                    kind = self._delete(door, victim)
                else:
                    kind = self._add(door, document(doc_id, f"{word} chunk"))
            except Exception as exc:  # whatever a client meets (the MCP client's own errors too), by name
                kind = type(exc).__name__
            self.outcomes.append((sent, time.perf_counter(), door, kind))
            if victim is not None:
                del self.ledger.acked[victim]
                (self.ledger.deleted if kind == "acked" else self.ledger.in_doubt).add(victim)
            elif kind == "acked":
                self.ledger.acked[doc_id] = word
                self.ledger.writes += 1
            elif kind != "refused":
                self.ledger.in_doubt.add(doc_id)
            time.sleep(self.pause_s)

    def _add(self, door: str, body: dict) -> str:
        if door == "rest":
            return _kind(httpx.post(f"{self.url}/documents", json=body, timeout=30), 201)
        if door == "mcp":
            return _mcp_call(self.url, "add_document", body)
        message = {
            "type": "DOCUMENT_INGESTION",
            "sender": "IngestionAgent",
            "receiver": "RetrievalAgent",
            "payload": {**body, "embedding_model": "all-MiniLM-L6-v2", "total_chunks": len(body["chunks"])},
        }
        reply = httpx.post(f"{self.url}/v1/messages", json=message, timeout=30)
        if reply.status_code == 200 and reply.json()["type"] == "INGESTION_ACK":
            return "acked"
        return _kind(reply, 200)

    def _delete(self, door: str, doc_id: str) -> str:
        if door == "mcp":
            return _mcp_call(self.url, "delete_document", {"document_id": doc_id})
        return _kind(httpx.delete(f"{self.url}/documents/{doc_id}", timeout=30), 200)


def _kind(reply: httpx.Response, ok_status: int) -> str:
    """``acked``, ``refused`` (503 saying the writer is restarting: REST with Retry-After, ``/v1`` an
    OVERLOADED message without one) or ``HTTP <status>``."""
    if reply.status_code == ok_status:
        return "acked"
    if reply.status_code == 503 and "writer (worker 0) is restarting" in reply.text:
        return "refused"
    return f"HTTP {reply.status_code}"


def _mcp_call(url: str, tool: str, arguments: dict) -> str:
    from mcp import Client

    async def call():
        async with Client(url + "/mcp") as client:
            return await client.call_tool(tool, arguments)

    result = asyncio.run(call())
    if not result.is_error:
        return "acked"
    return "refused" if "writer (worker 0) is restarting" in str(result.content) else "tool error"


def _tally(items: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(items).items()))


def workers_killed_under_load(
    index_dir: Path,
    work_dir: Path,
    readers: int = 4,
    settle_s: float = 20.0,
    roles: tuple[str, ...] = ("follower", "writer"),
) -> dict:
    """``serve --workers 2`` (no reranker, ``--mcp-writes``) on a copy of ``index_dir`` under REST
    search load from ``readers`` clients, with writes arriving through every door that takes them:
    ``settle_s`` of load, kill -9 of the follower, load until it serves again and ``settle_s`` more,
    then the same for the writer (``roles``: which to kill, in turn). Then every acknowledged write
    is checked on both workers, by id and by its own word. Reports, per phase, the searches'
    outcomes on the killed worker and on the other, the writes' outcomes per door, how long each
    worker took to serve again, and what was lost."""
    index = _copy(index_dir, work_dir / "workers")
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", work_dir / "workers.log"
    args = serve_args(index, port, "--workers", "2", "--no-rerank", "--mcp-writes", "--agent-rate", "1000000/minute")
    proc = start_server(args, f"{url}/health", log)
    ledger, kills = Ledger(), {}
    try:
        pids = workers_up(url)
        load, writes = _Readers(url, readers), _DoorWriter(url, ledger)
        for thread in [*load.threads, writes.thread]:
            thread.start()
        marks = [("before", None, time.perf_counter())]  # phases: name, the pid killed in it, start
        for role in roles:
            time.sleep(settle_s)
            killed_at = time.perf_counter()
            marks.append((f"{role} down", pids[role], killed_at))
            released_s = sigkill(pids[role])
            pids = workers_up(url, seconds=600)  # the killed role answers again: a new process serves it
            marks.append((f"after the {role} is back", None, time.perf_counter()))
            kills[role] = {"killed_at": killed_at, "sockets_closed_s": round(released_s, 3)}
            kills[role]["serving_again_s"] = round(marks[-1][2] - killed_at, 1)
        time.sleep(settle_s)
        for worker in (load, writes):
            worker.stop.set()
        for thread in [*load.threads, writes.thread]:
            thread.join(60)
        ended = time.perf_counter()
        for kill in kills.values():  # the first write sent after the kill and acknowledged, through any door
            killed_at = kill.pop("killed_at")  # (one sent before it may be answered just after: logged already)
            acked = [t - killed_at for sent, t, _, kind in writes.outcomes if kind == "acked" and sent > killed_at]
            kill["first_write_acknowledged_s"] = round(acked[0], 1) if acked else None
        barrier = httpx.post(f"{url}/documents?refresh=wait_for", json=document("last", "zxlastmarker"), timeout=60)
        assert barrier.status_code == 201, barrier.text  # applied and checkpointed, so are all before it
        for role in ("writer", "follower"):
            client, _ = worker_client(url, role, timeout_s=60)
            try:
                ledger.check(client, ledger.acked)
            finally:
                client.close()
        health = httpx.get(f"{url}/health", timeout=30).json()["status"]
    finally:
        exit_code = stop_server(proc)
    phases = []
    for (name, killed, start), end in zip(marks, [*(mark[2] for mark in marks[1:]), ended], strict=True):
        place = {None: "new connection", killed: "killed worker"}  # None: the /health that finds out failed
        other = "other worker" if killed else "either worker"
        reads = [(place.get(pid, other), kind) for t, pid, kind in load.outcomes if start <= t < end]
        phases.append(
            {
                "phase": name,
                "seconds": round(end - start, 1),
                "searches": {
                    where: _tally(k for w, k in reads if w == where) for where in sorted({w for w, _ in reads})
                },
                "writes": {
                    door: _tally(kind for _, t, d, kind in writes.outcomes if d == door and start <= t < end)
                    for door in WRITE_DOORS
                },
            }
        )
    return {
        "workers": 2,
        "readers": readers,
        "searches": len(load.outcomes),
        "searches_per_s": round(len(load.outcomes) / (ended - marks[0][2]), 1),
        "kills": kills,
        "phases": phases,
        **ledger.counts(),
        "health_after": health,
        "exit_code": exit_code,
        "traceback": "Traceback" in log.read_text(),
    }


def kill_window(index_dir: Path, work_dir: Path, trials: int = 16, connections: int = 40) -> dict:
    """Why a new connection may be reset right after a worker is killed, and when that stops:
    ``trials`` times, kill -9 a worker of ``serve --workers 2 --read-only`` and wait until its leader
    thread is a zombie (every other trial: until every thread is gone, as :func:`sigkill` does), then
    open ``connections`` connections at once, each asking ``/health``; count those not answered."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(index_dir, port, "--workers", "2", "--read-only", "--no-rerank")
    proc = start_server(args, f"{url}/health", work_dir / "kill-window.log")
    failed: dict[str, list[int]] = {"leader a zombie": [], "every thread gone": []}
    try:
        for trial in range(trials):
            wait = list(failed)[trial % 2]
            sigkill(min(_pids(url, 2)), every_thread=wait == "every thread gone")
            failed[wait].append(sum(not _health_answered(port) for _ in range(connections)))
    finally:
        exit_code = stop_server(proc)
    return {
        "connections_per_kill": connections,
        **{
            wait: {"kills": len(counts), "kills_with_a_failure": sum(n > 0 for n in counts), "failed": sum(counts)}
            for wait, counts in failed.items()
        },
        "exit_code": exit_code,
    }


def _pids(url: str, count: int, seconds: float = 180) -> set[int]:
    """The pids of ``count`` workers, once each has answered ``/health`` over a new connection."""
    found: set[int] = set()
    deadline = time.time() + seconds
    while len(found) < count:
        if time.time() > deadline:
            raise RuntimeError(f"{count - len(found)} of {count} workers did not answer within {seconds:g} s")
        try:
            found.add(httpx.get(f"{url}/health", timeout=10).json()["worker"]["pid"])
        except httpx.HTTPError:
            time.sleep(0.2)
    return found


def _health_answered(port: int) -> bool:
    """``GET /health`` on a new connection, in raw bytes (a few hundred microseconds): answered 200?"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return conn.recv(12).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


# ---------------------------------------------------------------- all of it


FAULTS = ("corruptions", "reranker_failure", "sigterm", "disk_full", "kill_9", "workers", "kill_window")


def run_faults(
    index_dir: Path, work_dir: Path, rounds: int = 20, reranker: str | None = None, faults: Iterable[str] = FAULTS
) -> dict:
    """The ``faults`` above (default all; names as in :data:`FAULTS`) against copies of
    ``index_dir`` (``reranker``: default the index's own; the reranker case is skipped without one)."""
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    figures: dict = {"index_dir": str(index_dir)}
    if "corruptions" in faults:
        crashed = crashed_copy(index_dir, work_dir / "crashed")
        figures["corruptions"] = [
            corruption_outcome(c, index_dir, work_dir, crashed, via_cli=True) for c in CORRUPTIONS
        ]
    if "reranker_failure" in faults:
        reranker = reranker or str(index_dir / "reranker")
        if Path(reranker).is_dir():
            figures["reranker_failure"] = reranker_failure(index_dir, work_dir, reranker)
        else:
            figures["reranker_failure"] = {"skipped": f"no reranker at {reranker}"}
    if "sigterm" in faults:
        figures["sigterm"] = sigterm_drain(index_dir, work_dir)
    if "disk_full" in faults:
        figures["disk_full"] = disk_full(index_dir, work_dir)
    if "kill_9" in faults:
        figures["kill_9"] = sigkill_rounds(index_dir, work_dir, rounds)
    if "workers" in faults:
        figures["workers"] = workers_killed_under_load(index_dir, work_dir)
    if "kill_window" in faults:
        figures["kill_window"] = kill_window(index_dir, work_dir)
    if set(faults) == set(FAULTS):  # a part run alone keeps the whole run's time in the file
        figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    parser.add_argument("--rounds", type=int, default=20, help="kill -9 rounds")
    parser.add_argument("--reranker", help="reranker folder for the reranker fault (default: the index's own)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="which faults, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability-faults.json"))
    args = parser.parse_args(argv)
    faults = args.faults.split(",")
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        figures = run_faults(args.index_dir.resolve(), Path(tmp), args.rounds, args.reranker, faults)
    write_result(args.out, figures, vars(args), update=True)  # faults not run keep their last figures
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
