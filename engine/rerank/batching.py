"""Cross-request micro-batching for the reranker.

On a GPU one batch of 800 pairs costs little more than one of 100, so concurrent queries' pairs
are scored together: the first request opens a batch, requests already in ``score`` join it (waiting
at most ``max_wait_s`` for one, up to ``max_pairs``), one forward pass scores them all, and each
caller gets back exactly the scores of its own pairs. A lone request never waits for company that is
not coming: at one client the wait was pure latency.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.rerank.cross_encoder import Reranker


@dataclass
class _Request:
    query: str
    passages: list[str]
    future: Future = field(default_factory=Future)


class RerankBatcher:
    """Same interface as :meth:`Reranker.score`; one worker thread owns the model."""

    def __init__(self, reranker: Reranker, max_wait_s: float = 0.003, max_pairs: int = 1024) -> None:
        self.reranker = reranker
        self.max_wait_s = max_wait_s
        self.max_pairs = max_pairs
        self.batches = 0
        self._inside = 0  # callers in score(): the batch waits only for those it does not hold yet
        self._count = threading.Lock()
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="rerank-batcher", daemon=True)
        self._worker.start()

    def __getattr__(self, name: str):  # name, device, batch_size... of the wrapped reranker
        return getattr(self.reranker, name)

    def score(self, query: str, passages: list[str]) -> list[float]:
        if not passages:
            return []
        request = _Request(query, passages)
        with self._count:
            self._inside += 1
        try:
            self._queue.put(request)
            return request.future.result()
        finally:
            with self._count:
                self._inside -= 1

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, pairs = [first], len(first.passages)
            while pairs < self.max_pairs and (self._inside > len(batch) or not self._queue.empty()):
                try:
                    nxt = self._queue.get(timeout=self.max_wait_s)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                pairs += len(nxt.passages)
            self._score(batch)

    def _score(self, batch: list[_Request]) -> None:
        self.batches += 1
        try:
            scores = score_together(self.reranker, [(r.query, r.passages) for r in batch])
        except Exception as exc:  # every waiting caller learns of the failure
            for request in batch:
                request.future.set_exception(exc)
            return
        for request, own in zip(batch, scores, strict=True):
            request.future.set_result(own)


def score_together(reranker: Reranker, requests: list[tuple[str, list[str]]]) -> list[list[float]]:
    """Several queries' (query, passages) scored in one call; each gets back its own scores."""
    scores = reranker.score_pairs([(query, p) for query, passages in requests for p in passages])
    split, start = [], 0
    for _, passages in requests:
        split.append(scores[start : start + len(passages)])
        start += len(passages)
    return split
