"""BM25 over shards scored as one index (the engine's method, :mod:`engine.shards.bm25`): each shard
searched with the whole corpus's statistics, against one index of the same documents.

    python -m benchmarks.bm25_shards --shard-counts 2,4,8

The dataset's documents go to shards by a hash of their id. A shard's BM25 differs from the whole
index's only through its statistics: each term's idf (document frequency, document count) and the
average length in the length normalisation. The coordinator sums the shards' statistics, as
Elasticsearch's dfs_query_then_fetch does, and gives each shard a similarity ``BM25(k1', b')``
whose normalisation equals the whole index's for every length (``k1' = k1 (1 - b + b r)``,
``b' = b r / (1 - b + b r)``, ``r`` the shard's average length over the whole's) and each query
term a boost ``idf_whole / idf_shard``. ``--local`` leaves every shard its own statistics, for
comparison. Scores then agree to float rounding, so equal scores (NFCorpus holds duplicate
abstracts) may differ in their last bits across shards; rankings are compared as the merge serves
them (:func:`engine.shards.merge.by_score_then_id`: scores within a few float32 steps ordered by
id), and by score then id alone.
Writes ``benchmarks/results/<machine>/bm25-shards.json``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import options
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.protocol import Query, Within
from engine.shards.bm25 import ShardedBM25, statistics_of
from engine.shards.fanout import Shards
from engine.shards.merge import TIE_STEPS, by_score_then_id
from engine.store.index_dir import shard_of
from offline.dataset import load_dataset
from offline.records import write_result

DEPTH = 100


class LuceneShard:
    """A shard of BM25 alone, answering what :class:`ShardedBM25` asks (``local``: with its own
    statistics, ignoring the corpus's)."""

    def __init__(self, index: LuceneIndex, local: bool = False) -> None:
        self.index, self.local = index, local

    def statistics(self, text: str):
        return statistics_of(self.index, text)

    def bm25(self, query: Query, k: int, filters, weighted, average: float):
        if self.local:
            return self.index.retrieve(query, k, Within())
        return self.index.retrieve(query, k, Within(), weighted, average)

    def size(self) -> int:
        return self.index.documents


def differing(got: list[tuple[str, float]], want: list[tuple[str, float]], raw: bool) -> bool:
    """Whether the top ``DEPTH`` differ, as served (:func:`by_score_then_id`) or by score then id."""
    if raw:
        order = sorted(got, key=lambda h: (-h[1], h[0]))
        return [u for u, _ in order[:DEPTH]] != [u for u, _ in want[:DEPTH]]
    return [u for u, _ in by_score_then_id(got)[:DEPTH]] != [u for u, _ in want[:DEPTH]]


def compare(data_dir: Path, counts: list[int], local: bool, k1: float = 0.9, b: float = 0.4) -> dict:
    dataset = load_dataset(data_dir)
    ids = list(dataset.corpus)
    queries = list(dataset.split_queries("dev").values())
    work = Path(tempfile.mkdtemp(prefix="bm25-shards-"))
    try:
        whole = _index(work / "whole", ids, dataset, k1, b)
        expected = {q: whole.retrieve(Query(q, None), DEPTH + 20, Within()) for q in queries}
        found = {"depth": DEPTH, "queries": len(queries), "documents": len(ids), "runs": []}
        for n in counts:
            parts = [[d for d in ids if shard_of(d, n) == s] for s in range(n)]
            shards = [_index(work / f"{n}-{s}", part, dataset, k1, b) for s, part in enumerate(parts)]
            merged = ShardedBM25(Shards([LuceneShard(shard, local) for shard in shards]))
            worst = worst_steps = differ_raw = differ = 0
            started = time.perf_counter()
            for q in queries:
                hits = merged.scored(Query(q, None), DEPTH + 20, None)
                want = expected[q]
                scores = dict(want)
                common = [(s, scores[u]) for u, s in hits if u in scores]
                worst = max([worst] + [abs(s - w) / abs(w) for s, w in common])
                worst_steps = max(
                    [worst_steps] + [float(abs(s - w) / np.spacing(np.float32(abs(w)))) for s, w in common]
                )
                differ_raw += differing(hits, want, raw=True)
                differ += differing(hits, want, raw=False)
            seconds = time.perf_counter() - started
            found["runs"].append(
                {
                    "shards": n,
                    "documents_a_shard": [shard.documents for shard in shards],
                    "max_relative_score_difference": worst,
                    "max_score_difference_float32_steps": worst_steps,
                    "rankings_differing_by_score_then_id": differ_raw,
                    "rankings_differing_as_served": differ,
                    "ms_a_query": round(seconds * 1000 / len(queries), 2),
                }
            )
            print(found["runs"][-1], flush=True)
            for shard in shards:
                shard.close()
        found["whole_index_order_changed_by_grouping"] = sum(
            differing(hits, hits, raw=False) for hits in expected.values()
        )
        found["tie_steps"] = TIE_STEPS
        whole.close()
        return found
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _index(path: Path, ids: list[str], dataset, k1: float, b: float) -> LuceneIndex:
    index = LuceneIndex(path, k1, b, writable=True, create=True)
    for doc_id in ids:
        index.add(doc_id, [(doc_id, dataset.corpus[doc_id].contents)])
    index.commit(0)
    index.close()
    return LuceneIndex(path, k1, b)


def main() -> None:
    parser = options.parser(__doc__, "data_dir", output="{machine}/bm25-shards.json")
    parser.add_argument("--shard-counts", default="2,4,8", help="comma-separated shard counts (default 2,4,8)")
    parser.add_argument("--local", action="store_true", help="each shard with its own statistics")
    args, settings = options.load(parser)
    counts = [int(n) for n in args.shard_counts.split(",")]
    found = compare(settings.build.data_dir, counts, args.local, settings.engine.bm25_k1, settings.engine.bm25_b)
    write_result(args.output, found, vars(args))


if __name__ == "__main__":
    main()
