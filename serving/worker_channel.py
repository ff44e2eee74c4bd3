"""The local channel between the workers of one ``serve --workers N``: each worker answers its
siblings' calls on a Unix socket of its own (``w<index>.sock`` in the supervisor's private folder):
the index's writer (worker 0) takes the followers' writes, and every worker answers for its
metrics. The shared reranker process answers on the same terms at ``wreranker.sock``
(:mod:`serving.reranker_process`). Callers reach them through
:class:`serving.transport.ChannelTransport`.

A connection opens with the shared key (32 bytes, compared before anything is unpickled); then each
call on it is a length-prefixed pickled ``(method, args)``, answered by a pickled ``("ok", value)``
or ``("error", exc)``. A :class:`ChannelClient` keeps its connections open between calls (a new
connection, and a thread for it in the callee, cost more than a reranker call's payload), and
counts the bytes each way; a connection a call failed on is closed, never reused. Not
:mod:`multiprocessing.connection`: its key handshake reads without a time limit, so a writer that
hangs would hold a follower's threads, and the admission slots they carry, for ever; here every
read and write of a call has the caller's time limit. The folder is the user's alone (mode 0700)
and the key a fresh secret per ``serve``.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ServiceError

log = logging.getLogger(__name__)
KEY_BYTES = 32
CALL_READ_S = 10  # to read the key, or a call once its length has come
_LENGTH = struct.Struct("!Q")


@dataclass(frozen=True)
class Channel:
    """Where the workers of one server reach each other, and the key they prove themselves with."""

    folder: Path
    key: bytes

    def address(self, index: int | str) -> Path:
        """Worker ``index``'s socket, or another process's by name (``reranker``)."""
        return self.folder / f"w{index}.sock"


class WorkerUnreachable(ConnectionError):
    """The worker did not take or answer the call in time (it is restarting, gone, or stuck)."""


class WorkerFailed(ServiceError, RuntimeError):
    """The called worker raised something other than a caller's error (its log has the traceback)."""


class ChannelServer:
    """Answers siblings' calls to ``handlers`` (method name -> function), a thread a connection."""

    def __init__(self, channel: Channel, index: int | str, handlers: dict[str, Callable[..., Any]]) -> None:
        self.key, self.index, self.handlers = channel.key, index, handlers
        self.path = channel.address(index)
        self.path.unlink(missing_ok=True)  # left behind by a worker killed before it could close
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._connections: dict[socket.socket, bool] = {}  # each open connection: whether a call is in it
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"channel-{index}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._connections[conn] = False
            threading.Thread(target=self._answer, args=(conn,), name="channel-connection", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(CALL_READ_S)
                if not hmac.compare_digest(_exactly(conn, KEY_BYTES), self.key):
                    log.warning("worker %s refused a call with the wrong key", self.index)
                    return
                while True:
                    conn.settimeout(None)  # a kept connection waits for its next call
                    (length,) = _LENGTH.unpack(_exactly(conn, _LENGTH.size))
                    with self._lock:
                        self._connections[conn] = True
                    conn.settimeout(CALL_READ_S)  # a caller that stalls sending its call is dropped
                    method, args = pickle.loads(_exactly(conn, length))
                    conn.settimeout(None)  # the caller bounds its own wait
                    _send(conn, self._run(method, args))
                    with self._lock:
                        self._connections[conn] = False
        except (OSError, EOFError):  # the caller gave up or went away, or the server closed
            pass
        finally:
            with self._lock:
                self._connections.pop(conn, None)

    def _run(self, method: str, args: tuple) -> tuple[str, Any]:
        handler = self.handlers.get(method)
        if handler is None:
            return "error", WorkerFailed(f"worker {self.index} has no method {method!r}")
        try:
            return "ok", handler(*args)
        except ServiceError as exc:  # a caller's error (404, 507, ...): the caller's door phrases it
            return "error", exc
        except Exception as exc:
            log.exception("a sibling's call %s failed", method)
            return "error", WorkerFailed(f"worker {self.index} failed: {type(exc).__name__}: {exc}"[:300])

    def close(self, timeout_s: float) -> None:
        """Take no more calls and wait (up to ``timeout_s``) for those running: a writer must not
        close its log under a write a follower sent."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        self.path.unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                idle = [conn for conn, busy in self._connections.items() if not busy]
                running = len(self._connections) - len(idle)
            for conn in idle:  # wakes its thread, which ends
                _shut(conn)
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(0.01)


class ChannelClient:
    """Calls to worker ``index`` over connections kept open between calls (as many as calls at once),
    with the bytes sent and received, and the calls made, counted."""

    def __init__(self, channel: Channel, index: int | str) -> None:
        self.channel, self.index = channel, index
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self.calls = self.bytes_sent = self.bytes_received = 0

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        """``method(*args)`` in worker ``index``; its ServiceError raised here as raised there;
        :class:`WorkerUnreachable` when it cannot be reached or does not answer within ``timeout_s``.
        A kept connection that fails (the callee restarted since) is tried once more on a new one,
        the other kept ones dropped with it: they are as old."""
        sock, kept = None, False
        try:
            sock, kept = self._connection(timeout_s)
            sock.settimeout(timeout_s)
            sent = _send(sock, (method, args))
            (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
            outcome, value = pickle.loads(_exactly(sock, length))
        except (OSError, EOFError) as exc:
            if sock is not None:
                sock.close()  # half a call may be in it: never reused
            if kept and not isinstance(exc, TimeoutError):
                self.close()
                return self.call(method, *args, timeout_s=timeout_s)
            raise WorkerUnreachable(f"worker {self.index}: {type(exc).__name__}: {exc}") from None
        with self._lock:
            self._idle.append(sock)
            self.calls += 1
            self.bytes_sent += sent
            self.bytes_received += _LENGTH.size + length
        if outcome == "error":
            raise value
        return value

    def _connection(self, timeout_s: float) -> tuple[socket.socket, bool]:
        """A kept connection (True) or a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(str(self.channel.address(self.index)))
            sock.sendall(self.channel.key)
        except OSError:
            sock.close()
            raise
        return sock, False

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def call(channel: Channel, index: int | str, method: str, *args: Any, timeout_s: float) -> Any:
    """One call on a connection of its own (closed after it): see :meth:`ChannelClient.call`."""
    client = ChannelClient(channel, index)
    try:
        return client.call(method, *args, timeout_s=timeout_s)
    finally:
        client.close()


def _send(sock: socket.socket, value: object) -> int:
    """``value`` sent, length first; the bytes it took."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)
    return _LENGTH.size + len(data)


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the other worker closed the channel")
        data += chunk
    return bytes(data)
