"""Issue 64's figures on NFCorpus: operator filters against the unfiltered ranking post-filtered,
pages against one longer list (also with writes between pages), grouped replies' distinct
documents, highlights at their offsets and their cost for the top 5, and what a filter costs a
search (its one more unfiltered pass of the retrievers).

    python -m benchmarks.issue64 [--queries 50]

Works on a copy of the index with made-up metadata (NFCorpus holds only a url): each document a
``year`` (1990-2024), a ``document_type`` of four and a ``source`` list, from its id's hash,
written to the copy's store and its metadata index. Searches run in-process without the reranker
(the fused order; CPU reranks 20, so a top 50 would rerank a longer head than its pages) except
the highlight timing, which times the highlight step alone. Writes
``benchmarks/results/<machine>/issue64.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from engine.documents import DocumentIn, FacetRequest, SearchFilters, SearchRequest
from engine.search import answers
from engine.settings import EngineSettings
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result

KINDS = ["review", "guideline", "trial", "note"]
PARTS = ("filters", "facets", "pages", "groups", "highlights", "filter_cost")


def _made_up(document_id: str) -> dict:
    h = int(hashlib.sha256(document_id.encode()).hexdigest(), 16)
    sources = ["pubmed", "web", "book"]
    return {"year": 1990 + h % 35, "document_type": KINDS[h // 35 % 4], "source": sources[h // 140 % 3 :][:2]}


def _dress(index: Path) -> None:
    """Made-up metadata in the copy's store, its chunk_fields rewritten (as ``compact`` fills them)."""
    from engine.store.docstore import DocStore
    from engine.store.index_dir import DOCS_FILE

    store = DocStore(index / DOCS_FILE)
    conn = store._conn()
    rows = conn.execute("SELECT document_id, metadata FROM documents").fetchall()
    conn.execute("BEGIN")
    for document_id, metadata in rows:
        conn.execute(
            "UPDATE documents SET metadata = ? WHERE document_id = ?",
            (json.dumps(json.loads(metadata) | _made_up(document_id)), document_id),
        )
    conn.execute("DELETE FROM chunk_fields")
    conn.execute("DELETE FROM meta WHERE key = 'fields_indexed'")
    conn.execute("COMMIT")
    store.index_fields()
    store.close()


def _predicate(rng: random.Random, depth: int = 0) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.35:
        op = rng.choice(["and", "or", "not"])
        return {"not": _predicate(rng, depth + 1)} if op == "not" else {op: [_predicate(rng, depth + 1) for _ in "ab"]}
    leaf = rng.randrange(5)
    if leaf == 0:
        low = rng.randrange(1990, 2020)
        return {"year": {"gte": low, "lt": low + rng.randint(2, 10)}}
    if leaf == 1:
        return {"year": {rng.choice(["gt", "lte"]): rng.randrange(1992, 2022)}}
    if leaf == 2:
        return {"document_type": {"in": rng.sample(KINDS, rng.randint(1, 3))}}
    if leaf == 3:
        return {"source": {"not_in": [rng.choice(["pubmed", "web", "book"])]}}
    return {"not": {"document_type": rng.choice(KINDS)}}


def _options(engine, query: str, top_k: int, **asked):
    request = SearchRequest(query=query, top_k=top_k, **asked)
    return request, engine.options_for(request)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    p.add_argument("--data-dir", type=Path, default=Path("../shared/datasets/nfcorpus"))
    p.add_argument("--queries", type=int, default=50)
    p.add_argument("--output", type=Path, default=Path(f"benchmarks/results/{machine_name()}/issue64.json"))
    p.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)} (the others kept)")
    args = p.parse_args(argv)
    from engine.search import HybridEngine

    rng = random.Random(64)
    queries = list(load_dataset(args.data_dir).split_queries("dev").values())
    queries = rng.sample(queries, min(args.queries, len(queries)))
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "nfcorpus"
        shutil.copytree(args.index_dir, index)
        _dress(index)
        settings = EngineSettings(index_dir=index, device="cpu", rerank=False)
        engine = HybridEngine(settings, writable=True)
        try:
            parts = {
                "filters": lambda: _filters(engine, queries, rng),
                "facets": lambda: _facets(engine),
                "pages": lambda: _pages(engine, queries[:20]),
                "groups": lambda: _groups(engine, queries),
                "highlights": lambda: _highlights(engine, queries),
                "filter_cost": lambda: _filter_cost(engine, queries),
            }
            result = {name: parts[name]() for name in args.parts.split(",")}
        finally:
            engine.close()
    write_result(args.output, result, {"queries": len(queries), "index": str(args.index_dir)}, update=True)
    print(json.dumps(result, indent=1))


def _filters(engine, queries: list[str], rng: random.Random) -> dict:
    """50 predicates, each with a dev query: the filtered top 10 against the unfiltered candidates
    post-filtered (the fused order), in order and as sets (the prefix they hold, where they hold
    fewer than 10 allowed chunks)."""
    same_order = same_set = matched = short = 0
    for i in range(50):
        raw, query = _predicate(rng), queries[i % len(queries)]
        filters = SearchFilters.model_validate(raw)
        allowed = engine.store.matching(filters)
        matched += len(allowed)
        filtered = [h.doc_id for h in engine.search(query, 10, filters)]
        whole = [d for d, _ in engine.stages(query, 10).ranked if d in allowed][:10]
        short += len(whole) < 10  # the unfiltered candidates hold fewer: the filtered search goes deeper
        same_order += filtered[: len(whole)] == whole
        same_set += set(filtered[: len(whole)]) == set(whole)
    return {
        "predicates": 50,
        "same_order": same_order,
        "same_set": same_set,
        "unfiltered_candidates_fewer_than_10": short,
        "mean_matched_chunks": matched / 50,
    }


def _filter_cost(engine, queries: list[str]) -> dict:
    """Filtered against unfiltered stages, query by query in turn after the served warm-up: a filter
    every chunk passes and one passing about a ninth (years 2021-2024 of 1990-2024), p50/p95 of the
    whole and of the fusion lap, which holds a filtered search's one more unfiltered pass."""
    engine.warm_up(engine.settings.warmup_searches)
    asked = {
        "unfiltered": None,
        "every chunk": SearchFilters.model_validate({"year": {"gte": 1990}}),
        "a ninth": SearchFilters.model_validate({"year": {"gte": 2021}}),
    }
    total, fusion = {name: [] for name in asked}, {name: [] for name in asked}
    for query in queries:
        for name, filters in asked.items():
            started = time.perf_counter()
            result = engine.stages(query, 10, filters=filters)
            total[name].append(time.perf_counter() - started)
            fusion[name].append(result.seconds["fusion"])
    return {name: {"ms": percentiles(total[name]), "fusion_ms": percentiles(fusion[name])} for name in asked}


def _facets(engine) -> dict:
    """Every key's facets, chunks and documents, against a count over the store's rows, before and
    after 20 documents are written and 5 deleted."""
    from collections import Counter

    def counted(key: str) -> tuple[dict, dict]:
        read = "SELECT c.document_id, d.metadata FROM chunks c JOIN documents d USING (document_id)"
        rows = engine.store._conn().execute(read)
        chunks, documents = Counter(), {}
        for document, metadata in rows:
            value = json.loads(metadata).get(key)
            for v in value if isinstance(value, list) else [] if value is None else [value]:
                chunks[v] += 1
                documents.setdefault(v, set()).add(document)
        return dict(chunks), {v: len(d) for v, d in documents.items()}

    keys, checks, equal, seconds = ["year", "document_type", "source", "url"], 0, 0, []
    for round_ in range(2):
        for key in keys:
            for count in ("chunks", "documents"):
                started = time.perf_counter()
                found = dict(engine.facets(FacetRequest(key=key, count=count, size=1000)))
                seconds.append(time.perf_counter() - started)
                truth = counted(key)[count == "documents"]
                if key == "url":  # 3633 values: the top 1000 of them
                    truth = {v: n for v, n in truth.items() if v in found}
                checks, equal = checks + 1, equal + (found == truth)
        for i in range(20):
            chunks = [{"chunk_id": "c", "content": f"kale note {i}"}]
            doc = {"document_id": f"facet{i}", "metadata": _made_up(f"facet{i}"), "chunks": chunks}
            engine.live.upsert(DocumentIn.model_validate(doc))
        for document_id in list(engine.store._conn().execute("SELECT document_id FROM documents LIMIT 5")):
            engine.live.delete(document_id[0])
        engine.live.refresh()
    return {"checks": checks, "equal": equal, "ms": percentiles(seconds)}


def _pages(engine, queries: list[str]) -> dict:
    """Pages 1-5 of 10 against one top 50, then again with a document written between pages."""
    counts = {"queries": len(queries), "equal": 0, "equal_with_writes": 0, "duplicates": 0, "gaps": 0}
    for n, query in enumerate(queries):
        whole = [h.doc_id for h in engine.search(query, 50)]
        for writes in (False, True):
            served, token = [], None
            for page in range(5):
                request, options = _options(engine, query, 10, paginate=True, page_token=token)
                hits = engine.search(query, 10, options=options)
                served += [h.doc_id for h in hits]
                token = hits.next_page_token
                if writes:  # a copy of the query's best hit under a new id: it would rank first now
                    best = engine.store.chunks([whole[0]])[whole[0]]
                    doc = {"document_id": f"w{n}-{page}", "chunks": [{"chunk_id": "c", "content": best.contents}]}
                    engine.live.upsert(DocumentIn.model_validate(doc), wait=True)
            counts["equal_with_writes" if writes else "equal"] += served == whole
            counts["duplicates"] += len(served) - len(set(served))
            counts["gaps"] += len(set(whole) - set(served))
    return counts


def _groups(engine, queries: list[str]) -> dict:
    distinct = []
    for query in queries:
        request, options = _options(engine, query, 10, group_by="document_id", group_size=2)
        distinct.append(len({h.document_id for h in engine.search(query, 10, options=options)}))
    return {"top_k": 10, "min_distinct_documents": min(distinct), "queries": len(queries)}


def _highlights(engine, queries: list[str]) -> dict:
    """The highlight step for the top 5 (encoding their sentences, scoring, offsets), timed alone."""
    from engine.search.highlights import SentenceVectors, highlights

    seconds, sentences, exact = [], [], True
    for query in queries:
        result = engine.stages(query, 5)
        hits = answers.hits(engine, result, 5)
        texts = [h.text for h in hits]
        started = time.perf_counter()
        found = highlights(SentenceVectors(), engine.dense.query_encoder, result.query_vector, texts, 2)  # cold
        seconds.append(time.perf_counter() - started)
        exact &= all(t[x.start : x.end] == x.text for t, best in zip(texts, found, strict=True) for x in best)
        from engine.search.highlights import spans

        sentences.append(sum(len(spans(t)) for t in texts))
    return {
        "top_k": 5,
        "sentences": 2,
        "offsets_exact": exact,
        "sentences_encoded_mean": sum(sentences) / len(sentences),
        "ms": percentiles(seconds),
        "model": f"the index's bi-encoder (all-MiniLM-L6-v2) as the query encoder serves it"
        f" ({engine.dense.query_encoder.runtime}), cosine with the query's vector",
    }


if __name__ == "__main__":
    main()
