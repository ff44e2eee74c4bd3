"""The held-out view the adaptation is checked in: each pseudo-query's text taken out of its chunk."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np

from engine.fusion.rrf import reciprocal_rank_fusion
from engine.retrieval.encoder import encode
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.protocol import Query, Within
from engine.settings import EngineSettings
from index_build.adapt.pseudo import PseudoQuery
from offline.progress import track


class HeldOutView:
    """The corpus with each pseudo-query's text taken out of its chunk: a BM25 index (Lucene, in a
    temporary folder) and the vectors with those chunks encoded again."""

    def __init__(self, engine, settings: EngineSettings, units, vectors, queries, progress: bool) -> None:
        self.settings, self.units = settings, units
        changed = {q.unit_id: q.held_out for q in queries if q.held_out is not None}
        position = {u: i for i, u in enumerate(units)}
        self.folder = Path(tempfile.mkdtemp(prefix="adapt-heldout-"))
        chunks = engine.store.chunks(units)
        writer = LuceneIndex(self.folder, writable=True, create=True)
        for unit in track(units, "held-out BM25", "chunk", enabled=progress):
            writer.add(chunks[unit].document_id, [(unit, changed.get(unit, chunks[unit].contents))])
        writer.commit(0)
        writer.close()
        self.bm25 = LuceneIndex(self.folder, settings.bm25_k1, settings.bm25_b)
        self.vectors = np.array(vectors, dtype=np.float32)
        moved = [u for u in units if u in changed]
        self.vectors[[position[u] for u in moved]] = encode(
            engine.dense.encoder,
            [changed[u] for u in moved],
            settings.encode_batch_size,
            functools.partial(track, desc=f"encoding {len(moved)} held-out chunks", unit="batch", enabled=progress),
        )
        self.encoder = engine.dense.encoder

    def rrf_runs(self, queries: dict[str, PseudoQuery], progress: bool) -> dict[str, list[tuple[str, float]]]:
        """Each pseudo-query's RRF of BM25 and dense in the view, as the engine fuses them, by name."""
        s = self.settings
        qvecs = encode(self.encoder, [q.text for q in queries.values()], s.encode_batch_size)
        runs = {}
        items = list(enumerate(queries.items()))
        for i, (name, q) in track(items, "pseudo-queries through the held-out view", "query", enabled=progress):
            bm25 = [u for u, _ in self.bm25.retrieve(Query(q.text, None), s.bm25_depth, Within())]
            scores = self.vectors @ qvecs[i]
            top = np.argpartition(-scores, min(s.dense_depth, len(scores) - 1))[: s.dense_depth]
            dense = [self.units[j] for j in top[np.argsort(-scores[top], kind="stable")]]
            rankings = {"bm25": bm25, "dense": dense}
            weights = {"bm25": s.bm25_weight, "dense": s.dense_weight}
            runs[name] = reciprocal_rank_fusion(rankings, k=s.rrf_k, weights=weights)
        return runs

    def close(self) -> None:
        self.bm25.close()
        shutil.rmtree(self.folder, ignore_errors=True)
