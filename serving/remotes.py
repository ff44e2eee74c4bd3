"""What an engine calls in other processes, written once over :mod:`serving.transport`: the
index's writer, and a sharded index's shards and their writers.

A write the writer cannot take (restarting, stuck) is refused with :class:`Overloaded` (503 +
Retry-After) while searches go on. A shard that does not answer is asked once more (the replica
that failed is not the only one), then counts as missing: a 503, or with partial results allowed,
an answer that says which shards it lacks (:mod:`engine.shards.fanout`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.documents import DocumentIn
from engine.shards.fanout import Shards
from engine.store.index_dir import shard_of
from serving.admission import Overloaded
from serving.transport import Transport, Unreachable

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5  # what a refused write says: about a writer's restart on a small machine
STATUS_TIMEOUT_S = 2.0


class RemoteWriter:
    """An index's writer in another process as an engine's ``live``: the
    :class:`~engine.live.writer.Writer` calls, sent through ``transport``."""

    def __init__(self, transport: Transport, timeout_s: float) -> None:
        self.transport, self.timeout_s = transport, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return self.transport.call(method, *args, timeout_s=self.timeout_s)
        except Unreachable as exc:
            log.warning("%s did not take %s (%s)", self.transport.name, method, exc)
            raise Overloaded(
                f"the index's writer ({self.transport.name}) is restarting or busy; send it again (a document sent"
                " twice is kept once)",
                RETRY_AFTER_S,
            ) from None

    def upsert(self, document: DocumentIn, wait: bool = False) -> dict:
        return self._call("upsert", document.model_dump(mode="json"), wait)

    def delete(self, document_id: str, wait: bool = False) -> dict:
        return self._call("delete", document_id, wait)

    def document(self, document_id: str) -> dict | None:
        return self._call("document", document_id)

    def status(self) -> dict:
        """The writer's own status (``refresh_error`` among it), or ``reachable: false`` and why."""
        try:
            found = self.transport.call("status", timeout_s=STATUS_TIMEOUT_S)
        except Unreachable as exc:
            return {"writer": self.transport.name, "reachable": False, "error": str(exc)}
        return {"writer": self.transport.name, "reachable": True, **found}

    def close(self) -> None:
        """The writer closes itself."""


class ShardedWriter:
    """A sharded index's writers as one ``live``: each document's write goes to the writer of the
    shard its id hashes to (:func:`~engine.store.index_dir.shard_of`), acknowledged when durable there."""

    def __init__(self, writers: Sequence[RemoteWriter]) -> None:
        self.writers = list(writers)

    def _of(self, document_id: str) -> RemoteWriter:
        return self.writers[shard_of(document_id, len(self.writers))]

    def upsert(self, document: DocumentIn, wait: bool = False) -> dict:
        return self._of(document.document_id).upsert(document, wait)

    def delete(self, document_id: str, wait: bool = False) -> dict:
        return self._of(document_id).delete(document_id, wait)

    def document(self, document_id: str) -> dict | None:
        return self._of(document_id).document(document_id)

    def status(self) -> dict:
        writers = [writer.status() for writer in self.writers]
        errors = [w.get("refresh_error") for w in writers if w.get("refresh_error")]
        return {
            "writers": writers,
            "reachable": all(w["reachable"] for w in writers),
            "refresh_error": errors[0] if errors else None,
        }

    def close(self) -> None:
        """Each writer closes itself."""


class RemoteShards(Shards):
    """Shards in other processes: a call starts on every shard at once, and each is waited for
    within ``timeout_s``; one that fails is asked again before it counts as missing."""

    def __init__(self, transports: Sequence[Transport], timeout_s: float, partial: bool) -> None:
        super().__init__(transports, partial)
        self.timeout_s = timeout_s

    def answers(self, name: str, args: Sequence[tuple | None]) -> list[Any]:
        started = {
            i: t.begin(name, *a) for i, (t, a) in enumerate(zip(self.shards, args, strict=True)) if a is not None
        }
        found: list[Any] = [None] * len(self.shards)
        failed, cause = [], ""
        for i, pending in started.items():
            try:
                found[i] = pending.result(self.timeout_s)
            except Unreachable:
                try:  # the replica that failed is not the only one: Serve routes the retry
                    found[i] = self.shards[i].call(name, *args[i], timeout_s=self.timeout_s)
                except Unreachable as exc:
                    failed.append(i)
                    cause = str(exc)
        if failed:
            log.warning("shards %s did not answer %s (%s)", failed, name, cause)
            self.went_without(failed, cause)
        return found

    def status(self) -> list[dict]:
        found = []
        for i, transport in enumerate(self.shards):
            try:
                found.append({"shard": i, "chunks": transport.call("size", timeout_s=STATUS_TIMEOUT_S)})
            except Unreachable as exc:
                found.append({"shard": i, "reachable": False, "error": str(exc)})
        return found

    def close(self) -> None:
        """Each shard's replicas close themselves."""
