"""The reranker of ``serve --workers N`` as one process of its own, shared by every worker.

With N workers each loading the cross-encoder, a GPU holds N copies of the model and N processes
take turns on it, each with one query's pairs. Here one process owns the model: the supervisor
(:mod:`serving.workers`) starts it before the workers and again whenever it dies. A worker makes
its pairs itself, from the token ids the index keeps (:class:`serving.remotes.RemoteReranker`, the
:class:`~engine.rerank.cross_encoder.PairPreparer` half of a reranker, with the score cache), and
sends their rows over the workers' local channel (:mod:`serving.worker_channel`, the address
``reranker``, a kept connection, the query's tokens once: :class:`~engine.rerank.token_rows.WireRows`);
the process gathers every worker's rows into batches by a token budget
(:class:`~engine.rerank.batching.RerankBatcher`, ``rerank_batch_tokens``), scores each batch (on
CUDA in one pass), and answers each call with exactly its own scores and its own time on them.

With ``--shared-query-encoder on`` the process also encodes every worker's queries with the index's
encoder on its own device (:class:`serving.remotes.RemoteQueryEncoder`, gathered by
:class:`~engine.retrieval.query_batcher.QueryBatcher`): the GPU then has one owner for both models,
and each worker only searches the vectors. Off, each worker encodes its own on the CPU (ONNX).

A failure is a reranker failure as in one process: a call that fails or finds the process gone
(killed, restarting) raises in the worker, whose query is answered in the fused order
(:mod:`engine.search.stages`), and its ``/health`` says ``degraded`` with the process unreachable.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

import numpy as np

from engine.rerank.token_rows import WireRows
from engine.retrieval.encoder import pick_device
from serving.remotes import DESCRIBED
from serving.settings import Settings
from serving.signals import sleep_until
from serving.worker_channel import Channel, ChannelServer

log = logging.getLogger(__name__)
RERANKER = "reranker"  # its address on the channel, and its name among the supervisor's children
QUERY_BATCH = 64  # queries encoded in one pass at most


def shared(settings: Settings) -> bool:
    """Whether ``serve --workers N`` runs the reranker in a process of its own (``shared_reranker``).
    ``auto`` with ``--device auto`` asks whether there is a GPU (:func:`pick_device`: torch, where a
    GPU driver shows; no CUDA context is made, and its children are spawned, not forked)."""
    if settings.serving.worker_count() < 2 or not settings.engine.reranker_wanted:
        return False
    if settings.serving.shared_reranker != "auto":
        return settings.serving.shared_reranker == "on"
    return pick_device(settings.engine.device) == "cuda"


def run_reranker(channel: Channel, settings: Settings, messages: Connection, levels: dict[str, int]) -> None:
    """The process (spawned): load the reranker, warm it (compiled on CUDA), say "ready" with what
    the workers need to make its pairs (None: no reranker could be loaded, the workers serve fused
    results), then score the workers' calls until SIGTERM. Its threads are every core, unless the
    user set ``OMP_NUM_THREADS``: the model is the heavy part of a query."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=levels.pop(""), format="%(asctime)s %(levelname)s %(name)s [reranker]: %(message)s", stream=sys.stderr
    )
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    for name in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(name, threads)
    from engine.rerank.batching import RerankBatcher, sent_rows  # after the variables above: torch reads them
    from engine.rerank.loading import open_reranker

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    threading.Thread(target=_stop_with_supervisor, args=(stop,), name="supervisor-watch", daemon=True).start()
    s = settings.engine
    try:
        reranker = open_reranker(s, pick_device(s.device), cache=False)  # the workers keep the score cache
    except Exception as exc:
        log.debug("the reranker could not start", exc_info=True)
        messages.send(("failed", f"the reranker process: {exc}"))
        raise SystemExit(2) from None
    if reranker is None:
        messages.send(("ready", None))
        return
    batcher = RerankBatcher(reranker, s.rerank_batch_wait_ms / 1000, s.rerank_batch_tokens)
    queries = _query_batcher(settings, reranker.device) if settings.serving.shared_query_encoder == "on" else None

    def score(wire: WireRows, lengths: np.ndarray) -> tuple[np.ndarray, float]:
        """A worker's rows scored, and this process's seconds on them (what its ``/metrics`` shows)."""
        began = time.perf_counter()
        scores = np.asarray(batcher.finish(sent_rows(wire, lengths)), dtype=np.float32)
        return scores, time.perf_counter() - began

    def status() -> dict:
        encoded = queries.stats() if queries is not None else {}
        return (
            {"pid": os.getpid(), "device": reranker.device, "compiled": reranker.compile_state}
            | batcher.stats()
            | encoded
        )

    handlers = {"score": score, "status": status} | ({"encode": queries} if queries is not None else {})
    server = ChannelServer(channel, RERANKER, handlers)
    described = {key: getattr(reranker, key) for key in DESCRIBED}
    messages.send(("ready", described | {"query_encoder": queries.runtime if queries is not None else None}))
    log.info("reranker %s on %s (%s) scoring every worker's pairs", reranker.name, reranker.device, reranker.runtime)
    sleep_until(stop)
    server.close(settings.serving.query_timeout_s)
    batcher.close()
    if queries is not None:
        queries.close()
    log.info("the reranker process stopped")
    logging.shutdown()
    # no interpreter teardown: threads CUDA and torch leave behind (compile workers, the caching
    # allocator's) held the process past the supervisor's wait on an H100, where it was killed
    os._exit(0)


def _query_batcher(settings: Settings, device: str):
    """The index's query encoder on the reranker's device (fp16 on CUDA), batching every worker's
    queries."""
    from engine.retrieval.encoder import encode, load_encoder
    from engine.retrieval.query_batcher import QueryBatcher
    from engine.store.index_dir import read_manifest

    name = read_manifest(settings.engine.index_dir).encoder
    model = load_encoder(name, device)
    log.info("encoding every worker's queries with %s on %s", name, device)
    return QueryBatcher(
        lambda texts: encode(model, texts, batch_size=QUERY_BATCH),
        f"shared torch-{device}",
        settings.engine.rerank_batch_wait_ms / 1000,
        QUERY_BATCH,
    )


def _stop_with_supervisor(stop: threading.Event) -> None:
    """The process outlives no supervisor."""
    wait([multiprocessing.parent_process().sentinel])
    log.warning("the supervisor is gone; stopping")
    stop.set()
