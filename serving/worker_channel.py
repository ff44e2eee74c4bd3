"""The local channel between the workers of one ``serve --workers N``: each worker answers its
siblings' calls on a Unix socket of its own (``w<index>.sock`` in the supervisor's private folder):
the index's writer (worker 0) takes the followers' writes, and every worker answers for its
metrics. The shared reranker process answers on the same terms at ``wreranker.sock``
(:mod:`serving.reranker_process`). Callers reach them through
:class:`serving.transport.ChannelTransport`.

A call is one connection: the shared key (32 bytes, compared before anything is unpickled), then a
pickled ``(method, args)``, answered by a pickled ``("ok", value)`` or ``("error", exc)``. Not
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ServiceError

log = logging.getLogger(__name__)
KEY_BYTES = 32
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
    """Answers siblings' calls to ``handlers`` (method name -> function), a thread a call."""

    def __init__(self, channel: Channel, index: int | str, handlers: dict[str, Callable[..., Any]]) -> None:
        self.key, self.index, self.handlers = channel.key, index, handlers
        self.path = channel.address(index)
        self.path.unlink(missing_ok=True)  # left behind by a worker killed before it could close
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._calls: set[threading.Thread] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"channel-{index}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            thread = threading.Thread(target=self._answer, args=(conn,), name="channel-call", daemon=True)
            with self._lock:
                self._calls.add(thread)
            thread.start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(10)  # to read the call; a caller that stalls sending it is dropped
                if not hmac.compare_digest(_exactly(conn, KEY_BYTES), self.key):
                    log.warning("worker %s refused a call with the wrong key", self.index)
                    return
                method, args = _receive(conn)
                conn.settimeout(None)  # the caller bounds its own wait
                _send(conn, self._run(method, args))
        except (OSError, EOFError):  # the caller gave up or went away
            pass
        finally:
            with self._lock:
                self._calls.discard(threading.current_thread())

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
        with self._lock:
            running = list(self._calls)
        for thread in running:
            thread.join(timeout_s)


def call(channel: Channel, index: int | str, method: str, *args: Any, timeout_s: float) -> Any:
    """``method(*args)`` in worker ``index``; its ServiceError raised here as raised there;
    :class:`WorkerUnreachable` when it cannot be reached or does not answer within ``timeout_s``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(channel.address(index)))
            sock.sendall(channel.key)
            _send(sock, (method, args))
            outcome, value = _receive(sock)
    except (OSError, EOFError) as exc:
        raise WorkerUnreachable(f"worker {index}: {type(exc).__name__}: {exc}") from None
    if outcome == "error":
        raise value
    return value


def _send(sock: socket.socket, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return pickle.loads(_exactly(sock, length))


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the other worker closed the channel")
        data += chunk
    return bytes(data)
