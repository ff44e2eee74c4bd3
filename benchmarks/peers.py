"""Peers side by side: LanceDB's hybrid search and bm25s beside our engine, in one process, on the same
NFCorpus chunks, the same MiniLM document vectors and the same dev queries.

Rows (each answers a query with its top 10 document ids; nDCG@10 on the split's judgments):

- ``LanceDB hybrid``: a LanceDB table of our chunks with LanceDB's native full-text (BM25) index and
  the vectors read from our index's FAISS file; full-text + vector legs fused by LanceDB's default
  hybrid reranker (``RRFReranker``, k 60). The query is encoded by our engine's encoder, and that
  time is in its latency as it is in ours.
- ``bm25s BM25``: bm25s with its tokenizer set as close to our Lucene analyzer as it goes (Porter
  stemmer, Lucene's English stop words, one-character tokens kept) and our k1 and b.
- ``ours BM25 stage``: our Lucene BM25 alone (``engine.bm25.retrieve``).
- ``ours without judgments``: an index built from the corpus and queries only (no qrels), so BM25 +
  dense fused by RRF; built once with ``hybrid-search build`` into ``--cache`` and reused.
- ``ours supervised``: the normal index (judgment memory and learned fusion), reranker off.

Latency p50/p99 come from one pass in which the rows take turns query by query (the order rotating),
so whatever else the machine does weighs on every row alike; queries/s from a thread pool of 1 and
of 8 clients issuing the same query list.

    python -m benchmarks.peers --index-dir indexes/nfcorpus --cache indexes/peers

At size (``--vectors``: the file ``build --vectors`` took, one row a corpus record): LanceDB reads
those vectors (an inverted file's codes are not the vectors), and the rows are LanceDB hybrid with an
exact scan and with its IVF_PQ index, and ours supervised and with RRF on the same index; bm25s and
the index built without judgments are left out (a second build at that size).

    python -m benchmarks.peers --index-dir /tmp/hs-scale/index-1000000 --data /tmp/hs-scale/corpus-1000000 \
        --vectors /tmp/hs-scale/corpus-1000000/vectors.npy --cache /tmp/hs-peers --num-queries 100 --no-qps
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import options
from engine import threads
from engine.retrieval.protocol import Query, Within
from engine.settings import EngineSettings
from engine.store.index_dir import MANIFEST_FILE, latest_dense, read_manifest
from offline.dataset import fingerprint, load_dataset
from offline.evaluation import Qrels, Run, evaluate_run, paired_test, sample_queries
from offline.latency import percentiles
from offline.records import write_result

TOP_K = 10
CONCURRENCY = (1, 8)
WARM_UP = 5
BM25S_TOKENS = r"(?u)\b\w+\b"  # Lucene's StandardTokenizer keeps one-character tokens; bm25s's default drops them

Search = Callable[[str], list[str]]


@dataclass
class Peer:
    """One row of the table: what it runs, and a thread-safe search returning top document ids."""

    name: str
    what: str
    search: Search
    build_s: float | None = None


@dataclass
class Corpus:
    """Our index's chunks as the peers index them: ids, the text our BM25 reads, our dense vectors."""

    ids: list[str]
    texts: list[str]
    vectors: np.ndarray


def read_corpus(index_dir: Path, engine) -> Corpus:
    """The vectors come from the index's FAISS file itself, so LanceDB scans exactly the document
    vectors our dense stage does; rows are named and their texts read through our document store."""
    import faiss

    index = faiss.read_index(str(latest_dense(index_dir).base))
    rows = faiss.vector_to_array(index.id_map)
    base = faiss.downcast_index(index.index)
    vectors = base.reconstruct_n(0, base.ntotal)
    ids = engine.store.unit_map().names(rows)
    chunks = engine.store.chunks(ids)
    return Corpus(ids, [chunks[i].contents for i in ids], np.ascontiguousarray(vectors, dtype=np.float32))


def given_corpus(data_dir: Path, vectors: Path) -> Corpus:
    """The dataset's records as ``build --vectors`` indexed them (one chunk a record: its title and
    text), with the vectors it was given, memory-mapped."""
    from engine.text import chunk_text

    docs = list(load_dataset(data_dir).corpus.values())
    array = np.load(vectors, mmap_mode="r")
    if array.shape[0] != len(docs):
        raise SystemExit(f"{vectors}: {array.shape[0]:,} vectors for {len(docs):,} records in {data_dir}")
    return Corpus([d.doc_id for d in docs], [chunk_text(d.title, d.text) for d in docs], array)


def no_judgments_index(data: Path, cache: Path) -> Path:
    """An index of the corpus built without judgments (so no memory, no learned fusion: RRF), made
    by ``hybrid-search build`` from a folder holding only the corpus and the queries; reused while
    its manifest's fingerprint matches the corpus."""
    folder, index_dir = cache / "no-judgments-data", cache / "no-judgments"
    if (index_dir / MANIFEST_FILE).is_file() and read_manifest(index_dir).fingerprint == fingerprint(data):
        return index_dir
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("corpus.jsonl", "queries.jsonl"):
        link = folder / name
        link.unlink(missing_ok=True)
        link.symlink_to((data / name).resolve())
    command = [sys.executable, "-m", "cli.main", "build", "--data", str(folder), "--index-dir", str(index_dir)]
    print("building the index without judgments:", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return index_dir


def lancedb_peer(
    corpus: Corpus, folder: Path, encode: Callable[[str], np.ndarray], depth: int, ivf_pq: bool = False
) -> Peer:
    """LanceDB's hybrid query as its docs show it: ``.vector(v).text(q)`` with the default RRF reranker.
    Each leg fetches ``depth`` candidates (``limit``), as many as our BM25 and dense stages fuse;
    ``ivf_pq``: the vector leg through LanceDB's IVF_PQ index (its defaults), not a scan."""
    import lancedb
    import pyarrow as pa
    from lancedb.index import FTS
    from lancedb.rerankers import RRFReranker

    started = time.perf_counter()
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(corpus.vectors.reshape(-1)), corpus.vectors.shape[1])
    rows = pa.table({"doc_id": corpus.ids, "text": corpus.texts, "vector": vectors})
    table = lancedb.connect(folder).create_table("chunks", rows, mode="overwrite")
    table.create_index("text", config=FTS())  # native FTS; its defaults: simple tokenizer, English stemming, stop words
    if ivf_pq:
        table.create_index(metric="dot", vector_column_name="vector", index_type="IVF_PQ")
    build_s = time.perf_counter() - started

    def search(query: str) -> list[str]:
        hybrid = table.search(query_type="hybrid").vector(encode(query)).text(query).distance_type("dot")
        found = hybrid.rerank(RRFReranker()).select(["doc_id"]).limit(depth).to_arrow()
        return found["doc_id"].to_pylist()[:TOP_K]

    leg = "IVF_PQ index (LanceDB's defaults)" if ivf_pq else "exact dot-product scan"
    what = f"native FTS + {leg}, {depth} each, RRF k 60; query encoded by our encoder"
    return Peer("LanceDB hybrid" + (" IVF_PQ" if ivf_pq else ""), what, search, build_s)


def bm25s_peer(corpus: Corpus, k1: float, b: float, depth: int = TOP_K) -> Peer:
    """bm25s scores with our k1 and b (``lucene`` variant), its top ``depth``; queries are tokenized
    by the same rules as the corpus, and tokens the corpus lacks are dropped by bm25s itself."""
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("porter")  # Anserini's DefaultEnglishAnalyzer stems with Porter

    def tokenize(texts: list[str], return_ids: bool):
        return bm25s.tokenize(
            texts,
            token_pattern=BM25S_TOKENS,
            stopwords="en",
            stemmer=stemmer,
            return_ids=return_ids,
            show_progress=False,
        )

    started = time.perf_counter()
    retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
    retriever.index(tokenize(corpus.texts, True), show_progress=False)
    build_s = time.perf_counter() - started
    ids = np.asarray(corpus.ids)

    def search(query: str) -> list[str]:
        found, _ = retriever.retrieve(tokenize([query], False), k=depth, show_progress=False)
        return ids[found[0]].tolist()

    what = f"k1 {k1}, b {b}; Porter stemmer, Lucene's English stop words"
    return Peer("bm25s BM25", what, search, build_s)


def bm25_stage_peer(engine) -> Peer:
    """Our BM25 stage alone: Lucene through Anserini's analyzer, as the engine runs it."""
    s = engine.settings

    def search(query: str) -> list[str]:
        return [d for d, _ in engine.bm25.retrieve(Query(query, None), TOP_K, Within())]

    return Peer("ours BM25 stage", f"Lucene (Anserini analyzer), k1 {s.bm25_k1}, b {s.bm25_b}", search)


def engine_peer(name: str, engine) -> Peer:
    """A whole search as every door runs it (``HybridEngine.search``: stages, fusion, hits with text)."""

    def search(query: str) -> list[str]:
        return [hit.doc_id for hit in engine.search(query, TOP_K)]

    described = engine.describe()
    return Peer(name, f"{' + '.join(described['stages'])}, {described['fusion']}, no reranker", search)


def rotated(peers: Sequence[Peer], turn: int) -> list[Peer]:
    """The peers starting at ``turn``: each goes first as often as the others."""
    shift = turn % len(peers)
    return [*peers[shift:], *peers[:shift]]


def timed_pass(peers: Sequence[Peer], queries: dict[str, str]) -> tuple[dict[str, Run], dict[str, list[float]]]:
    """Every peer's ranking and seconds for each query, the peers taking turns query by query."""
    runs: dict[str, Run] = {p.name: {} for p in peers}
    seconds: dict[str, list[float]] = {p.name: [] for p in peers}
    for turn, (qid, text) in enumerate(queries.items()):
        for peer in rotated(peers, turn):
            started = time.perf_counter()
            runs[peer.name][qid] = peer.search(text)
            seconds[peer.name].append(time.perf_counter() - started)
    return runs, seconds


def queries_per_second(peer: Peer, queries: list[str], clients: int) -> float:
    """The query list through a pool of ``clients`` threads, each taking the next query when free."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(peer.search, queries))
    return len(queries) / (time.perf_counter() - started)


def measure(
    peers: Sequence[Peer], queries: dict[str, str], qrels: Qrels, concurrency: Sequence[int] = CONCURRENCY
) -> list[dict]:
    """One row per peer: quality of its rankings, latency, queries/s at each ``concurrency``; each
    row's nDCG@10 tested against the first peer's (paired t-test over the queries)."""
    texts = list(queries.values())
    for peer in peers:
        for text in texts[:WARM_UP]:
            peer.search(text)
    runs, seconds = timed_pass(peers, queries)
    rows = []
    for peer in peers:
        quality = evaluate_run(qrels, runs[peer.name])
        latency = percentiles(seconds[peer.name])
        qps = {str(c): queries_per_second(peer, texts, c) for c in concurrency}
        rows.append(
            {
                "system": peer.name,
                "what": peer.what,
                "nDCG@10": quality["nDCG@10"],
                "nDCG@5": quality["nDCG@5"],
                "MRR@10": quality["MRR@10"],
                "queries": quality["queries"],
                "latency_ms": latency,
                "qps": qps,
                "build_s": peer.build_s,
                "vs_first": paired_test(qrels, runs[peer.name], runs[peers[0].name]),
            }
        )
        print(json.dumps({k: rows[-1][k] for k in ("system", "nDCG@10", "qps")}), flush=True)
    return rows


def markdown(report: dict) -> str:
    """The table the docs quote: one row per system."""
    clients = " | ".join(f"q/s, {c} client{'s' * (c > 1)}" for c in CONCURRENCY)
    head = f"| system | nDCG@10 | p50 ms | p99 ms | {clients} | what runs |\n"
    head += "| --- | --- | --- | --- |" + " --- |" * len(CONCURRENCY) + " --- |\n"
    lines = []
    for row in report["rows"]:
        qps = " | ".join(f"{row['qps'].get(str(c), float('nan')):.1f}" for c in CONCURRENCY)
        ms = row["latency_ms"]
        lines.append(
            f"| {row['system']} | {row['nDCG@10']:.4f} | {ms['p50']:.1f} | {ms['p99']:.1f} | {qps} | {row['what']} |"
        )
    return head + "\n".join(lines)


def open_engine(index_dir: Path, fusion: str = "auto"):
    """Our engine on the CPU, reranker off: the peers rerank nothing either."""
    from engine.search import HybridEngine

    return HybridEngine(EngineSettings(index_dir=index_dir, rerank=False, device="cpu", fusion=fusion))


def build_peers(args: argparse.Namespace) -> tuple[list[Peer], Callable[[str], np.ndarray], dict]:
    """The five rows, LanceDB first (the one every row's paired test is against), the query encoder
    the hybrid rows share, and what they read."""
    supervised = open_engine(args.index_dir)

    def encode(query: str) -> np.ndarray:
        return supervised.dense.encode_query(query)[0]

    if args.vectors is not None:  # at size: the given vectors; two LanceDB rows, two of ours on one index
        corpus = given_corpus(args.data_dir, args.vectors)
        peers = [
            lancedb_peer(corpus, args.cache / "lancedb", encode, args.depth),
            lancedb_peer(corpus, args.cache / "lancedb-ivf-pq", encode, args.depth, ivf_pq=True),
            engine_peer("ours RRF", open_engine(args.index_dir, "rrf")),
            engine_peer("ours supervised", supervised),
        ]
    else:
        plain = open_engine(no_judgments_index(args.data_dir, args.cache.resolve()))
        corpus = read_corpus(args.index_dir, supervised)
        s = supervised.settings
        peers = [
            lancedb_peer(corpus, args.cache / "lancedb", encode, args.depth),
            bm25s_peer(corpus, s.bm25_k1, s.bm25_b),
            bm25_stage_peer(supervised),
            engine_peer("ours without judgments", plain),
            engine_peer("ours supervised", supervised),
        ]
    encoder = supervised.manifest.encoder
    inputs = {"chunks": len(corpus.ids), "dimension": int(corpus.vectors.shape[1]), "encoder": encoder}
    return peers, encode, inputs


def encoding_latency(encode: Callable[[str], np.ndarray], queries: list[str]) -> dict[str, float]:
    """The query encoder alone, which LanceDB's row and our two hybrid rows all include: the rest of
    their latency is the search itself."""
    seconds = []
    for query in queries:
        started = time.perf_counter()
        encode(query)
        seconds.append(time.perf_counter() - started)
    return percentiles(seconds)


def versions() -> dict[str, str]:
    """The peers' package versions: their defaults (tokenizers, the reranker's k) change between releases."""
    from importlib.metadata import version

    return {name: version(name) for name in ("lancedb", "bm25s", "PyStemmer", "pyarrow")}


def main() -> None:
    threads.for_queries()  # as `serve` runs
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # LanceDB's Rust core logs two deprecation warnings per hybrid query (scores it will stop adding to the
    # selected columns) to stderr: thousands of lines, and writing them would be counted in its latency
    os.environ.setdefault("LANCEDB_LOG", "error")
    named = {"index_dir": "the supervised index"}
    parser = options.parser(
        __doc__, *options.WHERE, split=True, num_queries=True, output="{machine}/peers.json", help=named
    )
    parser.add_argument("--cache", type=Path, default=Path("indexes/peers"), help="the no-judgments index, LanceDB")
    parser.add_argument("--depth", type=int, default=100, help="candidates each LanceDB leg fetches (default 100)")
    parser.add_argument(
        "--vectors", type=Path, help="at size: the .npy `build --vectors` took, which LanceDB reads (module doc)"
    )
    parser.add_argument("--qps", action=argparse.BooleanOptionalAction, default=True, help="time queries/s too")
    args, _ = options.load(parser)
    dataset = load_dataset(args.data_dir)
    queries = sample_queries(dataset.split_queries(args.split), args.num_queries, 42)
    peers, encode, inputs = build_peers(args)
    rows = measure(peers, queries, dataset.qrels(args.split), CONCURRENCY if args.qps else ())
    inputs["query_encoding_ms"] = encoding_latency(encode, list(queries.values()))
    report = {"split": args.split, "top_k": TOP_K, "concurrency": list(CONCURRENCY), **inputs}
    report |= {"paired_tests_against": peers[0].name, "rows": rows}
    report["versions"] = versions()
    out = write_result(args.output, report, vars(args))
    print(markdown(report))
    print(f"query encoding alone (in LanceDB's and our hybrid rows): p50 {inputs['query_encoding_ms']['p50']:.1f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
