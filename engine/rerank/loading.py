"""The reranker an engine serves: which one, on which runtime, and what an int8 copy is smoothed on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from engine.rerank.cross_encoder import Reranker, RerankerError
from engine.rerank.pair_cache import PairCache
from engine.settings import EngineSettings
from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE

log = logging.getLogger(__name__)


def open_reranker(settings: EngineSettings, device: str, cache: bool = True) -> Reranker | None:
    """The configured reranker on ``device``, or None (said in the log) when the index has none or
    it cannot load; a reranker named explicitly (``--reranker``) that cannot load raises. ``cache``:
    as for :func:`load_reranker`."""
    if not settings.rerank:
        return None
    path = settings.reranker_path
    if settings.reranker is None and not Path(path).is_dir():
        log.warning("no reranker at %s (train one with `hybrid-search train-reranker`); serving fused results", path)
        return None
    try:
        return load_reranker(settings, path, device, cache)
    except RerankerError as exc:
        if settings.reranker is not None:
            raise
        log.warning("%s; serving fused results", exc)
        return None


def load_reranker(settings: EngineSettings, path: str, device: str, cache: bool = True) -> Reranker:
    """The reranker at ``path`` as serving runs it: runtime, quantization, length, batch, compiled on
    CUDA, and the pair cache unless ``cache`` is off (training scores each checkpoint afresh; the
    shared reranker process leaves the cache to the workers)."""
    s = settings
    return Reranker(
        path,
        device,
        max_length=s.max_length,
        batch_size=s.rerank_batch_for(device),
        runtime=s.rerank_runtime,
        quantize=s.rerank_quantize,
        cache=PairCache(s.rerank_cache_size, s.rerank_cache_s) if cache and s.rerank_cache_size else None,
        length_cap=s.rerank_length_cap,
        calibration=int8_calibration(s.index_dir),
        compile_model=s.rerank_compile,  # the plan says why when it cannot apply
        batch_tokens=s.rerank_batch_tokens,
        cuda_graphs=s.rerank_cuda_graphs,
    )


def int8_calibration(index_dir: Path, queries: int = 32, per_query: int = 8) -> Callable[[], list[tuple[str, str]]]:
    """Pairs to smooth an int8 reranker on, read when it is quantized: the opening words of
    ``queries`` of the index's documents, each against ``per_query`` others (the channels'
    ranges come from the text, not from relevance: 20 dev queries' top 20 calibrate no better)."""

    def pairs() -> list[tuple[str, str]]:
        store = Path(index_dir) / DOCS_FILE
        chunks = DocStore(store).sample(queries * (per_query + 1)) if store.is_file() else []
        asked, n = chunks[:queries], len(chunks)  # a small store lends its chunks to several pairs
        return [
            (" ".join((c.title or c.text).split()[:8]), chunks[(queries + i * per_query + j) % n].contents)
            for i, c in enumerate(asked)
            for j in range(per_query)
        ]

    return pairs
