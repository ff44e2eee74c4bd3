"""kill -9 of a worker of ``serve --workers 2``: the point of several workers is that one dying
costs its own requests and nothing more, so under search and write load the other must keep
answering, writes must be refused (not lost) while the writer comes back, and a new connection
must not be reset once the killed worker's sockets are gone."""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import httpx

from benchmarks.reliability.faults.drivers import WRITE_DOORS, DoorWriter, Readers
from benchmarks.reliability.faults.harness import Ledger, copy_index, document
from benchmarks.reliability.faults.results import FailedConnections, Kill, KillWindow, Phase, WorkersKilled
from offline.server_process import free_port, serve_args, sigkill, start_server, stop_server, worker_client, workers_up


def _tally(items: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(items).items()))


def _until_every_door_acks(writes: DoorWriter, since: float, at_most_s: float = 60.0) -> None:
    """Keep the load on until each door has acknowledged a write sent since ``since``: on a loaded
    machine a few seconds may pass before the slowest door's next write is answered."""
    deadline = time.perf_counter() + at_most_s
    while time.perf_counter() < deadline:
        acked = {door for sent, _, door, kind in list(writes.outcomes) if kind == "acked" and sent >= since}
        if acked >= set(WRITE_DOORS):
            return
        time.sleep(0.2)


def workers_killed_under_load(
    index_dir: Path,
    work_dir: Path,
    readers: int = 4,
    settle_s: float = 20.0,
    roles: tuple[str, ...] = ("follower", "writer"),
) -> WorkersKilled:
    """``serve --workers 2`` (no reranker, ``--mcp-writes``) on a copy of ``index_dir`` under REST
    search load from ``readers`` clients, with writes arriving through every door that takes them:
    ``settle_s`` of load, kill -9 of the follower, load until it serves again and ``settle_s`` more,
    then the same for the writer (``roles``: which to kill, in turn), the last phase lasting until
    every door has acknowledged a write again. Then every acknowledged write
    is checked on both workers, by id and by its own word. Reports, per phase, the searches'
    outcomes on the killed worker and on the other, the writes' outcomes per door, how long each
    worker took to serve again, and what was lost."""
    index = copy_index(index_dir, work_dir / "workers")
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", work_dir / "workers.log"
    args = serve_args(index, port, "--workers", "2", "--no-rerank", "--mcp-writes", "--agent-rate", "1000000/minute")
    proc = start_server(args, f"{url}/health", log)
    ledger = Ledger()
    killed: dict[str, tuple[float, float, float]] = {}  # role -> killed at, its sockets closed in, back at
    try:
        pids = workers_up(url)
        load, writes = Readers(url, readers), DoorWriter(url, ledger)
        for thread in [*load.threads, *writes.threads]:
            thread.start()
        marks = [("before", None, time.perf_counter())]  # phases: name, the pid killed in it, start
        for role in roles:
            time.sleep(settle_s)
            killed_at = time.perf_counter()
            marks.append((f"{role} down", pids[role], killed_at))
            released_s = sigkill(pids[role])
            pids = workers_up(url, seconds=600)  # the killed role answers again: a new process serves it
            marks.append((f"after the {role} is back", None, time.perf_counter()))
            killed[role] = (killed_at, released_s, marks[-1][2])
        time.sleep(settle_s)
        _until_every_door_acks(writes, since=marks[-1][2])
        for driver in (load, writes):
            driver.stop.set()
        for thread in [*load.threads, *writes.threads]:
            thread.join(60)
        ended = time.perf_counter()
        kills: dict[str, Kill] = {}
        for role, (killed_at, released_s, back_at) in killed.items():
            # the first write sent after the kill and acknowledged, through any door (one sent before
            # it may be answered just after: logged already)
            acked = [t - killed_at for sent, t, _, kind in writes.outcomes if kind == "acked" and sent > killed_at]
            first_acked = round(acked[0], 1) if acked else None
            kills[role] = Kill(round(released_s, 3), round(back_at - killed_at, 1), first_acked)
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
    for (name, pid_killed, start), end in zip(marks, [*(mark[2] for mark in marks[1:]), ended], strict=True):
        place = {None: "new connection", pid_killed: "killed worker"}  # None: the /health that finds out failed
        other = "other worker" if pid_killed else "either worker"
        reads = [(place.get(pid, other), kind) for t, pid, kind in load.outcomes if start <= t < end]
        searches = {where: _tally(k for w, k in reads if w == where) for where in sorted({w for w, _ in reads})}
        door_writes = {
            door: _tally(kind for _, t, d, kind in writes.outcomes if d == door and start <= t < end)
            for door in WRITE_DOORS
        }
        phases.append(Phase(name, round(end - start, 1), searches, door_writes))
    return WorkersKilled(
        workers=2,
        readers=readers,
        searches=len(load.outcomes),
        searches_per_s=round(len(load.outcomes) / (ended - marks[0][2]), 1),
        kills=kills,
        phases=phases,
        writes=ledger.counts(),
        health_after=health,
        exit_code=exit_code,
        traceback="Traceback" in log.read_text(),
    )


def kill_window(index_dir: Path, work_dir: Path, trials: int = 16, connections: int = 40) -> KillWindow:
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
    waited = {
        wait: FailedConnections(len(counts), sum(n > 0 for n in counts), sum(counts)) for wait, counts in failed.items()
    }
    return KillWindow(connections, waited, exit_code)


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
