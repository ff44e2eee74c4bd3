"""The peer table at size (issue 66): every system on one corpus of NFCorpus plus distractors
(``python -m benchmarks.scale --engine``), all of the split's judged queries, in two labelled groups.

- **unsupervised**, nothing learned from judgments: ours with the memory left out (RRF at k 60 and
  at k 10, asked per request as a user's ``"fusion"`` asks); LanceDB hybrid (its native FTS and an
  exact vector scan, fused by its default RRF reranker); LanceDB hybrid over an IVF_SQ index tuned
  to recall@100 >= 0.95 against the exact scan (IVF with 8-bit scalar codes, as our own dense index
  at this size); LanceDB FTS alone; bm25s; Lucene BM25 through pyserini's own ``LuceneSearcher`` on
  our index's Lucene folder; FAISS exact (flat inner product) and our IVF file alone through FAISS;
  bm25s and FAISS exact fused by RRF (k 60).
- **supervised**, the judgment memory built from the train judgments: ours with the memory fused by
  RRF, and by the learned fusion (as served); LanceDB's FTS and IVF_SQ legs fused with our
  memory's own list by our RRF, k and weights.

Every row answers a query with its top 100 document ids, and is timed so (the rows take turns query
by query, the order rotating; the query is encoded inside every row that needs a vector). nDCG@10 is
scored twice: as ranked, and source-collapsed (each distractor mapped to the abstract it was made
from, repeats dropped): the first asks "was the judged abstract found", the second "was its text
found", which a copy of it also answers. Each vector leg's recall@100 against FAISS exact is
recorded on the same queries, with the rows' counts and index statistics.

    python -m benchmarks.peers_at_size --index-dir /tmp/hs-1m/index-unjudged-1000000 \\
        --data /tmp/hs-1m/corpus-unjudged-1000000 --cache /tmp/peers-1m
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks import options
from benchmarks.peers import Peer, bm25s_peer, given_corpus, open_engine, timed_pass, versions
from benchmarks.scale_engine import sources
from engine import threads
from engine.fusion.rrf import reciprocal_rank_fusion
from engine.retrieval.protocol import Query, Within
from engine.search.results import AS_LOADED, SearchOptions
from engine.store.index_dir import latest_dense, read_manifest
from offline.dataset import load_dataset
from offline.evaluation import Run, evaluate_run, paired_test
from offline.latency import percentiles
from offline.records import write_result

DEPTH = 100
RECALL_GOAL = 0.95
# LanceDB's IVF_SQ query settings tried in turn, cheapest first: (nprobes, refine_factor)
LADDER = ((20, None), (40, None), (40, 2), (80, 2), (80, 5), (160, 5), (320, 10))
UNSUPERVISED, SUPERVISED = "unsupervised", "supervised"

Vector = Callable[[np.ndarray], list[str]]


@dataclass
class Lance:
    """One LanceDB table of the corpus with its FTS index and an IVF_SQ index, and the query
    settings that bring the index to the recall goal."""

    table: object
    build_s: dict[str, float]
    nprobes: int = 20
    refine: int | None = None
    ladder: list[dict] = field(default_factory=list)

    def vector(self, exact: bool) -> Vector:
        def search(v: np.ndarray) -> list[str]:
            q = self.table.search(v, vector_column_name="vector").distance_type("dot").select(["doc_id"])
            q = q.bypass_vector_index() if exact else self._tuned(q)
            return q.limit(DEPTH).to_arrow()["doc_id"].to_pylist()

        return search

    def _tuned(self, q):
        q = q.nprobes(self.nprobes)
        return q.refine_factor(self.refine) if self.refine else q

    def text(self, query: str) -> list[str]:
        return (
            self.table.search(query, query_type="fts").select(["doc_id"]).limit(DEPTH).to_arrow()["doc_id"].to_pylist()
        )

    def hybrid(self, exact: bool, encode: Callable[[str], np.ndarray]) -> Callable[[str], list[str]]:
        from lancedb.rerankers import RRFReranker

        def search(query: str) -> list[str]:
            q = self.table.search(query_type="hybrid").vector(encode(query)).text(query).distance_type("dot")
            q = q.bypass_vector_index() if exact else self._tuned(q)
            return q.rerank(RRFReranker()).select(["doc_id"]).limit(DEPTH).to_arrow()["doc_id"].to_pylist()

        return search

    def stats(self) -> dict:
        found = {"rows": self.table.count_rows(), "build_s": self.build_s}
        for index in self.table.list_indices():
            s = self.table.index_stats(index.name)
            found[index.name] = {"type": s.index_type, "indexed": s.num_indexed_rows, "unindexed": s.num_unindexed_rows}
        return found | {"nprobes": self.nprobes, "refine_factor": self.refine, "ladder": self.ladder}


def lance_table(corpus, folder: Path) -> Lance:
    """The table, made once per corpus size in ``folder`` (reused while its row count matches)."""
    import lancedb
    import pyarrow as pa
    from lancedb.index import FTS

    db = lancedb.connect(folder)
    if "chunks" in db.list_tables().tables:
        table = db.open_table("chunks")
        if table.count_rows() == len(corpus.ids) and len(table.list_indices()) == 2:
            return Lance(table, json.loads((folder / "build_s.json").read_text()))
    build_s = {}
    started = time.perf_counter()
    table = None
    for at in range(0, len(corpus.ids), 100_000):  # in slices: one Arrow copy of a million vectors is 1.5 GB more
        part = np.ascontiguousarray(corpus.vectors[at : at + 100_000], dtype=np.float32)
        rows = pa.table(
            {
                "doc_id": corpus.ids[at : at + 100_000],
                "text": corpus.texts[at : at + 100_000],
                "vector": pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), part.shape[1]),
            }
        )
        table = db.create_table("chunks", rows, mode="overwrite") if table is None else table
        if at:
            table.add(rows)
    build_s["rows"] = time.perf_counter() - started
    started = time.perf_counter()
    table.create_index("text", config=FTS())  # its defaults: simple tokenizer, English stemming, stop words
    build_s["fts"] = time.perf_counter() - started
    started = time.perf_counter()
    table.create_index(metric="dot", vector_column_name="vector", index_type="IVF_SQ")
    build_s["ivf_sq"] = time.perf_counter() - started
    (folder / "build_s.json").write_text(json.dumps(build_s))
    return Lance(table, build_s)


def recall(legs: dict[str, Vector], truth: list[set[str]], vectors: list[np.ndarray]) -> dict[str, float]:
    """Each leg's mean share of the exact top ``DEPTH`` (``truth``, a set a vector) it returns."""
    return {
        name: float(np.mean([len(truth[i] & set(leg(v))) / len(truth[i]) for i, v in enumerate(vectors)]))
        for name, leg in legs.items()
    }


def tune(lance: Lance, truth: list[set[str]], vectors: list[np.ndarray]) -> None:
    """The first rung of :data:`LADDER` whose recall@100 reaches :data:`RECALL_GOAL` (the last if none)."""
    for nprobes, refine in LADDER:
        lance.nprobes, lance.refine = nprobes, refine
        started = time.perf_counter()
        got = recall({"ivf_sq": lance.vector(False)}, truth, vectors)["ivf_sq"]
        ms = (time.perf_counter() - started) * 1000 / len(vectors)
        lance.ladder.append({"nprobes": nprobes, "refine_factor": refine, "recall_at_100": got, "ms_per_query": ms})
        print(json.dumps(lance.ladder[-1]), flush=True)
        if got >= RECALL_GOAL:
            return


def faiss_legs(corpus, index_dir: Path, engine) -> tuple[Vector, Vector, dict]:
    """FAISS exact over the corpus's vectors, and the index's own IVF file at its built nprobe."""
    import faiss

    flat = faiss.IndexFlatIP(corpus.vectors.shape[1])
    for at in range(0, len(corpus.ids), 100_000):
        flat.add(np.ascontiguousarray(corpus.vectors[at : at + 100_000], dtype=np.float32))
    ids = np.asarray(corpus.ids)
    ivf = faiss.read_index(str(latest_dense(index_dir).base))
    nprobe = read_manifest(index_dir).settings.get("dense", {}).get("nprobe")
    if nprobe:
        faiss.extract_index_ivf(ivf).nprobe = nprobe
    names = engine.store.unit_map()

    def exact(v: np.ndarray) -> list[str]:
        return ids[flat.search(v.reshape(1, -1), DEPTH)[1][0]].tolist()

    def ours(v: np.ndarray) -> list[str]:
        rows = ivf.search(v.reshape(1, -1), DEPTH)[1][0]
        return list(names.names(rows[rows >= 0]))

    stats = {
        "exact": {"ntotal": flat.ntotal},
        "ivf": {"ntotal": ivf.ntotal, "nprobe": nprobe, "file": latest_dense(index_dir).base.name},
    }
    return exact, ours, stats


def pyserini_peer(index_dir: Path, k1: float, b: float) -> tuple[Peer, dict]:
    """pyserini's own searcher on the index's Lucene folder, its BM25 set to ours."""
    from pyserini.search.lucene import LuceneSearcher

    searcher = LuceneSearcher(str(index_dir / "bm25"))
    searcher.set_bm25(k1, b)

    def search(query: str) -> list[str]:
        return [hit.docid for hit in searcher.search(query, DEPTH)]

    return Peer("pyserini BM25", f"LuceneSearcher on our Lucene folder, k1 {k1}, b {b}", search), {
        "documents": searcher.num_docs
    }


def ours(name: str, engine, choice: SearchOptions, what: str) -> Peer:
    """A whole search through ``HybridEngine.search``, as every door runs it, with ``choice``."""

    def search(query: str) -> list[str]:
        return [hit.doc_id for hit in engine.search(query, DEPTH, options=choice)]

    return Peer(name, what, search)


def fused(
    name: str, what: str, legs: dict[str, Callable[[str], list[str]]], k: float, weights: dict[str, float]
) -> Peer:
    """``legs`` fused by our RRF, ``k`` and ``weights``."""

    def search(query: str) -> list[str]:
        ranked = reciprocal_rank_fusion({leg: run(query) for leg, run in legs.items()}, k=k, weights=weights)
        return [d for d, _ in ranked[:DEPTH]]

    return Peer(name, what, search)


def with_memory(lance: Lance, engine, weights: dict[str, float], what: str) -> Peer:
    """LanceDB's FTS and IVF_SQ legs and our memory's list (one query vector for both), fused as we
    fuse (our k, ``weights`` by leg)."""
    s = engine.settings
    vector = lance.vector(False)

    def search(query: str) -> list[str]:
        v = engine.dense.encode_query(query)
        legs = {
            "bm25": lance.text(query),
            "dense": vector(v[0]),
            "memory": [d for d, _ in engine.memory.retrieve(Query(query, v), s.memory_depth, Within())],
        }
        return [d for d, _ in reciprocal_rank_fusion(legs, k=s.rrf_k, weights=weights)[:DEPTH]]

    return Peer("LanceDB + our memory", what, search)


def rows(args, dataset, texts: list[str]) -> tuple[dict[str, list[Peer]], dict, dict]:
    """The two groups' rows, the vector legs' recall, and what each row's system holds."""
    engine = open_engine(args.index_dir)
    s = engine.settings
    corpus = given_corpus(args.data_dir, args.vectors)

    def encode(query: str) -> np.ndarray:
        return engine.dense.encode_query(query)[0]

    def vector_of(leg: Vector) -> Callable[[str], list[str]]:
        return lambda query: leg(encode(query))

    lance = lance_table(corpus, args.cache / "lancedb")
    exact, ivf, faiss_stats = faiss_legs(corpus, args.index_dir, engine)
    vectors = [encode(t) for t in texts]
    truth = [set(exact(v)) for v in vectors]
    tune(lance, truth, vectors)

    def dense_stage(v: np.ndarray) -> list[str]:
        return [d for d, _ in engine.dense.retrieve(Query("", v.reshape(1, -1)), DEPTH, Within())]

    legs = {"LanceDB exact": lance.vector(True), "LanceDB IVF_SQ": lance.vector(False), "FAISS IVF (our file)": ivf}
    recalls = recall(legs | {"ours dense stage": dense_stage}, truth, vectors)
    bm25s = bm25s_peer(corpus, s.bm25_k1, s.bm25_b, DEPTH)
    pyserini, lucene_stats = pyserini_peer(args.index_dir, s.bm25_k1, s.bm25_b)
    weights = {name: s.retriever(name).weight for name in ("bm25", "dense", "memory")}
    tuned = f"IVF_SQ, nprobes {lance.nprobes}, refine factor {lance.refine}"
    no_memory = {"memory": 0.0}
    groups = {
        UNSUPERVISED: [
            ours(
                "ours RRF k 60",
                engine,
                SearchOptions(method="rrf", rrf_k=60, weights=no_memory),
                "bm25 + dense, RRF k 60, memory weight 0",
            ),
            ours(
                "ours RRF k 10",
                engine,
                SearchOptions(method="rrf", rrf_k=10, weights=no_memory),
                "bm25 + dense, RRF k 10, memory weight 0",
            ),
            Peer("LanceDB hybrid exact", "native FTS + exact dot scan, RRF k 60", lance.hybrid(True, encode)),
            Peer("LanceDB hybrid IVF_SQ", f"native FTS + {tuned}, RRF k 60", lance.hybrid(False, encode)),
            Peer("LanceDB FTS", "native FTS alone (its defaults)", lance.text),
            bm25s,
            pyserini,
            Peer("FAISS exact", "flat inner product over the corpus vectors", vector_of(exact)),
            Peer(
                "FAISS IVF (our file)",
                f"{faiss_stats['ivf']['file']} at nprobe {faiss_stats['ivf']['nprobe']}",
                vector_of(ivf),
            ),
            fused("bm25s + FAISS exact", "RRF k 60", {"bm25": bm25s.search, "dense": vector_of(exact)}, 60, {}),
        ],
        SUPERVISED: [
            ours(
                "ours memory + RRF",
                engine,
                SearchOptions(method="rrf"),
                f"bm25 + dense + memory, RRF k {s.rrf_k}, weights {weights}",
            ),
            ours("ours learned", engine, AS_LOADED, "bm25 + dense + memory, the index's learned fusion (as served)"),
            with_memory(
                lance, engine, weights, f"LanceDB FTS + {tuned} + our memory's list, our RRF k {s.rrf_k} and weights"
            ),
        ],
    }
    held = {
        "chunks": len(corpus.ids),
        "lancedb": lance.stats(),
        "bm25s": {"documents": len(corpus.ids), "build_s": bm25s.build_s},
        "pyserini": lucene_stats,
        "faiss": faiss_stats,
        "ours": {
            "dense": read_manifest(args.index_dir).settings.get("dense"),
            "memory": read_manifest(args.index_dir).memory,
        },
    }
    return groups, recalls, held


def collapsed(run: Run, source: dict[str, str]) -> Run:
    """Each distractor as the abstract it was made from, repeats dropped."""
    return {q: list(dict.fromkeys(source.get(d, d) for d in ranked)) for q, ranked in run.items()}


def measure(groups: dict[str, list[Peer]], queries: dict[str, str], qrels, source: dict[str, str]) -> list[dict]:
    """Each row's quality as ranked and source-collapsed, and its latency, the rows taking turns."""
    peers = [p for group in groups.values() for p in group]
    for peer in peers:
        for text in list(queries.values())[:3]:
            peer.search(text)
    print(f"{len(peers)} rows, {len(queries)} queries, taking turns", flush=True)
    runs, seconds = timed_pass(peers, queries)
    first = groups[UNSUPERVISED][0].name
    found = []
    for group, members in groups.items():
        for peer in members:
            quality, folded = (
                evaluate_run(qrels, runs[peer.name]),
                evaluate_run(qrels, collapsed(runs[peer.name], source)),
            )
            found.append(
                {
                    "group": group,
                    "system": peer.name,
                    "what": peer.what,
                    "nDCG@10": quality["nDCG@10"],
                    "Recall@100": quality["Recall@100"],
                    "nDCG@10 source-collapsed": folded["nDCG@10"],
                    "queries": quality["queries"],
                    "latency_ms": percentiles(seconds[peer.name]),
                    "build_s": peer.build_s,
                    "vs_ours_rrf_k60": paired_test(qrels, runs[peer.name], runs[first]),
                }
            )
            print(
                json.dumps({k: found[-1][k] for k in ("group", "system", "nDCG@10", "nDCG@10 source-collapsed")}),
                flush=True,
            )
    return found


def markdown(report: dict) -> str:
    """The two tables the docs quote."""
    out = []
    for group in (UNSUPERVISED, SUPERVISED):
        out.append(f"**{group}**\n\n| system | nDCG@10 | source-collapsed | R@100 | p50 ms | p95 ms | what runs |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for row in (r for r in report["rows"] if r["group"] == group):
            ms = row["latency_ms"]
            out.append(
                f"| {row['system']} | {row['nDCG@10']:.4f} | {row['nDCG@10 source-collapsed']:.4f}"
                f" | {row['Recall@100']:.3f} | {ms['p50']:.1f} | {ms['p95']:.1f} | {row['what']} |"
            )
        out.append("")
    out.append(
        "vector legs, recall@100 against FAISS exact: "
        + ", ".join(f"{k} {v:.3f}" for k, v in report["recall_at_100"].items())
    )
    return "\n".join(out)


def main() -> None:
    threads.for_queries()  # as `serve` runs
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("LANCEDB_LOG", "error")  # its per-query deprecation lines would be timed too
    parser = options.parser(
        __doc__,
        *options.WHERE,
        split=True,
        num_queries=True,
        output="{machine}/peers-at-size.json",
        help={"index_dir": "the index built with --vectors"},
    )
    parser.add_argument(
        "--cache", type=Path, default=Path("/tmp/peers-at-size"), help="where the LanceDB table is kept"
    )
    parser.add_argument("--vectors", type=Path, help="the .npy `build --vectors` took (default: vectors.npy in --data)")
    args, _ = options.load(parser)
    args.vectors = args.vectors or args.data_dir / "vectors.npy"
    dataset = load_dataset(args.data_dir)
    queries = dataset.split_queries(args.split)
    if args.num_queries:
        queries = dict(list(queries.items())[: args.num_queries])
    groups, recalls, held = rows(args, dataset, list(queries.values()))
    found = measure(groups, queries, dataset.qrels(args.split), sources(args.data_dir))
    report = {
        "split": args.split,
        "depth": DEPTH,
        "recall_at_100": recalls,
        "held": held,
        "rows": found,
        "versions": versions(),
    }
    out = write_result(args.output, report, vars(args))
    print(markdown(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
