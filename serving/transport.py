"""One way to call another process: a method by name with plain arguments, answered or failed
within a time limit, whatever carries it.

Two carriers: :class:`ChannelTransport`, the local channel between the workers of one ``serve
--workers N`` (:mod:`serving.worker_channel`), and :class:`RayTransport`, a Ray Serve deployment's
handle (``serve --ray``). The remote writer, reranker and shards (:mod:`serving.remotes`) are
written once against :class:`Transport`. Both carriers raise a callee's own declared failure
(:class:`~engine.errors.ServiceError`: a 404, a 507) as raised there, and :class:`Unreachable`
when the callee could not be reached or did not answer in time. :meth:`Transport.begin` starts a
call without waiting, so that a query asks every shard at once and waits for them together.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from serving.worker_channel import Channel, WorkerUnreachable, call

log = logging.getLogger(__name__)


class Unreachable(ConnectionError):
    """The callee did not take or answer the call in time (restarting, gone, stuck)."""


class Pending(Protocol):
    def result(self, timeout_s: float) -> Any:
        """The answer, the callee's ServiceError, or :class:`Unreachable`."""
        ...


class Transport(Protocol):
    name: str  # the callee, as errors and /health name it

    def begin(self, method: str, *args: Any) -> Pending: ...

    def call(self, method: str, *args: Any, timeout_s: float) -> Any: ...


class _Started:
    def __init__(self, future, name: str) -> None:
        self.future, self.name = future, name

    def result(self, timeout_s: float) -> Any:
        try:
            return self.future.result(timeout=timeout_s)
        except TimeoutError:
            raise Unreachable(f"{self.name}: no answer within {timeout_s:g} s") from None
        except WorkerUnreachable as exc:
            raise Unreachable(str(exc)) from None


class ChannelTransport:
    """Worker ``index`` (or the reranker process) over the workers' local channel."""

    _pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="channel-call")

    def __init__(self, channel: Channel, index: int | str, name: str, timeout_s: float) -> None:
        self.channel, self.index, self.name, self.timeout_s = channel, index, name, timeout_s

    def begin(self, method: str, *args: Any) -> Pending:
        run = call
        return _Started(
            self._pool.submit(run, self.channel, self.index, method, *args, timeout_s=self.timeout_s), self.name
        )

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        try:
            return call(self.channel, self.index, method, *args, timeout_s=timeout_s)
        except WorkerUnreachable as exc:
            raise Unreachable(str(exc)) from None


class _RayStarted:
    def __init__(self, response, name: str) -> None:
        self.response, self.name = response, name

    def result(self, timeout_s: float) -> Any:
        from ray.exceptions import RayError, RayTaskError

        try:
            return self.response.result(timeout_s=timeout_s)
        except RayTaskError as exc:
            if isinstance(exc.cause, Exception) and not isinstance(exc.cause, RayError):
                raise exc.cause from None  # DocumentNotFound, StorageFull...: the doors phrase them
            raise Unreachable(f"{self.name}: {type(exc.cause).__name__}") from None
        except (RayError, TimeoutError) as exc:  # the replica died (Serve starts another) or outlasted the limit
            raise Unreachable(f"{self.name}: {type(exc).__name__}") from None


class RayTransport:
    """A Ray Serve deployment, through its handle (Serve picks the replica)."""

    def __init__(self, handle, name: str) -> None:
        self.handle, self.name = handle, name

    def begin(self, method: str, *args: Any) -> Pending:
        return _RayStarted(getattr(self.handle, method).remote(*args), self.name)

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        return self.begin(method, *args).result(timeout_s)
