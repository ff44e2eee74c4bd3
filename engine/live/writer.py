"""A live index: documents added, replaced and deleted while the engine serves, durably.

The write path, one writer at a time:

1. the document is validated and its chunks encoded (outside any lock);
2. a record (the whole document, its new dense rows, the rows it replaces, its vectors) is
   appended to the write-ahead log and fsynced: from here the write is acknowledged (an append
   that does not fit on the disk is cut back and refused: nothing half-written is ever logged);
3. at the next refresh (every ``refresh_interval_s``, or at once when a caller waits for it) the
   pending records are applied to SQLite, FAISS and Lucene under the view lock, and Lucene's
   near-real-time reader is reopened. Searches hold the view lock's shared side while they
   retrieve, so a search sees every store before a refresh or every store after it, never half
   a document. A refresh that fails (a full disk) keeps its records pending for the next one;
4. a checkpoint (Lucene commit; the dense writes since the base written to a temporary file and
   renamed, :mod:`engine.retrieval.segments`, and merged into a new base in the background once
   they grow, :mod:`engine.retrieval.merge`; SQLite's WAL checkpointed) lets the log be emptied.

Every store remembers the last record it holds (Lucene's commit data, the dense checkpoint's
file name, SQLite's ``applied_seq``), so recovery replays each store from its own position and
a record is never applied twice (in memory too: ``applied`` keeps each store's position, so a
refresh retried after a failure skips what a store already took). Records carry everything a
store needs (rows are allocated when the record is written), so replay is deterministic.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.documents import DocumentIn, unit_id
from engine.errors import INVALID_PARAMS, ServiceError
from engine.live.locks import claim_writer
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.merge import Merger
from engine.store.index_dir import BM25_DIR, WAL_FILE, IndexDirError, latest_dense, publish
from engine.store.snapshot import SnapshotRefused, Taking
from engine.store.tokens import TextTokenizer
from engine.store.wal import WriteAheadLog
from engine.text import chunk_text

if TYPE_CHECKING:
    from engine.live.view import IndexView

log = logging.getLogger(__name__)
STORES = ("store", "dense", "lucene")


class Writer(Protocol):
    """What the doors ask of an index's writer: :class:`LiveIndex`, or a client of one in another
    process (a Ray deployment, or worker 0 of ``serve --workers N``)."""

    def upsert(self, document: DocumentIn, wait: bool = False) -> dict: ...

    def delete(self, document_id: str, wait: bool = False) -> dict: ...

    def document(self, document_id: str) -> dict | None: ...

    def snapshot(self, into: Path) -> dict:
        """A snapshot at the last acknowledged write, in the folder ``into`` (on the writer's machine)."""
        ...

    def status(self) -> dict:
        """Its state for /health; ``refresh_error`` set (or ``reachable`` false) means writes wait."""
        ...

    def close(self) -> None: ...


class DocumentNotFound(ServiceError, KeyError):
    """No document with that id (nothing was changed)."""

    status, jsonrpc_code = 404, INVALID_PARAMS

    def __str__(self) -> str:
        return f"no document {self.args[0]!r}"


class NotYetSearchable(ServiceError, RuntimeError):
    """The write is logged (acknowledged, durable) but applying it to the stores failed; it is
    retried at every refresh and replayed at the next start (``?refresh=wait_for`` could not be
    honoured: 503)."""

    status, jsonrpc_code = 503, -32004


class LiveIndex:
    """The writer of one index directory (an exclusive lock file says so to other processes)."""

    def __init__(
        self,
        view: IndexView,
        lock,
        refresh_interval_s: float = 1.0,
        checkpoint_bytes: int = 64 << 20,
        followed: bool = False,
    ) -> None:
        """``view``: the stores this writer changes. ``lock``: what :func:`claim_writer` returned,
        taken before any store was opened for writing. ``followed``: other processes show this index
        (:mod:`engine.live.follower`): each refresh that applied writes commits Lucene and publishes
        its position for them."""
        self.view = view
        self.index_dir = Path(view.index_dir)
        self.refresh_interval_s = refresh_interval_s
        self.checkpoint_bytes = checkpoint_bytes
        self.followed = followed
        self._lock_fh = lock
        self._write = threading.Lock()
        self._pending: list[dict] = []
        self._latest: dict[str, dict] = {}  # document id -> its newest unapplied record
        self.wal = WriteAheadLog(self.index_dir / WAL_FILE)
        self.seq, self.dense_seq = 0, latest_dense(self.index_dir).seq
        self.merger = Merger(self.index_dir)  # the dense writes merged into a new base, in the background
        self.applied: dict[str, int] = {}  # store -> the last record it holds (in memory)
        self.tokenizer = _store_tokenizer(view)
        self.refresh_error: str | None = None
        self.recovery: dict = {}
        self._recover()
        if followed:  # the followers start from what this start recovered
            self._publish()
        self.next_row = max(view.store.meta("next_row"), view.dense.units.max_row() + 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresher, name="live-refresh", daemon=True)
        self._thread.start()

    # recovery
    def _recover(self) -> None:
        started = time.perf_counter()
        records = self.wal.records()
        view = self.view
        self.applied = {
            "store": view.store.meta("applied_seq"),
            "dense": self.dense_seq,
            "lucene": view.bm25.committed_seq(),
        }
        for record in records:
            self._apply(record)
        self.seq = max([*self.applied.values(), *(r["seq"] for r in records)])
        view.bm25.refresh()
        view.bind_units()
        self.recovery = {"records": len(records), "seconds": round(time.perf_counter() - started, 3)}
        if records:
            log.info("replayed %d logged writes in %.2f s", len(records), self.recovery["seconds"])

    # writing
    def upsert(self, document: DocumentIn, wait: bool = False) -> dict:
        """Log ``document`` (replacing every chunk of an earlier version) and acknowledge it."""
        payload = document.model_dump(mode="json")
        for chunk in payload["chunks"]:
            chunk["title"] = payload["document_name"]
        texts = [chunk_text(c["title"], c["content"]) for c in payload["chunks"]]
        vectors = self.view.encode_texts(texts)
        with self._write:
            old_rows = self._rows_of(document.document_id)
            rows = list(range(self.next_row, self.next_row + len(texts)))
            record = {
                "seq": self.seq + 1,
                "op": "upsert",
                "document": payload,
                "rows": rows,
                "old_rows": old_rows,
                "vectors": base64.b64encode(vectors.astype("<f4").tobytes()).decode(),
            }
            self._log(record)
            self.next_row += len(rows)
        if wait:
            self._refresh_logged(record["seq"])
        return {
            "document_id": document.document_id,
            "chunks": len(rows),
            "seq": record["seq"],
            "replaced": bool(old_rows),
            "encoder": self.view.manifest.encoder,
        }

    def delete(self, document_id: str, wait: bool = False) -> dict:
        with self._write:
            old_rows = self._rows_of(document_id)
            if not old_rows:
                raise DocumentNotFound(document_id)
            record = {"seq": self.seq + 1, "op": "delete", "document_id": document_id, "old_rows": old_rows}
            self._log(record)
        if wait:
            self._refresh_logged(record["seq"])
        return {"document_id": document_id, "deleted_chunks": len(old_rows), "seq": record["seq"]}

    def document(self, document_id: str) -> dict | None:
        """The newest acknowledged version (applied or not), as sent, or None."""
        with self._write:
            record = self._latest.get(document_id)
        if record is not None:
            if record["op"] == "delete":
                return None
            doc = dict(record["document"])
            doc["chunks"] = [
                {**c, "doc_id": unit_id(doc["document_id"], c["chunk_id"])}
                for c in (_without_title(c) for c in doc["chunks"])
            ]
            return doc
        return self.view.store.document(document_id)

    def _rows_of(self, document_id: str) -> list[int]:
        record = self._latest.get(document_id)
        if record is None:
            return self.view.store.rows_of(document_id)
        return [] if record["op"] == "delete" else record["rows"]

    def _log(self, record: dict) -> None:
        self.wal.append(record)
        self.seq = record["seq"]
        self._pending.append(record)
        self._latest[record.get("document_id") or record["document"]["document_id"]] = record

    # applying
    def refresh(self) -> int:
        """Apply every acknowledged write and make it searchable; returns how many were applied.

        A failure (a full disk, say) leaves the writes not yet applied pending, to be retried by the
        next refresh: they are in the log, and each store takes each record once."""
        try:
            with self._write:
                applied = self._apply_pending()
                big = self.wal.size > self.checkpoint_bytes
                if applied and self.followed and not big:
                    self._publish()
            if big:
                self.checkpoint()
        except Exception as exc:
            self.refresh_error = _brief(exc)
            raise
        self.refresh_error = None
        return applied

    def _refresh_logged(self, seq: int) -> None:
        try:
            self.refresh()
        except Exception as exc:
            raise NotYetSearchable(
                f"logged as write {seq} (it is kept, and applied once the index can take it), but not searchable"
                f" yet: {_brief(exc)}"
            ) from exc

    def _apply_pending(self) -> int:
        pending = self._pending
        if not pending:
            return 0
        with self.view.lock.writing():
            try:
                for record in pending:
                    self._apply(record)
            finally:  # what was applied becomes searchable, even when a later record failed
                self.view.bm25.refresh()
        self._pending = []
        for record in pending:
            key = record.get("document_id") or record["document"]["document_id"]
            if self._latest.get(key) is record:
                del self._latest[key]
        return len(pending)

    def _apply(self, record: dict) -> None:
        """Apply ``record`` to every store that does not hold it yet (replay and retries skip the others)."""
        seq = record["seq"]
        for store, apply in zip(STORES, (self._apply_store, self._apply_dense, self._apply_lucene), strict=True):
            if seq > self.applied[store]:
                apply(record)
                self.applied[store] = seq

    def _apply_store(self, record: dict) -> None:
        store = self.view.store
        if record["op"] == "upsert":
            doc = record["document"]
            texts = [chunk_text(c["title"], c["content"]) for c in doc["chunks"]]
            tokens = self.tokenizer(texts) if self.tokenizer is not None else None
            store.write_document(doc, record["rows"], record["seq"], tokens)
        else:
            store.delete_document(record["document_id"], record["seq"])

    def _apply_dense(self, record: dict) -> None:
        apply_dense(self.view.dense, record)

    def _apply_lucene(self, record: dict) -> None:
        bm25 = self.view.bm25
        if record["op"] == "delete":
            bm25.delete(record["document_id"])
            return
        doc = record["document"]
        units = [
            (unit_id(doc["document_id"], c["chunk_id"]), chunk_text(c["title"], c["content"])) for c in doc["chunks"]
        ]
        bm25.replace(doc["document_id"], units, doc.get("metadata"))

    def _publish(self) -> None:
        """What followers need to show every applied write: Lucene committed (its changes since the
        last commit, fsynced), then the position announced; they read the dense rows from the log."""
        seq = self.applied["lucene"]
        self.view.bm25.commit(seq)
        publish(self.index_dir, seq)

    def checkpoint(self, merge: bool = False) -> dict:
        """Make every store durable on its own and empty the log; ``merge``: the dense writes merged
        into a new base whatever their size (``hybrid-search compact``)."""
        started = time.perf_counter()
        with self._write:
            applied = self._apply_pending()
            seq, view = self.seq, self.view
            view.bm25.commit(seq)
            dense, segments = {}, view.dense.segments
            if seq != self.dense_seq or self.merger.ready or (merge and segments.checkpoint.delta is not None):
                with view.lock.reading():
                    dense = self.merger.checkpoint(segments, seq, merge)
                if dense["merged"]:  # the merged base replaces the writer's own view too, mapped
                    view.rebase(dense["checkpoint"])
                self.dense_seq = seq
            view.store.checkpoint()
            logged = self.wal.size
            self.wal.reset()
            if self.followed:
                publish(self.index_dir, seq)
        return {
            "seq": seq,
            "log_bytes": logged,
            "applied": applied,
            "dense_bytes": dense.get("bytes", 0),
            "dense_merged": dense.get("merged", False),
            "seconds": round(time.perf_counter() - started, 3),
        }

    def snapshot(self, into: Path) -> dict:
        """A snapshot of the index in the folder ``into``, at the last acknowledged write
        (:mod:`engine.store.snapshot`): writes wait to be logged while its position is fixed (the
        log copied, links made), never while the store is copied; searches never wait."""
        with Taking(self.index_dir, into) as taking:
            with self._write:
                taking.fix(*self.view.bm25.last_commit())
            return taking.finish()

    def _refresher(self) -> None:
        while not self._stop.wait(self.refresh_interval_s):
            failing = self.refresh_error
            try:
                self.refresh()
            except Exception:  # keep refreshing; the writes stay pending (and logged) for the next try
                if self.refresh_error != failing:  # say it once, not every interval
                    log.error("refresh failed (%s); %d writes wait, logged", self.refresh_error, len(self._pending))
            else:
                if failing:
                    log.info("refresh works again")

    def status(self) -> dict:
        return {
            "seq": self.seq,
            "pending": len(self._pending),
            "log_bytes": self.wal.size,
            "refresh_interval_s": self.refresh_interval_s,
            "refresh_error": self.refresh_error,
            "recovered": self.recovery,
        }

    def close(self) -> None:
        """Stop refreshing and checkpoint, so the next start has nothing to replay."""
        self._stop.set()
        self._thread.join()
        self.merger.wait()  # a merge under way is placed by the last checkpoint, not lost
        try:
            self.checkpoint()
        except Exception as exc:  # a full disk, say: the log keeps every write for the next start to replay
            log.error("checkpoint at close failed (%s); the next start replays the log", _brief(exc))
        self.merger.close()
        self.wal.close()
        self._lock_fh.close()


def snapshot_unwritten(index_dir: Path, into: Path, bm25: LuceneIndex | None = None) -> dict:
    """A snapshot of an index no process writes (a read-only server's, or one nothing serves) in the
    folder ``into``, its position fixed holding the writer's lock so that no writer starts meanwhile;
    refused while one writes, whose server takes it (POST /snapshots). ``bm25``: the index's Lucene,
    open already (else opened here, read-only, for the time it takes)."""
    with Taking(index_dir, into) as taking:
        try:
            lock = claim_writer(index_dir)
        except IndexDirError:
            raise SnapshotRefused(
                f"{index_dir}: another process writes this index (a running `hybrid-search serve`?); ask it for the"
                " snapshot (POST /snapshots), or stop it first"
            ) from None
        try:
            lucene = bm25 or LuceneIndex(Path(index_dir) / BM25_DIR)
            try:
                taking.fix(*lucene.last_commit())
            finally:
                if bm25 is None:
                    lucene.close()
        finally:
            lock.close()
        return taking.finish()


def apply_dense(dense, record: dict) -> None:
    """One logged write on a dense index: the rows it replaces dropped (those it still holds: a
    follower may have dropped them already, and a replay names none yet), its new rows added. The
    writer's, a replay's and every follower's."""
    dense.remove(record["old_rows"])
    if record["op"] == "upsert":
        doc = record["document"]
        vectors = np.frombuffer(base64.b64decode(record["vectors"]), dtype="<f4").reshape(len(record["rows"]), -1)
        units = [unit_id(doc["document_id"], c["chunk_id"]) for c in doc["chunks"]]
        dense.add(record["rows"], vectors, units)


def _store_tokenizer(view: IndexView) -> TextTokenizer | None:
    """What makes the token ids the store keeps for each chunk (the manifest's ``passage_tokens``),
    or None: the index keeps none (format 2: a reranker computes them at load), or the encoder's
    tokenizer no longer makes them (then chunks written here are tokenized when first reranked)."""
    recipe = view.manifest.passage_tokens
    if not recipe:
        return None
    tokenizer = TextTokenizer(view.dense.encoder.tokenizer)
    if tokenizer.recipe != recipe:
        log.warning("the encoder's tokenizer is not the one the store's token ids were made by: writing none")
        return None
    return tokenizer


def _brief(exc: BaseException) -> str:
    """One line for health and logs (a Java exception's text carries its whole stack)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _without_title(chunk: dict) -> dict:
    return {k: v for k, v in chunk.items() if k != "title"}
