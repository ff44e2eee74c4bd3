"""One way to call another process: a method by name with plain arguments, answered or failed
within a time limit, whatever carries it.

Two carriers: :class:`ChannelTransport`, the local channel between the workers of one ``serve
--workers N`` (:mod:`serving.worker_channel`), and :class:`RayTransport`, a Ray Serve deployment's
handle (``serve --ray``). The remote writer, reranker and shards (:mod:`serving.remotes`) are
written once against :class:`Transport`. Both carriers raise a callee's own declared failure
(:class:`~engine.errors.ServiceError`: a 404, a 507) as raised there, and :class:`Unreachable`
when the callee could not be reached or did not answer in time. :meth:`Transport.begin` starts a
call without waiting, so that a query asks every shard at once and waits for them together.

What may be called is a Protocol's methods (the writer's :class:`~engine.live.writer.Writer`, a
shard's :class:`~engine.shards.fanout.Shard`): :func:`served` is the callee's side for any carrier,
:class:`serving.remotes.Remote` the caller's, so no carrier forwards a method by hand.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from engine.errors import ServiceError
from serving.worker_channel import Channel, ChannelClient, WorkerUnreachable


@functools.cache
def methods(protocol: type) -> frozenset[str]:
    """The calls ``protocol`` declares: its public methods, but ``close``, which each side does for itself."""
    declared = (name for name, value in vars(protocol).items() if inspect.isfunction(value))
    return frozenset(name for name in declared if not name.startswith("_") and name != "close")


def served(callee: object, protocol: type) -> dict[str, Callable[..., Any]]:
    """``callee``'s answers to ``protocol``'s calls, by name: what a channel server or a Ray replica
    answers with (nothing else of the callee is reachable)."""
    return {name: getattr(callee, name) for name in methods(protocol)}


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


class _Deferred:
    """A channel call, made when its answer is asked for (in the caller's thread, within its limit)."""

    def __init__(self, make: Callable[[float], Any]) -> None:
        self.make = make

    def result(self, timeout_s: float) -> Any:
        return self.make(timeout_s)


class ChannelTransport:
    """Worker ``index`` (or the reranker process) over the workers' local channel, on connections
    kept between calls (:class:`serving.worker_channel.ChannelClient`: its byte counts in
    ``client``), each call made in the caller's thread; a call begun is made when its answer is
    asked for."""

    def __init__(self, channel: Channel, index: int | str, name: str) -> None:
        self.channel, self.index, self.name = channel, index, name
        self.client = ChannelClient(channel, index)

    def begin(self, method: str, *args: Any) -> Pending:
        return _Deferred(lambda timeout_s: self.call(method, *args, timeout_s=timeout_s))

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        try:
            return self.client.call(method, *args, timeout_s=timeout_s)
        except WorkerUnreachable as exc:
            raise Unreachable(f"{self.name}: {exc}") from None


class _RayStarted:
    def __init__(self, response, name: str) -> None:
        self.response, self.name = response, name

    def result(self, timeout_s: float) -> Any:
        from ray.exceptions import RayError, RayTaskError

        try:
            return self.response.result(timeout_s=timeout_s)
        except RayTaskError as exc:
            if isinstance(exc.cause, ServiceError):
                raise exc.cause from None  # DocumentNotFound, StorageFull...: the doors phrase them
            # anything else (a replica draining, its engine closed) is the replica's, not the call's
            raise Unreachable(f"{self.name}: {type(exc.cause).__name__}: {exc.cause}") from None
        except TimeoutError:
            self.response.cancel()  # a replica that hangs is not left a queue of calls nobody waits for
            raise Unreachable(f"{self.name}: no answer within {timeout_s:g} s") from None
        except RayError as exc:  # the replica died (Serve starts another)
            raise Unreachable(f"{self.name}: {type(exc).__name__}") from None


class RayTransport:
    """A Ray Serve deployment, through its handle (Serve picks the replica), whose ``call(method,
    *args)`` answers from its :func:`served` table (``serving/ray_replicas.py: Replica``)."""

    def __init__(self, handle, name: str) -> None:
        self.handle, self.name = handle, name

    def begin(self, method: str, *args: Any) -> Pending:
        return _RayStarted(self.handle.call.remote(method, *args), self.name)

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        return self.begin(method, *args).result(timeout_s)
