"""A query's work run beside it on a spare thread, only while one is idle: with one query at a
time, the core it leaves idle takes that work; under load, when every spare thread is busy (or,
for work that only pays on an idle core, when other queries are in progress), the query does it
itself, so no work is added and nothing queues behind the spare threads."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class SpareThreads:
    """``threads`` threads that take a call only when one of them is idle (0: never)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="spare") if threads else None
        self._idle = threading.BoundedSemaphore(max(threads, 1))
        self._queries = 0  # queries of this process in progress (:meth:`query`)
        self._counting = threading.Lock()

    @contextmanager
    def query(self) -> Iterator[None]:
        """A query in progress, counted for :meth:`start`'s ``alone``."""
        with self._counting:
            self._queries += 1
        try:
            yield
        finally:
            with self._counting:
                self._queries -= 1

    def start(self, call: Callable[[], T], alone: bool = False) -> Future[T] | None:
        """``call`` running on an idle spare thread in the caller's context (its trace, the shards it
        notes as missing: :mod:`engine.shards.fanout`), or None: none is idle (or, ``alone``, another
        query is in progress: the cores are not idle, and the hand-over would be work added), the
        caller runs it."""
        if self._pool is None or (alone and self._queries > 1) or not self._idle.acquire(blocking=False):
            return None

        context = contextvars.copy_context()

        def run() -> T:
            try:
                return context.run(call)
            finally:
                self._idle.release()  # before its answer is set: a caller it answered finds it idle

        try:
            return self._pool.submit(run)
        except RuntimeError:  # shut down
            self._idle.release()
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
