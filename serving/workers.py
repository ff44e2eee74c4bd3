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
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from serving.app import door_ports
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
    """Serve with ``settings.serving.workers`` processes until Ctrl-C or SIGTERM."""
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
            _Supervisor(settings, Doors(mcp, a2a, mcp_url), writable, channel, where).run()
    finally:
        for sock in held.values():
            sock.close()


@dataclass
class _Worker:
    process: BaseProcess
    messages: Connection  # the worker says "ready" (or why it failed) here
    ready: bool = False


class _Supervisor:
    def __init__(self, settings: Settings, doors: Doors, writable: bool, channel: Channel, where: str) -> None:
        self.settings, self.doors, self.where = settings, doors, where
        count = settings.serving.workers
        self.seats = [Seat(index, count, writable, channel) for index in range(count)]
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied threads or JVM
        self.workers: dict[int, _Worker] = {}
        self.failures = dict.fromkeys(range(count), 0)  # deaths in a row before serving, per worker
        self.restart_at: dict[int, float] = {}
        self.serving = False  # every worker has served once: from now on a dead one is restarted
        self.stopping = False
        self.levels = _logging_levels()

    def run(self) -> None:
        wake_read, wake_write = socket.socketpair()
        wake_write.setblocking(False)
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        old_fd = signal.set_wakeup_fd(wake_write.fileno())  # a signal wakes the wait below
        try:
            for seat in self.seats:
                self._start(seat)
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

    def _start(self, seat: Seat) -> None:
        messages, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=_work,
            args=(seat, self.settings, self.doors, sender, self.levels),
            name=f"hybrid-search worker {seat.index}",
        )
        process.start()
        sender.close()  # the worker holds the other end: its death closes the pipe
        self.workers[seat.index] = _Worker(process, messages)
        log.info("worker %d (%s) starting, pid %d", seat.index, seat.role, process.pid)

    def _step(self, wake: socket.socket) -> None:
        """Wait for a worker's message or death, a signal, or a restart falling due; act on it."""
        now = time.monotonic()
        timeout = max(0.0, min(self.restart_at.values()) - now) if self.restart_at else None
        handles = {w.process.sentinel: index for index, w in self.workers.items()}
        handles |= {w.messages: index for index, w in self.workers.items() if not w.messages.closed}
        woken = wait([*handles, wake], timeout)
        if wake in woken:
            wake.recv(64)
        for handle in sorted(set(woken) - {wake}, key=lambda h: not isinstance(h, Connection)):  # messages first
            if handles[handle] in self.workers:
                (self._message if isinstance(handle, Connection) else self._died)(handles[handle])
        for index, due in list(self.restart_at.items()):
            if due <= time.monotonic() and not self.stopping:
                del self.restart_at[index]
                self._start(self.seats[index])

    def _message(self, index: int) -> None:
        worker = self.workers[index]
        try:
            kind, detail = worker.messages.recv()
        except EOFError:  # it died: its sentinel says so
            worker.messages.close()
            return
        if kind == "failed":
            worker.messages.close()
            self._refused(index, detail)
            return
        worker.ready, self.failures[index] = True, 0
        log.info("worker %d (%s) serving, pid %s", index, self.seats[index].role, detail)
        if not self.serving and all(w.ready for w in self.workers.values()):
            self.serving = True
            log.info("all %d workers serving: %s", len(self.workers), self.where)

    def _refused(self, index: int, reason: str) -> None:
        if not self.serving:  # a worker that cannot start at all: the whole server cannot (a bad index, say)
            raise RuntimeError(reason)
        log.error("%s", reason)

    def _died(self, index: int) -> None:
        worker = self.workers[index]
        if not worker.messages.closed and worker.messages.poll():  # its last word: why it failed
            self._message(index)
        del self.workers[index]
        worker.process.join()
        if self.stopping:
            return
        if not self.serving and not worker.ready:
            raise RuntimeError(f"worker {index} exited with code {worker.process.exitcode} while starting")
        self.failures[index] = 0 if worker.ready else self.failures[index] + 1
        wait_s = RESTART_BACKOFF_S[min(self.failures[index], len(RESTART_BACKOFF_S) - 1)]
        log.warning(
            "worker %d (%s, pid %d) exited with code %s; starting it again%s",
            index,
            self.seats[index].role,
            worker.process.pid,
            worker.process.exitcode,
            f" in {wait_s} s" if wait_s else "",
        )
        self.restart_at[index] = time.monotonic() + wait_s

    def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains its requests; the writer checkpoints), then wait."""
        self.stopping = True
        for worker in self.workers.values():
            if worker.process.is_alive():
                worker.process.terminate()
        deadline = time.monotonic() + self.settings.serving.query_timeout_s + 30
        for index, worker in self.workers.items():
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.error("worker %d did not stop in time; killing it", index)
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
