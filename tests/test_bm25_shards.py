"""BM25 over shards (engine/shards/bm25.py, as benchmarks.bm25_shards measures it): shards searched
with the whole corpus's statistics score and rank as one index (real Lucene), where each shard's
own statistics do not."""

from __future__ import annotations

import random

import numpy as np

from benchmarks.bm25_shards import LuceneShard
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.protocol import Query, Within
from engine.shards.bm25 import ShardedBM25
from engine.shards.fanout import Shards
from engine.store.index_dir import shard_of

WORDS = "coffee liver enzymes soy milk beans vitamin bone density trial cohort risk diet fiber sugar".split()


def _built(path, documents: dict[str, str]) -> LuceneIndex:
    index = LuceneIndex(path, writable=True, create=True)
    for doc_id, text in documents.items():
        index.add(doc_id, [(doc_id, text)])
    index.commit(0)
    index.close()
    return LuceneIndex(path)


def test_shards_with_global_statistics_rank_as_one_index(tmp_path) -> None:
    rng = random.Random(3)
    documents = {f"D{i:03d}": " ".join(rng.choices(WORDS, k=rng.randint(4, 60))) for i in range(90)}
    documents |= {f"C{i}": documents["D007"] for i in range(4)}  # duplicates: equal scores in one index
    whole = _built(tmp_path / "whole", documents)
    parts = [{d: t for d, t in documents.items() if shard_of(d, 3) == s} for s in range(3)]
    assert all(parts)
    queries = ["coffee liver", "soy milk beans", "vitamin bone density risk", "fiber sugar diet diet"]
    for local, agrees in ((False, True), (True, False)):
        shards = [_built(tmp_path / f"{local}-{s}", part) for s, part in enumerate(parts)]
        merged = ShardedBM25(Shards([LuceneShard(shard, local) for shard in shards]))
        worst = 0.0
        for query in queries:
            want, got = whole.retrieve(Query(query, None), 30, Within()), merged.ranked(Query(query, None), 30, None)
            scores = dict(want)
            steps = [abs(s - scores[u]) / np.spacing(np.float32(scores[u])) for u, s in got if u in scores]
            worst = max([worst, *steps])
            if agrees:
                assert [u for u, _ in got[:20]] == [u for u, _ in want[:20]], query  # duplicates by id, as one index
        assert (worst <= 3) == agrees, worst  # float32 steps off one index's score
        for shard in shards:
            shard.close()
    whole.close()
