"""BM25 over shards scored as one index: each shard searched with the whole corpus's statistics,
through Lucene's public API (no Java of ours), against one index of the same documents.

    python -m benchmarks.bm25_shards --shards 2,4,8

The dataset's documents go to shards by a hash of their id. A shard's BM25 differs from the whole
index's only through its statistics: each term's idf (document frequency, document count) and the
average length in the length normalisation. The coordinator sums the shards' statistics, as
Elasticsearch's dfs_query_then_fetch does, and gives each shard a similarity ``BM25(k1', b')``
whose normalisation equals the whole index's for every length (``k1' = k1 (1 - b + b r)``,
``b' = b r / (1 - b + b r)``, ``r`` the shard's average length over the whole's) and each query
term a boost ``idf_whole / idf_shard``. ``--local`` leaves every shard its own statistics, for
comparison. Scores then agree to float rounding, so equal scores (NFCorpus holds duplicate
abstracts) may differ in the last bit across shards; rankings are compared in the order the
merge would serve: score, with scores within 1e-6 (relative) of each other ordered by id.
Writes ``benchmarks/results/<machine>/bm25-shards.json``.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import options
from engine.retrieval.lucene import LuceneIndex
from offline.dataset import load_dataset
from offline.records import write_result

DEPTH = 100
TIE = 1e-6  # scores this close (relative) are one group, ordered by id


def shard_of(doc_id: str, shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "big") % shards


def served_order(hits: list[tuple[str, float]]) -> list[str]:
    """By score; a run of scores each within ``TIE`` of the one before, by id."""
    ordered, group = [], []
    for unit, score in sorted(hits, key=lambda h: -h[1]):
        if group and abs(group[-1][1] - score) > TIE * max(abs(score), 1e-9):
            ordered += sorted(u for u, _ in group)
            group = []
        group.append((unit, score))
    return ordered + sorted(u for u, _ in group)


class GlobalStatistics:
    """Shards of one corpus, each searched with the statistics of all of them."""

    def __init__(self, shards: list[LuceneIndex], k1: float, b: float, local: bool) -> None:
        from jnius import autoclass

        self.shards, self.local = shards, local
        self.j = shards[0].j
        self.BoostQuery = autoclass("org.apache.lucene.search.BoostQuery")
        self.TermQuery = autoclass("org.apache.lucene.search.TermQuery")
        self.Builder = autoclass("org.apache.lucene.search.BooleanQuery$Builder")
        self.should = autoclass("org.apache.lucene.search.BooleanClause$Occur").SHOULD
        stats = [s._view.searcher.collectionStatistics("contents") for s in shards]
        self.counts = [st.docCount() for st in stats]
        self.total = sum(self.counts)
        average = sum(st.sumTotalTermFreq() for st in stats) / self.total
        bm25 = autoclass("org.apache.lucene.search.similarities.BM25Similarity")
        for shard, st in zip(shards, stats, strict=True):
            r = st.sumTotalTermFreq() / st.docCount() / average
            if not local:
                shard._view.searcher.setSimilarity(bm25(k1 * (1 - b + b * r), b * r / (1 - b + b * r)))

    def terms(self, text: str) -> list[tuple[object, float]]:
        """The query's terms as the index's query generator makes them, each with its boost."""
        from jnius import cast

        query = self.j.generator.buildQuery("contents", self.j.analyzer, text)
        bag = cast("org.apache.lucene.search.BooleanQuery", query)
        found = []
        for clause in bag.clauses().toArray():
            query, boost = cast("org.apache.lucene.search.BooleanClause", clause).getQuery(), 1.0
            if query.getClass().getName().endswith("BoostQuery"):
                boosted = cast("org.apache.lucene.search.BoostQuery", query)
                query, boost = boosted.getQuery(), boosted.getBoost()
            found.append((cast("org.apache.lucene.search.TermQuery", query).getTerm(), boost))
        return found

    def search(self, text: str, k: int) -> list[tuple[str, float]]:
        terms = self.terms(text)
        frequencies = [[s._view.reader.docFreq(term) for term, _ in terms] for s in self.shards]
        whole = [sum(column) for column in zip(*frequencies, strict=True)]
        hits = []
        for shard, count, own in zip(self.shards, self.counts, frequencies, strict=True):
            query = self.Builder()
            for (term, boost), df, df_all in zip(terms, own, whole, strict=True):
                if df:
                    lift = 1.0 if self.local else _idf(df_all, self.total) / _idf(df, count)
                    query.add(self.BoostQuery(self.TermQuery(term), float(boost * lift)), self.should)
            hits += shard._top(query.build(), k)
        return sorted(hits, key=lambda h: (-h[1], h[0]))[:k]


def _idf(df: int, n: int) -> float:
    return math.log(1 + (n - df + 0.5) / (df + 0.5))


def compare(data_dir: Path, counts: list[int], local: bool, k1: float = 0.9, b: float = 0.4) -> dict:
    dataset = load_dataset(data_dir)
    ids = list(dataset.corpus)
    queries = list(dataset.split_queries("dev").values())
    work = Path(tempfile.mkdtemp(prefix="bm25-shards-"))
    try:
        whole = _index(work / "whole", ids, dataset, k1, b)
        expected = {q: whole.search(q, DEPTH + 20) for q in queries}
        found = {"depth": DEPTH, "queries": len(queries), "documents": len(ids), "runs": []}
        for n in counts:
            parts = [[d for d in ids if shard_of(d, n) == s] for s in range(n)]
            shards = [_index(work / f"{n}-{s}", part, dataset, k1, b) for s, part in enumerate(parts)]
            merged = GlobalStatistics(shards, k1, b, local)
            worst = differ_raw = differ = 0
            started = time.perf_counter()
            for q in queries:
                got, want = merged.search(q, DEPTH + 20), expected[q]
                scores = dict(want)
                worst = max([worst] + [abs(s - scores[u]) / abs(scores[u]) for u, s in got if u in scores])
                differ_raw += [u for u, _ in got[:DEPTH]] != [u for u, _ in want[:DEPTH]]
                differ += served_order(got)[:DEPTH] != served_order(want)[:DEPTH]
            seconds = time.perf_counter() - started
            found["runs"].append(
                {
                    "shards": n,
                    "documents_a_shard": merged.counts,
                    "max_relative_score_difference": worst,
                    "rankings_differing_by_score_then_id": differ_raw,
                    "rankings_differing_as_served": differ,
                    "ms_a_query": round(seconds * 1000 / len(queries), 2),
                }
            )
            print(found["runs"][-1], flush=True)
            for shard in shards:
                shard.close()
        found["whole_index_order_changed_by_grouping"] = sum(
            served_order(hits)[:DEPTH] != [u for u, _ in hits[:DEPTH]] for hits in expected.values()
        )
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
    parser.add_argument("--shards", default="2,4,8", help="comma-separated shard counts (default 2,4,8)")
    parser.add_argument("--local", action="store_true", help="each shard with its own statistics")
    args, settings = options.load(parser)
    counts = [int(n) for n in args.shards.split(",")]
    found = compare(settings.build.data_dir, counts, args.local, settings.engine.bm25_k1, settings.engine.bm25_b)
    write_result(args.output, found, vars(args))


if __name__ == "__main__":
    main()
