"""SIGTERM under load: a stopping server must answer the searches it already holds and refuse new
connections until it exits, which is what lets a supervisor or an orchestrator restart it without
a client seeing an error for a request it had sent."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.reliability.faults.harness import QUERIES
from benchmarks.reliability.faults.results import SigtermDrain
from offline.server_process import free_port, serve_args, start_server


def sigterm_drain(index_dir: Path, work_dir: Path, requests: int = 48) -> SigtermDrain:
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
    return SigtermDrain(
        requests=requests,
        in_flight=len(in_flight),
        completed=sum(isinstance(o, int) for o in in_flight),
        ok=sum(o == 200 for o in in_flight),
        in_flight_outcomes=dict(Counter(str(o) for o in in_flight)),
        new_after_signal=len(probes),
        refused_after=len(refusals),
        served_after=sum(o == 200 for _, o in probes),
        refused_until_exit=all(o == "refused" for t, o in probes if refusals and t >= refusals[0]),
        first_refusal_s=round(refusals[0], 3) if refusals else None,
        last_in_flight_answer_s=round(max(ends) - signalled, 3),
        exit_code=exit_code,
        traceback="Traceback" in (work_dir / "sigterm.log").read_text(),
    )


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
