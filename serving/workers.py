"""``serve --workers N``: N processes serve one index on the same ports, so that requests use every
core rather than one interpreter's lock.

- This process, the supervisor, loads no engine: it holds the ports, starts the workers, starts a
  worker again when it dies (the writer too), and stops them all on SIGTERM or Ctrl-C.
- Worker 0 is the index's writer (as ``serve`` alone is), and checkpoints after every refresh that
  applied writes; workers 1..N-1 are read-only engines that show those checkpoints, as Ray's search
  replicas do (:mod:`engine.live.follower`), and send every write to worker 0 over the local
  channel (:mod:`serving.worker_channel`). With ``--read-only`` every worker is a read-only engine.
- Each worker listens on a socket of its own, bound to the same port with ``SO_REUSEPORT``
  (:func:`bind`), rather than all accepting on one socket the supervisor bound and handed down:
  the kernel then spreads new connections evenly by their addresses' hash, where on one shared
  socket the worker that wakes first takes every connection waiting (asyncio accepts in a loop),
  so a burst of kept-alive clients (``bench --concurrency 64``) could all land on one worker. A
  worker listens only once its engine is loaded, and a dead worker's socket leaves the group with
  it, so connections go to the workers that can answer them. The supervisor binds each port first,
  without listening (it takes no connections): a port in use fails before any worker loads, port 0
  becomes one port for all, and the port stays this server's while a worker restarts.
- With a shared reranker (``--shared-reranker``, on by default with CUDA) one more process owns
  the cross-encoder (:mod:`serving.reranker_process`): it starts first, the workers once it is
  ready (they take its description to make its pairs), and it is started again when it dies while
  the workers answer in the fused order.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from serving.app import door_ports
from serving.reranker_process import RERANKER, run_reranker, shared
from serving.settings import Settings
from serving.tls import scheme, tls_options
from serving.worker_channel import KEY_BYTES, Channel

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (0, 1, 2, 5, 10, 30)  # waits before restarting a worker that keeps dying before it serves


@dataclass(frozen=True)
class Seat:
    """Which worker a process is, of how many, and how it reaches its siblings."""

    index: int
    count: int
    writable: bool  # the index takes writes (no --read-only)
    channel: Channel
    reranker: dict | None = None  # the shared reranker process's description (None: the worker loads its own)

    @property
    def role(self) -> str:
        if not self.writable:
            return "read-only"
        return "writer" if self.index == 0 else "follower"


@dataclass(frozen=True)
class Doors:
    """What ``serve`` was asked to serve (its flags), the same in every worker."""

    mcp: bool
    a2a: bool
    mcp_url: str | None


def bind(host: str, port: int, listen: bool = False) -> socket.socket:
    """A TCP socket on ``host:port`` in the port's ``SO_REUSEPORT`` group (listening when ``listen``).
    Its protocol is named (IPPROTO_TCP, not 0) so that asyncio turns Nagle's algorithm off on each
    connection, as on the sockets uvicorn makes: a reply written in two parts otherwise waited 40 ms
    for the client's delayed acknowledgement."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if listen:
        sock.listen(2048)
    return sock


def run_workers(
    settings: Settings, mcp: bool = True, a2a: bool = True, mcp_url: str | None = None, writable: bool = True
) -> None:
    """Serve with ``settings.serving.worker_count()`` processes until Ctrl-C or SIGTERM."""
    tls_options(settings)  # bad TLS files stop here, before any worker starts
    held = {door: bind(settings.serving.host, port) for door, port in door_ports(settings, mcp, a2a, mcp_url).items()}
    try:
        ports = {door: sock.getsockname()[1] for door, sock in held.items()}
        settings = settings.with_values(**{f"{door}_port": port for door, port in ports.items()})  # port 0: the given
        where = ", ".join(
            f"{door} on {scheme(settings)}://{settings.serving.host}:{port}" for door, port in ports.items()
        )
        with tempfile.TemporaryDirectory(prefix="hybrid-search-") as folder:  # mode 0700: this user's only
            channel = Channel(Path(folder), secrets.token_bytes(KEY_BYTES))
            settings = settings.with_values(page_pins_file=Path(folder) / "pages.sqlite")  # any worker reads a page
            _Supervisor(settings, Doors(mcp, a2a, mcp_url), writable, channel, where).run()
    finally:
        for sock in held.values():
            sock.close()


@dataclass
class _Worker:
    process: BaseProcess
    messages: Connection  # the worker says "ready" (or why it failed) here
    ready: bool = False


Child = int | str  # a worker's index, or RERANKER


class _Supervisor:
    def __init__(self, settings: Settings, doors: Doors, writable: bool, channel: Channel, where: str) -> None:
        self.settings, self.doors, self.where = settings, doors, where
        count = settings.serving.worker_count()
        self.seats = [Seat(index, count, writable, channel) for index in range(count)]
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied threads or JVM
        self.shared = shared(settings)
        self.workers: dict[Child, _Worker] = {}  # the reranker process among them
        self.failures = dict.fromkeys([*range(count), *[RERANKER] * self.shared], 0)  # deaths in a row before serving
        self.restart_at: dict[Child, float] = {}
        self.reranker: dict | None = None  # what the shared reranker said when ready
        self.serving = False  # every worker has served once: from now on a dead one is restarted
        self.stopping = False
        self.levels = _logging_levels()

    def run(self) -> None:
        wake_read, wake_write = socket.socketpair()
        wake_write.setblocking(False)
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        old_fd = signal.set_wakeup_fd(wake_write.fileno())  # a signal wakes the wait below
        try:
            if self.shared:  # the workers start once it is ready: they make its pairs from its description
                self._start(RERANKER)
            else:
                self._start_workers()
            while not self.stopping:
                self._step(wake_read)
        finally:
            signal.set_wakeup_fd(old_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            wake_read.close()
            wake_write.close()

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _start_workers(self) -> None:
        for seat in self.seats:
            self._start(seat.index)

    def _start(self, child: Child) -> None:
        messages, sender = self.context.Pipe(duplex=False)
        if child == RERANKER:
            target, args = run_reranker, (self.seats[0].channel, self.settings, sender, self.levels)
        else:
            seat = replace(self.seats[child], reranker=self.reranker)
            target, args = _work, (seat, self.settings, self.doors, sender, self.levels)
        process = self.context.Process(target=target, args=args, name=f"hybrid-search {self._name(child)}")
        process.start()
        sender.close()  # the child holds the other end: its death closes the pipe
        self.workers[child] = _Worker(process, messages)
        log.info("%s starting, pid %d", self._name(child), process.pid)

    def _name(self, child: Child) -> str:
        return "the reranker process" if child == RERANKER else f"worker {child} ({self.seats[child].role})"

    def _step(self, wake: socket.socket) -> None:
        """Wait for a worker's message or death, a signal, or a restart falling due; act on it."""
        now = time.monotonic()
        timeout = max(0.0, min(self.restart_at.values()) - now) if self.restart_at else None
        handles = {w.process.sentinel: child for child, w in self.workers.items()}
        handles |= {w.messages: child for child, w in self.workers.items() if not w.messages.closed}
        woken = wait([*handles, wake], timeout)
        if wake in woken:
            wake.recv(64)
        for handle in sorted(set(woken) - {wake}, key=lambda h: not isinstance(h, Connection)):  # messages first
            if handles[handle] in self.workers:
                (self._message if isinstance(handle, Connection) else self._died)(handles[handle])
        for child, due in list(self.restart_at.items()):
            if due <= time.monotonic() and not self.stopping:
                del self.restart_at[child]
                self._start(child)

    def _message(self, child: Child) -> None:
        worker = self.workers[child]
        try:
            kind, detail = worker.messages.recv()
        except EOFError:  # it died: its sentinel says so
            worker.messages.close()
            return
        if kind == "failed":
            worker.messages.close()
            self._refused(child, detail)
            return
        worker.ready, self.failures[child] = True, 0
        if child == RERANKER:
            self._reranker_ready(detail)
            return
        log.info("%s serving, pid %s", self._name(child), detail)
        started = [self.workers.get(seat.index) for seat in self.seats]
        if not self.serving and all(w is not None and w.ready for w in started):
            self.serving = True
            log.info("all %d workers serving: %s", len(self.seats), self.where)

    def _reranker_ready(self, described: dict | None) -> None:
        """The first time, the workers start: with its description, or without a reranker when it
        could load none (as one process serves fused results then)."""
        if self.serving or any(seat.index in self.workers for seat in self.seats):
            log.info("the reranker process is back, pid %d", self.workers[RERANKER].process.pid)
            return
        self.reranker = described
        if described is None:  # it has exited: nothing to restart
            self.shared, self.settings = False, self.settings.with_values(rerank=False)
        else:
            log.info("the reranker process serving %s on %s", described["name"], described["device"])
            if described["device"] == "cuda" and self.settings.engine.retrieval_device == "auto":
                # one owner of the GPU: the workers encode queries and search vectors on the CPU
                # (at 4 workers on an H100 it answered sooner and more queries a second:
                # docs/gpu.md#the-serving-path-on-an-h100-2026-11-26)
                self.settings = self.settings.with_values(retrieval_device="cpu")
        self._start_workers()

    def _refused(self, child: Child, reason: str) -> None:
        if not self.serving:  # a child that cannot start at all: the whole server cannot (a bad index, say)
            raise RuntimeError(reason)
        log.error("%s", reason)

    def _died(self, child: Child) -> None:
        worker = self.workers[child]
        if not worker.messages.closed and worker.messages.poll():  # its last word: why it failed
            self._message(child)
        del self.workers[child]
        worker.process.join()
        if self.stopping or (child == RERANKER and not self.shared):
            return
        if not self.serving and not worker.ready:
            raise RuntimeError(f"{self._name(child)} exited with code {worker.process.exitcode} while starting")
        self.failures[child] = 0 if worker.ready else self.failures[child] + 1
        wait_s = RESTART_BACKOFF_S[min(self.failures[child], len(RESTART_BACKOFF_S) - 1)]
        log.warning(
            "%s (pid %d) exited with code %s; starting it again%s",
            self._name(child),
            worker.process.pid,
            worker.process.exitcode,
            f" in {wait_s} s" if wait_s else "",
        )
        self.restart_at[child] = time.monotonic() + wait_s

    def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains its requests; the writer checkpoints), then to the
        reranker process, which the draining requests may still call; wait for each."""
        self.stopping = True
        deadline = time.monotonic() + self.settings.serving.query_timeout_s + 30
        for group in ([c for c in self.workers if c != RERANKER], [c for c in self.workers if c == RERANKER]):
            for child in group:
                if self.workers[child].process.is_alive():
                    self.workers[child].process.terminate()
            for child in group:
                worker = self.workers[child]
                worker.process.join(max(0.0, deadline - time.monotonic()))
                if worker.process.is_alive():
                    log.error("%s did not stop in time; killing it", self._name(child))
                    worker.process.kill()
                    worker.process.join()
                worker.messages.close()


def _work(seat: Seat, settings: Settings, doors: Doors, messages: Connection, levels: dict[str, int]) -> None:
    """A worker process (spawned: it shares nothing of the supervisor's memory). Its threads are
    the cores shared out (torch, OpenMP, BLAS and the tokenizers read these variables as they
    load), unless the user set ``OMP_NUM_THREADS``; SIGINT is the supervisor's to pass on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=levels.pop(""),
        format=f"%(asctime)s %(levelname)s %(name)s [worker {seat.index}]: %(message)s",
        stream=sys.stderr,
    )
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // seat.count)))
    for name in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(name, threads)
    from serving.worker import serve  # after the variables above: it imports torch, which reads them

    serve(seat, settings, doors, messages)


def _logging_levels() -> dict[str, int]:
    """The root's level ("") and every logger's set one (-v, the CLI's quiet libraries), for the workers."""
    named = logging.Logger.manager.loggerDict.items()
    levels = {name: lg.level for name, lg in named if isinstance(lg, logging.Logger) and lg.level}
    return {"": logging.getLogger().level, **levels}
