"""A query's work run beside it on a spare thread, only while one is idle: with one query at a
time, the core it leaves idle takes that work; under load, when every spare thread is busy, the
query does it itself, so no work is added and nothing queues behind the spare threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class SpareThreads:
    """``threads`` threads that take a call only when one of them is idle (0: never)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="spare") if threads else None
        self._idle = threading.BoundedSemaphore(max(threads, 1))

    def start(self, call: Callable[[], T]) -> Future[T] | None:
        """``call`` running on an idle spare thread, or None: none is idle, the caller runs it."""
        if self._pool is None or not self._idle.acquire(blocking=False):
            return None

        def run() -> T:
            try:
                return call()
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
