"""Cross-request micro-batching for the reranker.

On a GPU one batch of 800 pairs costs little more than one of 100, so concurrent queries' pairs
are scored together: the first request opens a batch, requests already in ``finish`` join it (waiting
at most ``max_wait_s`` for one, up to ``max_pairs``), one forward pass scores them all, and each
caller gets back exactly the scores of its own pairs. A lone request never waits for company that is
not coming: at one client the wait was pure latency.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.rerank.cross_encoder import PreparedPairs, Reranker
from engine.rerank.pair_assembly import PassageTokens


@dataclass
class _Request:
    prepared: PreparedPairs
    future: Future = field(default_factory=Future)


class RerankBatcher:
    """Same interface as :class:`Reranker`'s ``score``, ``prepare`` and ``finish``; each caller
    prepares its own pairs, one worker thread owns the model."""

    def __init__(self, reranker: Reranker, max_wait_s: float = 0.003, max_pairs: int = 1024) -> None:
        self.reranker = reranker
        self.max_wait_s = max_wait_s
        self.max_pairs = max_pairs
        self.batches = 0
        self._inside = 0  # callers in finish(): the batch waits only for those it does not hold yet
        self._count = threading.Lock()
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="rerank-batcher", daemon=True)
        self._worker.start()

    def __getattr__(self, name: str):  # name, device, batch_size... of the wrapped reranker
        return getattr(self.reranker, name)

    def score(self, query: str, passages: list[str], tokens: Sequence[PassageTokens] | None = None) -> list[float]:
        return self.finish(self.prepare(query, passages, tokens))

    def prepare(self, query: str, passages: list[str], tokens: Sequence[PassageTokens] | None = None) -> PreparedPairs:
        return self.reranker.prepare(query, passages, tokens)

    def finish(self, prepared: PreparedPairs) -> list[float]:
        if not prepared.rows:  # every score cached: nothing to wait for
            return self.reranker.finish(prepared)
        request = _Request(prepared)
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
            batch, pairs = [first], len(first.prepared.rows)
            while pairs < self.max_pairs and (self._inside > len(batch) or not self._queue.empty()):
                try:
                    nxt = self._queue.get(timeout=self.max_wait_s)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                pairs += len(nxt.prepared.rows)
            self._score(batch)

    def _score(self, batch: list[_Request]) -> None:
        self.batches += 1
        try:
            scores = self.reranker.finish_together([r.prepared for r in batch])
        except Exception as exc:  # every waiting caller learns of the failure
            for request in batch:
                request.future.set_exception(exc)
            return
        for request, own in zip(batch, scores, strict=True):
            request.future.set_result(own)


def score_together(reranker: Reranker, requests: list[tuple[str, list[str]]]) -> list[list[float]]:
    """Several queries' (query, passages) scored in one call; each gets back its own scores."""
    return reranker.finish_together([reranker.prepare(query, passages) for query, passages in requests])
