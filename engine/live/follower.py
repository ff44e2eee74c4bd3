"""A read-only engine that follows the index directory's writer in another process (a Ray search
replica beside the writer replica).

The writer checkpoints after every refresh that applied writes (Lucene commit, then
``dense-<seq>.faiss``); before each search the follower lists the directory, and when a newer
checkpoint is there it reopens Lucene's reader and loads that dense file, under the view lock. So a
search on any follower sees every write checkpointed before it began: a write acknowledged with
``wait`` is visible everywhere at once, any other within the writer's refresh interval.

The SQLite store is shared and runs ahead of a checkpoint by the writes applied since. A follower
therefore drops the dense rows the store no longer names (documents deleted or replaced after the
checkpoint), BM25 hits count only where a dense row names them, and the engine skips a candidate
whose text has gone: a document replaced a moment ago may be missing from one answer, never shown
half old and half new.
"""

from __future__ import annotations

import logging
import threading

from engine.retrieval.dense import DenseRetriever
from engine.store.index_dir import latest_dense

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.seq = -1
        self._lock = threading.Lock()
        if not self.catch_up():
            raise RuntimeError(f"{engine.settings.index_dir}: no dense checkpoint could be read")

    def catch_up(self) -> bool:
        """Show the newest checkpoint when this engine is behind it (one directory listing when not);
        False when it is current, or the file went away mid-read (the next search tries again)."""
        path, seq = latest_dense(self.engine.settings.index_dir)
        if seq == self.seq:
            return False
        with self._lock:
            if seq == self.seq:  # another search caught up while this one waited
                return False
            engine = self.engine
            try:
                dense = DenseRetriever(
                    path, engine.dense.encoder, engine.dense.query_encoder, engine.settings.hnsw_ef_search, "cpu", True
                )
            except Exception as exc:  # replaced by a newer checkpoint between the listing and the read
                log.debug("checkpoint %s went away (%s); next search catches up", path.name, exc)
                return False
            units = engine.store.unit_ids_by_row()
            held = dense.row_ids()
            dense.remove([row for row in held if row not in units])
            dense.bind({row: units[row] for row in held if row in units})
            with engine.view_lock.writing():
                engine.bm25.refresh()
                engine.dense = dense
            self.seq = seq
        log.info("following: now at checkpoint %d (%d chunks)", seq, len(dense.units))
        return True

    def status(self) -> dict:
        return {"following": "checkpoints of the index's writer", "checkpoint": self.seq}
