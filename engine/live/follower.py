"""A read-only engine that follows the index directory's writer in another process (``serve
--workers N``'s other workers, Ray's search replicas).

After each refresh that applied writes the writer commits Lucene (the changes since its last
commit) and announces the position in the ``published`` file (:func:`~engine.store.index_dir.publish`).
A follower reads that file, a few bytes, before each search and every ``POLL_S`` on a thread of
its own; when it is behind it reopens Lucene's reader and applies the write-ahead log's records
since its position to its dense index (:class:`~engine.store.wal.LogTail`): the cost of catching
up is the writes since, not the index. Only when the writer has checkpointed past it (the log
emptied) does it read the checkpoint: the writes since the base it maps already, or a new base
after a merge, mapped (every process serving the index shares the base's pages). A write acknowledged
with ``wait`` is visible on every follower from the next search on.

The SQLite store is shared and runs ahead of the position by the writes applied since. A follower
therefore drops the dense rows the store no longer names when it reads a checkpoint, BM25 hits
count only where a dense row names them, and the engine skips a candidate whose text has gone: a
document replaced a moment ago may be missing from one answer, never shown half old and half new.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np

from engine.live.writer import apply_dense
from engine.store.index_dir import WAL_FILE, latest_dense, published
from engine.store.wal import LogTail

if TYPE_CHECKING:
    from engine.live.view import IndexView

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the follower's own thread looks for a newer position


class Follower:
    """Shows the writer's writes in ``view`` (this process's stores), from the next search on."""

    def __init__(self, view: IndexView) -> None:
        self.view = view
        self.index_dir = view.index_dir
        self.seq = -1  # the last write this engine shows
        self.checkpoint = -1  # the dense checkpoint it read whole
        self.applied = 0  # writes applied from the log since
        self._log = LogTail(self.index_dir / WAL_FILE)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if not self._read_checkpoint():
            raise RuntimeError(f"{self.index_dir}: no dense checkpoint could be read")
        self.catch_up()
        self._thread = threading.Thread(target=self._poll, name="follow-writer", daemon=True)
        self._thread.start()

    def catch_up(self) -> bool:
        """Show every write the writer has published (one small file read when current); False when
        there was nothing to show or it could not be shown yet (the next call tries again)."""
        target = published(self.index_dir)
        if target <= self.seq:
            return False
        with self._lock:
            if target <= self.seq:  # another thread caught up while this one waited
                return False
            if latest_dense(self.index_dir).seq > self.seq and not self._read_checkpoint():
                return False
            records = self._log.between(self.seq, target)
            if target > self.seq + len(records):  # the log was emptied meanwhile: a newer checkpoint has them
                if latest_dense(self.index_dir).seq <= self.seq:  # none yet (a stale announcement): not again
                    return False
                return self._read_checkpoint()
            view = self.view
            with view.lock.writing():
                view.bm25.refresh()
                for record in records:
                    apply_dense(view.dense, record)
            self.seq, self.applied = target, self.applied + len(records)
        log.debug("following: now at write %d (%d from the log)", target, len(records))
        return True

    def _read_checkpoint(self) -> bool:
        """The newest dense checkpoint, its rows named by the store (which may be ahead of it: rows
        it no longer names are dropped)."""
        checkpoint, view = latest_dense(self.index_dir), self.view
        try:  # the base this follower maps already is not mapped again: only the delta is read
            dense = view.dense.reopened(checkpoint)
        except Exception as exc:  # replaced by a newer checkpoint between the listing and the read
            log.debug("checkpoint %s went away (%s); the next search catches up", checkpoint.seq, exc)
            return False
        # the rows this view names already keep their names: only the rows that changed are looked up
        current = view.dense.units
        units = current.copy() if len(current) else view.store.unit_map()
        held, named = np.sort(dense.row_ids()), units.row_array()
        units.remove(_missing(named, held))  # not in the checkpoint: dropped, or the store ahead of it
        fresh = _missing(held, named)
        rows, ids = view.store.units_of_rows(fresh)
        units.add(rows, ids)
        dense.remove(_missing(fresh, np.asarray(rows, dtype=np.int64)).tolist())  # rows the store no longer holds
        dense.bind(units)
        with view.lock.writing():
            view.bm25.refresh()
            view.dense = dense
        self.seq = self.checkpoint = checkpoint.seq
        log.info("following: read checkpoint %d (%d chunks)", checkpoint.seq, len(dense.units))
        return True

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.catch_up()
            except Exception:  # a search catches up (and says why) when this thread cannot
                log.debug("following the writer failed; the next search tries again", exc_info=True)

    def status(self) -> dict:
        return {
            "following": "the writer's published writes",
            "write": self.seq,
            "checkpoint": self.checkpoint,
            "applied_from_log": self.applied,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _missing(values: np.ndarray, sorted_rows: np.ndarray) -> np.ndarray:
    """The entries of ``values`` not in ``sorted_rows`` (ascending), by binary search."""
    if not len(sorted_rows):
        return values
    at = np.minimum(np.searchsorted(sorted_rows, values), len(sorted_rows) - 1)
    return values[sorted_rows[at] != values]
