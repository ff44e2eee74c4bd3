"""The two locks of an index: the view lock searches share and a refresh takes alone (within a
process), and the writer's file lock (one writing process an index)."""

from __future__ import annotations

import fcntl
import threading
from contextlib import contextmanager
from pathlib import Path

from engine.store.index_dir import LOCK_FILE, IndexDirError


class ViewLock:
    """Many searches or one refresh; a waiting refresh goes first, so it waits for at most the
    searches already running."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextmanager
    def reading(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def writing(self):
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._writing and not self._readers)
            self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def claim_writer(index_dir: Path):
    """The index's writer lock (a file lock the OS drops with the process), or a clear error."""
    path = Path(index_dir) / LOCK_FILE
    fh = open(path, "a+")  # noqa: SIM115 - held for the writer's life
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise IndexDirError(
            f"{path.parent}: another process writes this index (a running `hybrid-search serve`?); send documents"
            " to it with POST /documents, or stop it first"
        ) from None
    return fh
