"""The writes since the dense base merged into a new base on a thread of their own.

A checkpoint writes the writes since the base (:class:`~engine.retrieval.segments.DenseSegments`),
bytes in proportion to them. Once they change ``MERGE_SHARE`` of the base (at least ``MERGE_MIN``
rows), a merge starts from what the view held then: the base read into memory, the removed rows
dropped, the added ones added, written beside its place (``.dense-<seq>.faiss.tmp``). The writer goes
on meanwhile: writes are acknowledged, applied and checkpointed as deltas of the old base. The
first checkpoint after the merge ends places it: the writes since the merge began (rows added, and
rows removed, from the old base or from what the merge took in) as the new base's delta, written
first, then the new base renamed into place, so a reader listing the folder sees the old base with
its delta or the new with its own, never a base without the writes since it. A merge cut short by
a crash leaves only its hidden file, removed at the next start; the log and the old base's deltas
hold every write.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from engine.retrieval.segments import (
    DenseSegments,
    aside,
    keep_only,
    merged_base,
    write_delta,
    write_index,
)
from engine.store.index_dir import DenseCheckpoint, base_path, delta_path

log = logging.getLogger(__name__)
MERGE_SHARE = 0.05  # a merge starts once the writes since the base change this share of it ...
MERGE_MIN = 20_000  # ... and at least this many rows (a delta this size costs a search well under 1 ms)


class _Merge(threading.Thread):
    """One merge of ``segments``' writes at ``seq`` into a new base, written aside."""

    def __init__(self, segments: DenseSegments, index_dir: Path, seq: int) -> None:
        super().__init__(name="dense-merge", daemon=True)
        self.seq, self.base = seq, segments.checkpoint.base
        self.removed, self.delta_rows = set(segments.removed), set(segments.delta_rows)
        self.rows, self.vectors = segments.delta_arrays()
        self.target = base_path(index_dir, seq)
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.perf_counter()
        try:
            write_index(merged_base(self.base, self.removed, self.rows, self.vectors), self.target, place=False)
        except BaseException as exc:  # a full disk, say: the deltas go on, and a later checkpoint tries again
            self.error = exc
        self.seconds = time.perf_counter() - started

    def discard(self) -> None:
        self.join()
        aside(self.target).unlink(missing_ok=True)


class Merger:
    """The dense checkpoints of one writer, merging in the background as its writes grow."""

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = Path(index_dir)
        self.running: _Merge | None = None
        for left in self.index_dir.glob(".dense-*.faiss.tmp"):  # a merge a crash cut short
            left.unlink()

    @property
    def ready(self) -> bool:
        """A merge has ended: the next checkpoint places it (or, when it failed, starts again)."""
        return self.running is not None and not self.running.is_alive()

    def checkpoint(self, segments: DenseSegments, seq: int, merge: bool = False) -> dict:
        """Make ``segments`` durable at ``seq``: a merge that ended placed, else the delta written
        and a merge started when one is due; ``merge``: merged now, whatever their size (``compact``).
        Returns :meth:`DenseSegments.write`'s report; ``merged`` when a new base now holds the view."""
        if merge:
            self.close()
            return segments.write(self.index_dir, seq, merge=True)
        if self.ready:
            done, self.running = self.running, None
            if done.error is None:
                return self._place(done, segments, seq)
            log.error("merging the dense writes failed (%s); kept as deltas, merged again later", done.error)
            aside(done.target).unlink(missing_ok=True)
        written = segments.write(self.index_dir, seq)
        if self.running is None and segments.changed >= max(MERGE_MIN, MERGE_SHARE * segments.base.ntotal):
            self.running = _Merge(segments, self.index_dir, seq)
            self.running.start()
        return written

    def _place(self, done: _Merge, segments: DenseSegments, seq: int) -> dict:
        """The merged base in place, with the writes since it began as its delta (written first)."""
        added = segments.delta_rows - done.delta_rows
        removed = (segments.removed - done.removed) | (done.delta_rows - segments.delta_rows)
        delta = delta_path(self.index_dir, done.seq, seq) if added or removed else None
        written = write_delta(delta, *segments.delta_arrays(added), removed) if delta is not None else 0
        os.replace(aside(done.target), done.target)
        checkpoint = DenseCheckpoint(done.target, seq, delta)
        keep_only(self.index_dir, checkpoint)
        log.info(
            "placed the dense merge of write %d (%.1f s aside); %d rows changed since",
            done.seq,
            done.seconds,
            len(added) + len(removed),
        )
        written += done.target.stat().st_size
        return {"checkpoint": checkpoint, "bytes": written, "merged": True, "rows_changed": len(added) + len(removed)}

    def wait(self) -> None:
        """Let a running merge end (the next checkpoint places it)."""
        if self.running is not None:
            self.running.join()

    def close(self) -> None:
        """Stop waiting for a merge: let it end, and drop its file."""
        if self.running is not None:
            self.running.discard()
            self.running = None
