"""Day one on a corpus without judgments: learn from the documents, serve it only when it pays.

``adapt_index`` (run by `build --adapt fast`, the default for a corpus without training judgments,
and by `hybrid-search adapt` on an index that grew since) does four things:

1. makes pseudo-queries from the chunks (:mod:`index_build.adapt.pseudo`: headings, first
   sentences, inner sentences), each taken out of its own chunk in a **held-out view** of the
   corpus: a BM25 index and the dense vectors rebuilt with those chunks' text minus the query;
   with a chat server (``--llm-url``), questions it writes for other chunks too
   (:mod:`index_build.adapt.generated`);
2. makes the corpus graph of the view (each chunk's nearest chunks by the dense vectors);
3. fits the graph's neighbours and weight (:class:`engine.fusion.graph.CorpusGraph`) on one half of
   the pseudo-queries, RRF's nDCG@10 beside each;
4. checks the fitted stage on the other half against RRF: it is served only when it beats RRF there
   by more than ``adapt_min_gain``; otherwise the index serves RRF and says why.

Everything goes in ``<index>/adapt/adapt.json`` (the pseudo-query sets with examples, every
candidate's fit score, the check, the decision) with the served graph beside it; the folder is
written aside and renamed into place, so an interrupted adaptation leaves the index as it was.
Why the corpus graph and not a fusion fitted on pseudo-queries, pseudo-relevance feedback, or a
model trained on pseudo-queries: docs/experiments.md, "Day one without judgments".
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.fusion.graph import CARD_FILE, CorpusGraph
from engine.fusion.rrf import reciprocal_rank_fusion
from engine.retrieval.dense import encode
from engine.retrieval.lucene import LuceneIndex
from engine.settings import EngineSettings
from engine.store.index_dir import ADAPT_DIR, FUSION_DIR
from index_build.adapt.generated import QueryWriter
from index_build.adapt.pseudo import KINDS, PseudoQuery, pseudo_queries, relevant
from index_build.settings import BuildSettings
from offline.evaluation import evaluate_run, paired_test
from offline.progress import track

log = logging.getLogger(__name__)
NEIGHBOURS = (5, 10)  # the graph's candidates: neighbours per chunk...
WEIGHTS = (0.1, 0.2, 0.3)  # ...and the share of their scores
MIN_CHECK = 20  # pseudo-queries the check needs to decide anything
FULL_MISSING = (
    "--adapt full (a cross-encoder or the dense encoder trained on pseudo-queries) is not implemented: a"
    " cross-encoder trained on titles against their abstracts scored below RRF on NFCorpus (docs/experiments.md,"
    " 'Day one without judgments'); use --adapt fast"
)


class AdaptError(ValueError):
    """An adaptation that cannot run as asked."""


def adapt_index(
    settings: EngineSettings, build: BuildSettings, progress: bool = True, writer: QueryWriter | None = None
) -> dict:
    """Adapt the index in ``settings.index_dir`` (see the module); returns the card it wrote.
    ``writer``: a chat server's questions join the pseudo-queries (probe it before long work)."""
    from engine.search import HybridEngine

    if build.adapt == "full":
        raise AdaptError(FULL_MISSING)
    if build.adapt == "none":
        raise AdaptError("--adapt none: nothing to adapt")
    started = time.perf_counter()
    index_dir = Path(settings.index_dir)
    plain = {
        "memory": False,
        "fusion": "rrf",
        "rerank": False,
        "adapted": False,
        "query_encoder_runtime": "torch",
        "query_encoder_quantize": "none",
    }
    engine = HybridEngine(settings.model_copy(update=plain))
    try:
        if engine.memory is not None or (index_dir / FUSION_DIR).is_dir():
            raise AdaptError(f"{index_dir} learned from judgments; adaptation is for an index without them")
        card = _adapt(engine, settings, build, progress, writer)
    finally:
        engine.close()
    card["seconds"] = round(time.perf_counter() - started, 1)
    _write(index_dir, card, card.pop("_graph"))
    log.info("adapted %s in %.0f s: %s", index_dir, card["seconds"], card["decision"])
    return card


def _adapt(engine, settings: EngineSettings, build: BuildSettings, progress: bool, writer: QueryWriter | None) -> dict:
    rows, vectors = engine.dense.vectors()
    units = [engine.dense.units[int(r)] for r in rows]
    chunks = engine.store.chunks(units)
    ordered = [chunks[u] for u in units]
    queries = pseudo_queries(ordered, build.adapt_queries)
    generation = None
    if writer is not None:
        used = {q.unit_id for q in queries}
        generated, generation = writer.write(ordered, build.adapt_generated, exclude=used, progress=progress)
        queries += generated
    card: dict = {"mode": build.adapt, "chunks": len(units), "pseudo_queries": _sets(queries)}
    if generation is not None:
        card["generation"] = generation
    named = {f"q{i}": q for i, q in enumerate(queries)}  # in blocks of a kind: halves hold half of each
    fit, check = list(named)[0::2], list(named)[1::2]
    if len(check) < MIN_CHECK:
        card.update(served=False, decision=f"RRF served: {len(queries)} pseudo-queries, too few to check a change")
        card["_graph"] = None
        return card
    by_document: dict[str, list] = {}
    for chunk in ordered:
        by_document.setdefault(chunk.document_id, []).append(chunk)
    qrels = {name: relevant(q, by_document[chunks[q.unit_id].document_id]) for name, q in named.items()}
    view = HeldOutView(engine, settings, units, vectors, queries, progress)
    try:
        neighbours, similarities = nearest(view.vectors, max(NEIGHBOURS))
        fused = view.rrf_runs(named, progress)
    finally:
        view.close()
    row_of = {u: i for i, u in enumerate(units)}  # the view's rows are the vectors' positions

    def run(part: list[str], k: int | None = None, weight: float = 0.0) -> dict[str, list[str]]:
        if k is None:
            return {name: [u for u, _ in fused[name]] for name in part}
        graph = CorpusGraph(neighbours[:, :k], similarities[:, :k], weight)
        return {name: [u for u, _ in graph.rerank(fused[name], row_of)] for name in part}

    def judged(part: list[str]) -> dict:
        return {name: qrels[name] for name in part}

    scores = {"rrf": _ndcg(judged(fit), run(fit))}
    for k in NEIGHBOURS:
        for weight in WEIGHTS:
            scores[f"graph k={k} weight={weight}"] = _ndcg(judged(fit), run(fit, k, weight))
    fitted = [(k, w) for k in NEIGHBOURS for w in WEIGHTS]
    k, weight = max(fitted, key=lambda kw: scores[f"graph k={kw[0]} weight={kw[1]}"])
    baseline, adapted = run(check), run(check, k, weight)
    test = paired_test(judged(check), adapted, baseline)
    per_kind = {}
    for kind in KINDS:
        part = [name for name in check if named[name].kind == kind]
        if part:
            per_kind[kind] = {
                "queries": len(part),
                "rrf": _ndcg(judged(part), {name: baseline[name] for name in part}),
                "adapted": _ndcg(judged(part), {name: adapted[name] for name in part}),
            }
    gain = round(test["gain"], 4)
    served = gain > build.adapt_min_gain
    card.update(
        method="corpus-graph",
        neighbours=k,
        weight=weight,
        fit={"queries": len(fit), "nDCG@10": scores},
        heldout={
            "queries": len(check),
            "rrf": _ndcg(judged(check), baseline),
            "adapted": _ndcg(judged(check), adapted),
            "gain": gain,
            "p_value": round(test["p_value"], 4),
            "by_kind": per_kind,
        },
        served=served,
        decision=(
            f"corpus graph served ({k} neighbours, weight {weight}): {gain:+.4f} nDCG@10 over RRF on"
            f" {len(check)} held-out pseudo-queries (p = {test['p_value']:.3g}; min gain {build.adapt_min_gain})"
            if served
            else f"RRF served: the corpus graph's {gain:+.4f} nDCG@10 on {len(check)} held-out pseudo-queries"
            f" is not above {build.adapt_min_gain}"
        ),
    )
    card["_graph"] = _served_graph(rows, vectors, k, weight) if served else None
    return card


def _ndcg(qrels: dict, run: dict) -> float:
    return round(evaluate_run(qrels, run)["nDCG@10"], 4)


def _sets(queries: list[PseudoQuery]) -> dict:
    return {
        kind: {
            "count": sum(q.kind == kind for q in queries),
            "examples": [q.text for q in queries if q.kind == kind][:3],
        }
        for kind in KINDS
        if kind != "generated" or any(q.kind == kind for q in queries)
    }


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
            bm25 = [u for u, _ in self.bm25.search(q.text, s.bm25_depth)]
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


EXACT_UP_TO = 50_000  # chunks whose graph is found by an exact scan; past it, by HNSW


def nearest(vectors: np.ndarray, k: int, exact_up_to: int = EXACT_UP_TO) -> tuple[np.ndarray, np.ndarray]:
    """Each vector's ``k`` nearest others by inner product (positions, best first) and their scores.
    Up to ``exact_up_to`` vectors exactly, by a FAISS flat scan (quadratic: ~10 s for 3,633 chunks on 2
    cores, hours for millions); past it by an HNSW graph of the vectors, whose build and searches grow
    as N log N, for a few neighbours missed."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    k = min(k, len(vectors) - 1)
    if len(vectors) <= exact_up_to:
        index = faiss.IndexFlatIP(vectors.shape[1])
    else:
        index = faiss.IndexHNSWFlat(vectors.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.hnsw.efSearch = max(64, 4 * k)
    index.add(vectors)
    scores, found = index.search(vectors, k + 1)
    keep = (found != np.arange(len(vectors))[:, None]) & (found >= 0)  # not itself, nor a slot HNSW left empty
    neighbours = np.stack([_first(row[mask], k) for row, mask in zip(found, keep, strict=True)])
    sims = np.stack([_first(row[mask], k) for row, mask in zip(scores, keep, strict=True)])
    return neighbours.astype(np.int64), sims.astype(np.float32)


def _first(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` of ``values``, zeros after them where there are fewer (a neighbour of weight 0)."""
    return np.concatenate([values[:k], np.zeros(max(0, k - len(values)), values.dtype)])


def _served_graph(rows: np.ndarray, vectors: np.ndarray, k: int, weight: float) -> CorpusGraph:
    """The graph of the index as built (not the view), by store row: row r's neighbours' rows."""
    positions, sims = nearest(np.asarray(vectors, dtype=np.float32), k)
    size = int(rows.max()) + 1 if len(rows) else 0
    neighbours = np.full((size, k), -1, dtype=np.int64)
    similarities = np.zeros((size, k), dtype=np.float32)
    neighbours[rows] = rows[positions]
    similarities[rows] = sims
    return CorpusGraph(neighbours, similarities, weight)


def _write(index_dir: Path, card: dict, graph: CorpusGraph | None) -> None:
    """``adapt/`` written aside and renamed into place (the card last inside it)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{ADAPT_DIR}.writing-", dir=index_dir))
    try:
        if graph is not None:
            graph.save(staging)
        (staging / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
        target = index_dir / ADAPT_DIR
        if target.exists():
            retired = index_dir / f".{ADAPT_DIR}.old-{os.getpid()}"
            os.rename(target, retired)
            os.rename(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def summary(card: dict) -> str:
    """The card in a few lines, for the command line."""
    sets = ", ".join(f"{v['count']} {k}" for k, v in card["pseudo_queries"].items())
    lines = [f"pseudo-queries: {sets}"]
    made = card.get("generation")
    if made:
        lines.append(
            f"questions from {made['server']} ({made['model']}): {made['kept']} kept of {made['asked']} asked"
            f" ({made['rejected']} rejected, {made['failed']} failed), {made['seconds']} s"
        )
    held = card.get("heldout")
    if held:
        kinds = "; ".join(f"{k} {v['rrf']:.4f} -> {v['adapted']:.4f}" for k, v in held["by_kind"].items())
        lines.append(
            f"held-out nDCG@10 ({held['queries']} pseudo-queries): RRF {held['rrf']:.4f}, adapted {held['adapted']:.4f}"
            f" ({kinds})"
        )
    lines.append(card["decision"])
    return "\n".join(lines)
