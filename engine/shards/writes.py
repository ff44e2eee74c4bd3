"""A sharded index's writes: each document's to the writer of the shard its id hashes to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.documents import DocumentIn
from engine.store.index_dir import shard_of

if TYPE_CHECKING:
    from engine.live.writer import Writer


class ShardedWriter:
    """The shards' writers as one ``live`` (:class:`~engine.live.writer.Writer`'s calls): a write is
    acknowledged when durable in its shard's log. Each shard's writer is its own engine's (here) or
    process's (a Ray deployment), and is closed by it. A new document's rows are numbered by its
    shard's writer, after the rows that shard held."""

    def __init__(self, writers: Sequence[Writer]) -> None:
        self.writers = list(writers)

    def _of(self, document_id: str) -> Writer:
        return self.writers[shard_of(document_id, len(self.writers))]

    def upsert(self, document: DocumentIn, wait: bool = False) -> dict:
        return self._of(document.document_id).upsert(document, wait)

    def delete(self, document_id: str, wait: bool = False) -> dict:
        return self._of(document_id).delete(document_id, wait)

    def document(self, document_id: str) -> dict | None:
        return self._of(document_id).document(document_id)

    def refresh(self) -> None:
        for writer in self.writers:
            writer.refresh()

    def status(self) -> dict:
        writers = [writer.status() for writer in self.writers]
        errors = [w["refresh_error"] for w in writers if w.get("refresh_error")]
        return {
            "shards": writers,
            "reachable": all(w.get("reachable", True) for w in writers),
            "refresh_error": errors[0] if errors else None,
        }

    def close(self) -> None:
        """The shards' writers are closed by their owners."""
