"""Concurrent queries encoded in one pass, for the process that owns a GPU.

One query through MiniLM on a GPU is a few kernel launches over a handful of tokens: the device
waits on Python far more than on arithmetic, so queries from many workers are gathered and encoded
together. The first query opens a batch, queries arriving within ``max_wait_s`` join it, up to
``max_batch``; a query alone never waits for company (the batch closes when nobody else is
inside). Each caller gets back exactly its own (1, dim) row.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np


class QueryBatcher:
    """A :class:`~engine.retrieval.encoder.QueryEncoder` over ``encode_many`` (texts to their
    normalised rows), one thread owning the model."""

    def __init__(self, encode_many: Callable[[list[str]], np.ndarray], runtime: str, max_wait_s: float, max_batch: int):
        self.encode_many, self.runtime = encode_many, runtime
        self.max_wait_s, self.max_batch = max_wait_s, max_batch
        self.batches = 0
        self.queries = 0
        self._inside = 0  # callers waiting on a row: the batch waits only for those it does not hold yet
        self._count = threading.Lock()
        self._queue: queue.Queue[tuple[str, Future] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="query-batcher", daemon=True)
        self._worker.start()

    def __call__(self, text: str) -> np.ndarray:
        future: Future = Future()
        with self._count:
            self._inside += 1
        try:
            self._queue.put((text, future))
            return future.result()
        finally:
            with self._count:
                self._inside -= 1

    def stats(self) -> dict:
        return {"encode_batches": self.batches, "queries_encoded": self.queries}

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                with self._count:
                    others = self._inside > len(batch) + self._queue.qsize()  # somebody is on the way
                wait = deadline - time.monotonic()
                if self._queue.empty() and (not others or wait <= 0):
                    break
                try:
                    item = self._queue.get(timeout=max(wait, 0.0001))
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            try:
                rows = self.encode_many([text for text, _ in batch])
                self.batches, self.queries = self.batches + 1, self.queries + len(batch)
                for i, (_, future) in enumerate(batch):
                    future.set_result(rows[i : i + 1])
            except Exception as exc:
                for _, future in batch:
                    future.set_exception(exc)
