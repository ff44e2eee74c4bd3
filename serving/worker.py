"""One worker of ``serve --workers N`` (started by :mod:`serving.workers`): the engine its role
calls for, the doors on sockets of its own in each port's ``SO_REUSEPORT`` group, the channel its
siblings call it on, and /health and /metrics that speak for the workers as a whole.

What stays per worker, as on Ray's replicas: admission (``--max-in-flight`` and ``--max-queue``
hold in each worker), agents' rate limits, the reranker's score cache, MCP sessions (served
stateless: a session's next request may reach another worker, so there are no resumable streams)
and A2A tasks (kept by the worker that ran them; another worker asks it over the channel,
:mod:`serving.a2a_tasks`). The ``/v1`` trace store is one SQLite file that every worker writes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, wait

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from engine import threads
from engine.live.writer import Writer
from engine.search.opening import Remotes
from serving import telemetry
from serving.a2a_tasks import WorkerTasks
from serving.app import build_apps, door_ports, serve_apps
from serving.remotes import RemoteQueryEncoder, RemoteReranker, RemoteWriter
from serving.reranker_process import RERANKER
from serving.search_service import SearchService
from serving.settings import Settings
from serving.tls import tls_options
from serving.transport import ChannelTransport, served
from serving.worker_channel import ChannelServer, WorkerUnreachable, call
from serving.workers import Doors, Seat, bind

log = logging.getLogger(__name__)
SIBLING_METRICS_TIMEOUT_S = 2.0
SIBLING_TASK_TIMEOUT_S = 2.0  # a task lookup in a sibling's memory: a stuck sibling must not hold a thread long
WRITER_WAIT_S = 300.0  # how long a starting follower waits for its writer before it serves searches alone


class WorkerService(SearchService):
    """A worker's engine and doors: ``/health`` names the worker that answered, ``/metrics`` gathers
    every worker's series, each labelled ``worker``."""

    def __init__(self, settings: Settings, seat: Seat) -> None:
        timeout_s = settings.serving.query_timeout_s
        writer = ChannelTransport(seat.channel, 0, "worker 0")
        follow = RemoteWriter(writer, timeout_s) if seat.role == "follower" else None
        process = ChannelTransport(seat.channel, RERANKER, "the reranker process")
        self.shared_reranker = (
            RemoteReranker(process, seat.reranker, settings.engine, timeout_s) if seat.reranker else None
        )
        encoder = (seat.reranker or {}).get("query_encoder")
        query_encoder = RemoteQueryEncoder(process, encoder, timeout_s) if encoder else None
        remotes = Remotes(writer=follow, query_encoder=query_encoder)
        super().__init__(settings, writable=seat.role == "writer", reranker=self.shared_reranker, remotes=remotes)
        self.seat = seat

    def health(self) -> dict:
        """Also, with a shared reranker, whether its process answers: ``degraded`` while it does not
        (queries are answered in the fused order until the supervisor has started it again)."""
        seat = self.seat
        worker = {"index": seat.index, "pid": os.getpid(), "role": seat.role, "threads": threads.share()}
        found = {**super().health(), "worker": worker, "workers": seat.count}
        if self.shared_reranker is not None:
            process = self.shared_reranker.status()
            found["reranker_process"] = process
            if not process["reachable"]:
                found["status"] = "degraded"
        return found

    def exposition(self) -> bytes:
        return generate_latest(_AllWorkers(self.registry, self.seat))

    def handlers(self) -> dict:
        """What siblings call here: this worker's metrics; on the writer, the writer's calls."""
        found = {"metrics": lambda: list(self.registry.collect())}
        live = self.engine.live
        if self.seat.role == "writer":
            found |= served(live, Writer)
        return found


class _AllWorkers:
    """Every worker's series as one exposition: each family once, each sample with its ``worker``.
    The custom collectors (agents, fallbacks, reranker cache) read a process's memory at scrape
    time, so the series are gathered from each worker rather than shared through files (the
    Prometheus client's multiprocess mode keeps only counters, gauges and histograms). A worker
    that does not answer (restarting) is left out of that scrape; its counters start again from
    zero when it is back, which ``rate()`` reads as a reset."""

    def __init__(self, registry, seat: Seat) -> None:
        self.registry, self.seat = registry, seat

    def collect(self):
        merged: dict[str, Metric] = {}
        for index in range(self.seat.count):
            try:
                families = self._families(index)
            except WorkerUnreachable as exc:
                log.debug("worker %d left out of /metrics (%s)", index, exc)
                continue
            for family in families:
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples += [s._replace(labels={**s.labels, "worker": str(index)}) for s in family.samples]
        yield from merged.values()

    def _families(self, index: int) -> list[Metric]:
        if index == self.seat.index:
            return list(self.registry.collect())
        return call(self.seat.channel, index, "metrics", timeout_s=SIBLING_METRICS_TIMEOUT_S)


def serve(seat: Seat, settings: Settings, doors: Doors, messages: Connection) -> None:
    """Load, say "ready" to the supervisor (or why not), serve until SIGTERM, then close: the
    channel first, so that a write a follower sent is not cut off by the writer's checkpoint."""
    threading.Thread(target=_stop_with_supervisor, name="supervisor-watch", daemon=True).start()
    try:
        tls = tls_options(settings)
        if seat.role == "writer":  # the followers show what it publishes after every refresh that applied writes
            settings = settings.with_values(followed=True)
        engine_door = "mcp" in door_ports(settings, doors.mcp, doors.a2a, doors.mcp_url)  # REST, beside the engine
        service = WorkerService(settings, seat) if engine_door else None
        tasks = _tasks(settings, seat) if service and doors.a2a else None
        _, apps = build_apps(settings, doors.mcp, doors.a2a, doors.mcp_url, service=service, tasks=tasks)
        handlers = {**service.handlers(), **({"a2a_task": tasks.answer} if tasks else {})} if service else {}
        channel = ChannelServer(seat.channel, seat.index, handlers) if service else None
        if service is not None and seat.role == "follower":
            _writer_answers(service.engine.live, WRITER_WAIT_S)
        # listening only now: until its engine is loaded, a worker takes no connections
        sockets = {door: bind(settings.serving.host, port, listen=True) for door, (_, port) in apps.items()}
    except Exception as exc:
        log.debug("worker %d could not start", seat.index, exc_info=True)
        messages.send(("failed", f"worker {seat.index} ({seat.role}): {exc}"))
        raise SystemExit(2) from None
    messages.send(("ready", os.getpid()))
    try:
        serve_apps(settings, apps, tls, sockets)
    finally:
        if channel is not None:
            channel.close(settings.serving.query_timeout_s)
        if service is not None:
            service.close()
        telemetry.shutdown()


def _writer_answers(writer: RemoteWriter, timeout_s: float) -> None:
    """Wait until the writer answers, at most ``timeout_s``: a follower loads less than its writer
    (no document encoder), and a server whose doors open must take writes, not answer its first
    ones "restarting or busy". A writer that does not come within the time is the supervisor's to
    restart; the follower serves searches meanwhile, as it does while its writer restarts."""
    deadline = time.monotonic() + timeout_s
    while not writer.status()["reachable"] and time.monotonic() < deadline:
        time.sleep(0.2)


def _tasks(settings: Settings, seat: Seat) -> WorkerTasks:
    """This worker's A2A tasks; a sibling's are asked for over the channel."""

    def ask(worker: int, *args) -> bytes | None:
        return call(seat.channel, worker, "a2a_task", *args, timeout_s=SIBLING_TASK_TIMEOUT_S)

    return WorkerTasks(settings.serving.a2a_tasks_kept, seat.index, seat.count, ask)


def _stop_with_supervisor() -> None:
    """A worker outlives no supervisor (killed, say): it stops as on SIGTERM (the writer checkpoints)."""
    wait([multiprocessing.parent_process().sentinel])
    log.warning("the supervisor is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)
