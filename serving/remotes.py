"""What an engine calls in other processes, written once over :mod:`serving.transport`: the
index's writer (a sharded index's: one a shard, :class:`engine.shards.writes.ShardedWriter`), the
reranker and the query encoder, and a sharded index's shards. The same classes serve ``serve
--workers N`` (the workers' channel) and ``serve --ray`` (deployment handles), so both send the
same things: a write as its document, a reranker the token rows of its pairs (made here, where the
score cache is). Each remote is a Protocol (:class:`~engine.live.writer.Writer`,
:class:`~engine.shards.fanout.Shard`, :class:`RerankerCalls`), called through :class:`Remote` and
answered from :func:`~serving.transport.served`: no carrier forwards a method by hand.

A write the writer cannot take (restarting, stuck) is refused with :class:`Overloaded` (503 +
Retry-After) while searches go on. A shard that does not answer is asked once more (the replica
that failed is not the only one), then counts as missing: a 503, or with partial results allowed,
an answer that says which shards it lacks (:mod:`engine.shards.fanout`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from engine.live.writer import Writer
from engine.rerank.cross_encoder import PairPreparer, pair_tokenizer
from engine.rerank.pair_cache import PairCache
from engine.rerank.token_rows import TokenRows, WireRows
from engine.retrieval.encoder import resolve_model
from engine.search.pages import PinStore
from engine.settings import EngineSettings
from engine.shards.fanout import Shard, Shards, ShardUnavailable, gone
from serving.admission import Overloaded
from serving.transport import Transport, Unreachable, methods

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5  # what a refused write says: about a writer's restart on a small machine
STATUS_TIMEOUT_S = 2.0
SNAPSHOT_TIMEOUT_S = 3600.0  # a snapshot reads every byte of the index once (its checksums)


class Remote:
    """The caller's side of a Protocol's calls on an object in another process: any of its
    methods, sent through ``transport`` by the method's own name with its arguments bound as the
    protocol declares them (so a keyword argument travels as the callee expects it). A subclass
    names its ``protocol``, and overrides only what differs (a failure phrased for the doors)."""

    protocol: ClassVar[type]
    timeouts: ClassVar[Mapping[Callable, float]] = {}  # a call that may take longer than a search's limit

    def __init__(self, transport: Transport, timeout_s: float) -> None:
        self.transport, self.timeout_s = transport, timeout_s

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in methods(self.protocol):
            raise AttributeError(f"{type(self).__name__} has no call {name!r}")
        return functools.partial(self.call, getattr(self.protocol, name))

    def call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        bound = _signature(method).bind(self, *args, **kwargs)
        bound.apply_defaults()
        timeout_s = self.timeouts.get(method, self.timeout_s)
        return self.transport.call(method.__name__, *bound.args[1:], timeout_s=timeout_s)


@functools.cache
def _signature(method: Callable) -> inspect.Signature:
    """A Protocol method's signature, read once (a write or a shard call binds its arguments to it)."""
    return inspect.signature(method)


class Refusing(Remote):
    """A remote whose callee being unreachable (restarting, stuck) refuses the call with
    :class:`Overloaded` (503 + Retry-After), its ``busy`` message naming the callee, while searches go on."""

    busy: ClassVar[str]  # with {name}: the callee

    def call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().call(method, *args, **kwargs)
        except Unreachable as exc:
            log.warning("%s did not take %s (%s)", self.transport.name, method.__name__, exc)
            raise Overloaded(self.busy.format(name=self.transport.name), RETRY_AFTER_S) from None


class RemoteWriter(Refusing):
    """An index's writer in another process as an engine's ``live``: every
    :class:`~engine.live.writer.Writer` call, sent through ``transport``."""

    protocol = Writer
    timeouts = {Writer.snapshot: SNAPSHOT_TIMEOUT_S, Writer.status: STATUS_TIMEOUT_S}
    busy = "the index's writer ({name}) is restarting or busy; send it again (a document sent twice is kept once)"

    def status(self) -> dict:
        """The writer's own status (``refresh_error`` among it), or ``reachable: false`` and why."""
        try:
            found = Remote.call(self, Writer.status)
        except Unreachable as exc:
            return {"writer": self.transport.name, "reachable": False, "error": str(exc)}
        return {"writer": self.transport.name, "reachable": True, **found}

    def close(self) -> None:
        """The writer closes itself."""


class RemotePins(Refusing):
    """The pins a server's engines share (:class:`~engine.search.pages.PinStore`), in another
    process: a page is refused while it is unreachable, as a write is."""

    protocol = PinStore
    busy = "the page store ({name}) is restarting or busy; send it again"


class RerankerCalls(Protocol):
    """What a reranker in another process answers (the workers' reranker process, Ray's deployment)."""

    def describe(self) -> dict:
        """Its :data:`DESCRIBED` attributes."""
        ...

    def status(self) -> dict: ...

    def score(self, wire: WireRows, lengths: np.ndarray) -> tuple[np.ndarray, float]:
        """The rows' scores, and the seconds they took there."""
        ...


DESCRIBED = ("name", "device", "runtime", "max_length", "memory_context", "batch_size", "running", "gflop_per_pair")


class RemoteReranker(PairPreparer):
    """A reranker in another process as an engine's: pairs made here (the tokenizer, the window, the
    score cache), their rows scored there (``score(rows, lengths)``). ``described``: what it said of
    itself (:data:`DESCRIBED`)."""

    def __init__(self, transport: Transport, described: dict, settings: EngineSettings, timeout_s: float) -> None:
        self.transport, self.timeout_s = transport, timeout_s
        for key in DESCRIBED:
            setattr(self, key, described.get(key))
        tokenizer = pair_tokenizer(resolve_model(self.name))
        cache = PairCache(settings.rerank_cache_size, settings.rerank_cache_s) if settings.rerank_cache_size else None
        super().__init__(tokenizer, self.max_length, cache)
        self.process_seconds = 0.0

    def _scores(self, rows: TokenRows, lengths: list[int]) -> list[float]:
        """Scored there, the query's tokens sent once; a failure is the reranker's (the query is
        answered in the fused order)."""
        sort_by = np.asarray(lengths, dtype=np.int32)
        scores, seconds = self.transport.call(
            RerankerCalls.score.__name__, rows.wire(), sort_by, timeout_s=self.timeout_s
        )
        self.process_seconds += seconds
        return scores.tolist()

    def channel(self) -> dict:
        """Calls to the reranker, their bytes each way (where the transport counts them), and the
        seconds they spent in the reranker's own process."""
        counted = self.transport.client.stats() if hasattr(self.transport, "client") else {}
        return counted | {"process_seconds": self.process_seconds}

    def status(self) -> dict:
        """The reranker's own status, or ``reachable: false`` and why."""
        try:
            return {"reachable": True, **self.transport.call(RerankerCalls.status.__name__, timeout_s=STATUS_TIMEOUT_S)}
        except Unreachable as exc:
            return {"reachable": False, "error": str(exc)}


class RemoteQueryEncoder:
    """A :class:`~engine.retrieval.encoder.QueryEncoder` in another process (``encode(text)``)."""

    def __init__(self, transport: Transport, runtime: str, timeout_s: float) -> None:
        self.transport, self.runtime, self.timeout_s = transport, runtime, timeout_s

    def __call__(self, text: str) -> np.ndarray:
        return np.asarray(self.transport.call("encode", text, timeout_s=self.timeout_s), dtype=np.float32)


class RemoteShards(Shards):
    """Shards in other processes: a call starts on every shard at once, and each is waited for
    within ``timeout_s``; one that fails is asked again before it counts as missing."""

    def __init__(self, transports: Sequence[Transport], timeout_s: float, partial: bool) -> None:
        super().__init__(transports, partial)
        self.timeout_s = timeout_s

    def answers(self, name: str, args: Sequence[tuple | None]) -> list[Any]:
        skipped = gone()  # a shard this search already went without is not waited for again
        todo = {i: a for i, a in enumerate(args) if a is not None and i not in skipped}
        found: list[Any] = [None] * len(self.shards)
        failed = self._gathered(name, todo, found)
        if failed:  # the replica that failed is not the only one: Serve routes the calls again
            failed = self._gathered(name, {i: todo[i] for i in failed}, found)
        if failed:
            log.warning("shards %s did not answer %s (%s)", sorted(failed), name, "; ".join(failed.values()))
            self.went_without(sorted(failed), next(iter(failed.values())))
        return found

    def _gathered(self, name: str, todo: dict[int, tuple], found: list[Any]) -> dict[int, str]:
        """Every call of ``todo`` started, then all waited for within one ``timeout_s``; the shards that
        did not answer, and why."""
        started = {i: self.shards[i].begin(name, *a) for i, a in todo.items()}
        deadline, failed = time.monotonic() + self.timeout_s, {}
        for i, pending in started.items():
            try:
                found[i] = pending.result(max(0.0, deadline - time.monotonic()))
            except Unreachable as exc:
                failed[i] = str(exc)
        return failed

    def one(self, shard: int, call: Callable, *args: Any) -> Any:
        """Shard ``shard``'s answer (a document's), asked twice; a 503 when it does not answer, never
        a "not found" in its place."""
        try:
            return self.shards[shard].call(call.__name__, *args, timeout_s=self.timeout_s)
        except Unreachable:
            try:
                return self.shards[shard].call(call.__name__, *args, timeout_s=self.timeout_s)
            except Unreachable as exc:
                raise ShardUnavailable([shard], str(exc)) from None

    def status(self) -> list[dict]:
        found = []
        for i, transport in enumerate(self.shards):
            try:
                found.append({"shard": i, "chunks": transport.call(Shard.size.__name__, timeout_s=STATUS_TIMEOUT_S)})
            except Unreachable as exc:
                found.append({"shard": i, "reachable": False, "error": str(exc)})
        return found

    def close(self) -> None:
        """Each shard's replicas close themselves."""
