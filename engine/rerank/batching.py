"""Cross-request batching for the reranker, by a token budget.

On a GPU a pass over 800 pairs costs far less than eight passes over 100, so concurrent queries'
pairs are scored together: the first request opens a batch, requests already in ``finish`` join it
(waiting at most ``max_wait_s`` for one) while the batch's tokens stay within ``max_tokens``, the
model scores them all (on CUDA in one pass, elsewhere in length-sorted passes), and each caller
gets back exactly the scores of its own pairs. On CUDA the batch is only started on the GPU: a
second thread waits for its scores and hands them out, while the first gathers and pads the next
batch (at most :data:`IN_FLIGHT` batches started and not yet handed out). The budget counts tokens, not pairs or queries (text-embeddings-inference's
max-batch-tokens): a pair's cost and memory grow with its length, so 1,000 pairs of 64 tokens and
250 of 256 are one budget. A request that would overflow the batch opens the next one. A lone
request never waits for company that is not coming: at one client the wait was pure latency.

One batcher owns the model: inside a process on CUDA (:class:`~engine.search.hybrid.HybridEngine`),
and in the process that scores every worker's pairs with ``serve --workers N``
(:mod:`serving.reranker_process`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.rerank.cross_encoder import PreparedPairs, Reranker
from engine.rerank.pair_assembly import PassageTokens
import numpy as np

from engine.rerank.token_rows import WireRows

IN_FLIGHT = 2  # batches on the GPU at once: one running, one prepared behind it (CudaPasses' two slots)


@dataclass
class _Request:
    prepared: PreparedPairs
    future: Future = field(default_factory=Future)

    @property
    def tokens(self) -> int:
        return self.prepared.rows.tokens


class RerankBatcher:
    """Same interface as :class:`Reranker`'s ``score``, ``prepare`` and ``finish``; each caller
    prepares its own pairs, one worker thread owns the model. ``max_tokens``: the batch's budget,
    counted over its pairs' token ids (``rerank_batch_tokens``)."""

    def __init__(self, reranker: Reranker, max_wait_s: float, max_tokens: int) -> None:
        self.reranker = reranker
        self.max_wait_s = max_wait_s
        self.max_tokens = max_tokens
        self.batches = 0
        self.pairs = 0
        self.model_seconds = 0.0  # busy time: a batch's padding, copies and model, rows already made, overlaps once
        self._busy_until = 0.0
        self._inside = 0  # callers in finish(): the batch waits only for those it does not hold yet
        self._count = threading.Lock()
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._started: queue.Queue[tuple[list[_Request], float, object] | None] = queue.Queue(IN_FLIGHT - 1)
        self._worker = threading.Thread(target=self._run, name="rerank-batcher", daemon=True)
        self._handing = threading.Thread(target=self._hand_out, name="rerank-hand-out", daemon=True)
        self._worker.start()
        self._handing.start()

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

    def stats(self) -> dict:
        """Batches scored, their pairs, and the model's time on them (what a served rerank stage is
        compared with)."""
        n = max(self.batches, 1)
        return {
            "batches": self.batches,
            "pairs": self.pairs,
            "model_seconds": round(self.model_seconds, 3),
            "model_ms_per_batch": round(1000 * self.model_seconds / n, 2),
            "pairs_per_batch": round(self.pairs / n, 1),
        }

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)
        self._handing.join(timeout=5)

    def _run(self) -> None:
        held: _Request | None = None  # the request that would have overflowed the last batch: it opens this one
        while True:
            first, held = held or self._queue.get(), None
            if first is None:
                self._started.put(None)
                return
            batch, tokens = [first], first.tokens
            while tokens < self.max_tokens and (self._inside > len(batch) or not self._queue.empty()):
                try:
                    nxt = self._queue.get(timeout=self.max_wait_s)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                if tokens + nxt.tokens > self.max_tokens:
                    held = nxt
                    break
                batch.append(nxt)
                tokens += nxt.tokens
            self._score(batch)

    def _score(self, batch: list[_Request]) -> None:
        self.batches += 1
        self.pairs += sum(len(r.prepared.rows) for r in batch)
        started = time.perf_counter()
        try:
            collect = self.reranker.start_together([r.prepared for r in batch])
        except Exception as exc:
            collect = _raise(exc)
        self._started.put((batch, started, collect))  # waits while the batch before it is still running

    def _hand_out(self) -> None:
        while (item := self._started.get()) is not None:
            batch, started, collect = item
            try:
                scores = collect()
            except Exception as exc:  # every waiting caller learns of the failure
                for request in batch:
                    request.future.set_exception(exc)
                continue
            finished = time.perf_counter()
            self.model_seconds += finished - max(started, self._busy_until)
            self._busy_until = finished
            for request, own in zip(batch, scores, strict=True):
                request.future.set_result(own)


def _raise(exc: Exception):
    def collect():
        raise exc

    return collect


def sent_rows(wire: WireRows, lengths: np.ndarray) -> PreparedPairs:
    """A caller's rows as it sent them (made where its score cache is: a worker of ``serve --workers
    N``, a Ray replica), with the characters its passes are sorted by where passes are (so that they
    score as in the caller's own process), ready for :meth:`RerankBatcher.finish` or ``finish_together``."""
    return PreparedPairs([None] * len(lengths), [], wire.rows(), lengths.tolist())


def score_rows(reranker: Reranker, calls: list[tuple[WireRows, np.ndarray]]) -> list[list[float]]:
    """Several callers' pair rows (a Ray replica's callers), scored in one pass; each gets back its own scores."""
    return reranker.finish_together([sent_rows(wire, lengths) for wire, lengths in calls])
