"""Day one without judgments: each candidate on a split's judgments and on held-out pseudo-queries.

    python -m benchmarks.day_one --index-dir idx --data ../shared/datasets/nfcorpus --split dev

For an index built without judgments (or any index, its memory and learned fusion left out), every
candidate reorders or refetches BM25 + dense, scored twice: on the split's judgments (only to
measure) and on the pseudo-queries `build --adapt` makes (index_build/adapt/pseudo.py), searched in
the held-out view of the corpus it searches them in. Does a gain on pseudo-queries foretell one on
real queries? The result file says, per candidate and in one correlation:
``benchmarks/results/day-one-<split>.json``. Candidates:

- ``rrf k= wd=``: RRF's constant and the dense weight (what a fusion fitted on pseudo-queries picks);
- ``convex``: a weighted sum of the two retrievers' scores, min-max or z-normalised;
- ``rocchio``: the dense query moved towards the mean of the fused top m (pseudo-relevance feedback);
- ``prf-bm25``: BM25 again with the fused top 10's most distinctive terms added (RM3-like);
- ``graph``: the served corpus graph (engine/fusion/graph.py), k neighbours, weight w (and after
  ``rocchio``).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np

from engine.fusion.graph import CorpusGraph
from engine.fusion.rrf import reciprocal_rank_fusion
from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.adapt import HeldOutView, nearest
from index_build.adapt.pseudo import KINDS, pseudo_queries, relevant
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run, paired_test
from offline.progress import track
from offline.records import write_result

TOKEN = re.compile(r"[a-z][a-z0-9\-]{2,}")
BASE = "rrf k=10 wd=1"


class Candidates:
    """Every candidate's ranking of one query, over one view of the corpus (the index or the held-out
    copy): its BM25, vectors (by position) and units."""

    def __init__(self, bm25, vectors: np.ndarray, units: list[str], texts: list[str]) -> None:
        self.bm25, self.vectors, self.units = bm25, vectors, units
        self.position = {u: i for i, u in enumerate(units)}
        neighbours, sims = nearest(vectors, 10)
        self.graphs = {(k, w): CorpusGraph(neighbours[:, :k], sims[:, :k], w) for k in (5, 10) for w in (0.1, 0.2, 0.3)}
        self.terms = [Counter(TOKEN.findall(t.lower())) for t in texts]
        self.df = Counter(t for c in self.terms for t in c)

    def dense(self, vector: np.ndarray, depth: int = 100) -> list[str]:
        scores = self.vectors @ vector
        top = np.argpartition(-scores, depth)[:depth]
        return [self.units[i] for i in top[np.argsort(-scores[top], kind="stable")]]

    def expansion(self, top: list[str], n: int = 10) -> list[str]:
        """The fused top's most distinctive terms: RM weights (rank-discounted) times idf, no common words."""
        score: Counter = Counter()
        size = len(self.units)
        for rank, unit in enumerate(top, start=1):
            counts = self.terms[self.position[unit]]
            length = sum(counts.values()) or 1
            for term, tf in counts.items():
                if 2 <= self.df[term] <= 0.1 * size:
                    score[term] += tf / length * math.log(size / self.df[term]) / (10 + rank)
        return [t for t, _ in score.most_common(n)]

    def rank(self, text: str, vector: np.ndarray) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        hits = self.bm25.search(text, 100)
        bm25 = [u for u, _ in hits]
        dense = self.dense(vector)
        for k in (2, 5, 10, 20, 60):
            for wd in (0.75, 1, 1.5):
                fused = reciprocal_rank_fusion({"b": bm25, "d": dense}, k, {"d": wd})
                out[f"rrf k={k} wd={wd}"] = [u for u, _ in fused[:100]]
        base = reciprocal_rank_fusion({"b": bm25, "d": dense}, 10)
        top = [u for u, _ in base]
        # score fusion
        cand = list(dict.fromkeys(bm25 + dense))
        given = dict(hits)
        low = min(given.values()) if given else 0.0
        b = np.array([given.get(u, low) for u in cand])
        d = self.vectors[[self.position[u] for u in cand]] @ vector
        for name, norm in (("mm", _minmax), ("z", _z)):
            for a in (0.3, 0.5, 0.7):
                mix = (1 - a) * norm(b) + a * norm(d)
                out[f"convex-{name} a={a}"] = [cand[i] for i in np.argsort(-mix, kind="stable")][:100]
        # pseudo-relevance feedback
        for m, beta in ((3, 1.0), (5, 0.5), (5, 1.0), (10, 1.0)):
            moved = vector + beta * self.vectors[[self.position[u] for u in top[:m]]].mean(axis=0)
            moved /= np.linalg.norm(moved)
            fused = reciprocal_rank_fusion({"b": bm25, "d": self.dense(moved)}, 10)
            out[f"rocchio m={m} b={beta}"] = [u for u, _ in fused[:100]]
            if (m, beta) == (5, 0.5):  # feedback, then the graph over its fusion
                both = self.graphs[(5, 0.2)].rerank(fused, self.position)
                out["rocchio m=5 b=0.5 + graph k=5 w=0.2"] = [u for u, _ in both[:100]]
        expanded = " ".join([text, text, *self.expansion(top[:10])])
        fused = reciprocal_rank_fusion({"b": [u for u, _ in self.bm25.search(expanded, 100)], "d": dense}, 10)
        out["prf-bm25 m=10 t=10"] = [u for u, _ in fused[:100]]
        # the corpus graph, as served
        for (k, w), graph in self.graphs.items():
            out[f"graph k={k} w={w}"] = [u for u, _ in graph.rerank(base, self.position)][:100]
        return out


def _minmax(a: np.ndarray) -> np.ndarray:
    spread = a.max() - a.min()
    return (a - a.min()) / spread if spread > 0 else np.zeros_like(a)


def _z(a: np.ndarray) -> np.ndarray:
    return (a - a.mean()) / (a.std() or 1.0)


def runs_of(candidates: Candidates, queries: dict[str, str], encoder, desc: str) -> dict[str, dict[str, list[str]]]:
    from engine.retrieval.dense import encode

    vectors = encode(encoder, list(queries.values()), 64)
    runs: dict[str, dict[str, list[str]]] = {}
    for (qid, text), vector in track(list(zip(queries.items(), vectors, strict=True)), desc, "query"):
        for name, ranking in candidates.rank(text, vector).items():
            runs.setdefault(name, {})[qid] = ranking
    return runs


def table(qrels, runs) -> dict[str, dict[str, float]]:
    rows = {}
    for name, run in runs.items():
        test = paired_test(qrels, run, runs[BASE])
        rows[name] = {
            "nDCG@10": round(evaluate_run(qrels, run)["nDCG@10"], 4),
            "gain": round(test["gain"], 4),
            "p_value": round(test["p_value"], 4),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="a BEIR dataset whose judgments measure (only)")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--pseudo-queries", type=int, default=600)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    settings = EngineSettings(index_dir=args.index_dir, memory=False, fusion="rrf", rerank=False, adapted=False)
    engine = HybridEngine(settings)
    rows, vectors = engine.dense.vectors()
    units = [engine.dense.units[int(r)] for r in rows]
    chunks = engine.store.chunks(units)
    dataset = load_dataset(args.data)
    result: dict = {"index": str(args.index_dir), "split": args.split}
    texts = [chunks[u].contents for u in units]
    index_view = Candidates(engine.bm25, np.asarray(vectors, dtype=np.float32), units, texts)
    queries_of_split = dataset.split_queries(args.split)
    dev = table(dataset.qrels(args.split), runs_of(index_view, queries_of_split, engine.dense.encoder, args.split))
    result[args.split] = dev
    # pseudo-queries, in the held-out view as `build --adapt` searches them
    queries = pseudo_queries([chunks[u] for u in units], args.pseudo_queries)
    by_document: dict[str, list] = {}
    for unit in units:
        by_document.setdefault(chunks[unit].document_id, []).append(chunks[unit])
    view = HeldOutView(engine, settings, units, vectors, queries, True)
    held = {q.unit_id: q.held_out for q in queries}
    texts = [held.get(u, chunks[u].contents) for u in units]
    held_view = Candidates(view.bm25, view.vectors, units, texts)
    pseudo = {}
    for kind in KINDS:
        mine = [q for q in queries if q.kind == kind]
        if not mine:
            continue
        qrels = {f"{kind}{i}": relevant(q, by_document[chunks[q.unit_id].document_id]) for i, q in enumerate(mine)}
        texts_of = {f"{kind}{i}": q.text for i, q in enumerate(mine)}
        pseudo[kind] = table(qrels, runs_of(held_view, texts_of, engine.dense.encoder, f"{kind} pseudo-queries"))
    view.close()
    result["pseudo"] = pseudo
    names = [n for n in dev if n != BASE]
    mean_pseudo = {n: statistics.fmean(pseudo[k][n]["gain"] for k in pseudo) for n in names}
    result["pseudo_mean_gain"] = mean_pseudo
    result["correlation_pseudo_vs_split_gain"] = round(
        float(np.corrcoef([mean_pseudo[n] for n in names], [dev[n]["gain"] for n in names])[0, 1]), 3
    )
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = args.output or Path("benchmarks/results") / f"day-one-{args.split}.json"
    write_result(out, result)
    print(f"{'candidate':24s} {args.split:>22s} {'pseudo (mean gain)':>20s}")
    for name in dev:
        print(f"{name:24s} {dev[name]['nDCG@10']:.4f} {dev[name]['gain']:+.4f} p={dev[name]['p_value']:.3f}"
              f" {mean_pseudo.get(name, 0.0):+20.4f}")  # fmt: skip
    print(f"correlation of pseudo-query and {args.split} gains: {result['correlation_pseudo_vs_split_gain']}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
