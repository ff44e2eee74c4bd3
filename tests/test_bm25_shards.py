"""benchmarks.bm25_shards: shards searched with the whole corpus's statistics score as one index
(real Lucene), where each shard's own statistics do not."""

from __future__ import annotations

import random

from benchmarks.bm25_shards import GlobalStatistics, served_order, shard_of
from engine.retrieval.lucene import LuceneIndex

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
        merged = GlobalStatistics(shards, 0.9, 0.4, local)
        worst = 0.0
        for query in queries:
            want, got = whole.search(query, 30), merged.search(query, 30)
            scores = dict(want)
            worst = max([worst] + [abs(s - scores[u]) / scores[u] for u, s in got if u in scores])
            if agrees:
                assert served_order(got)[:20] == served_order(want)[:20], query
        assert (worst < 1e-5) == agrees, worst
        for shard in shards:
            shard.close()
    whole.close()
