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

import logging
import time
from pathlib import Path

from engine.fusion.graph import CorpusGraph
from engine.settings import EngineSettings
from engine.store.index_dir import FUSION_DIR
from engine.store.unit_map import UnitMap
from index_build.adapt.card import write_card
from index_build.adapt.generated import QueryWriter
from index_build.adapt.graph import nearest, served_graph
from index_build.adapt.heldout import HeldOutView
from index_build.adapt.pseudo import KINDS, PseudoQuery, pseudo_queries, relevant
from index_build.settings import BuildSettings
from offline.evaluation import evaluate_run, paired_test

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
    write_card(index_dir, card, card.pop("_graph"))
    log.info("adapted %s in %.0f s: %s", index_dir, card["seconds"], card["decision"])
    return card


def _adapt(engine, settings: EngineSettings, build: BuildSettings, progress: bool, writer: QueryWriter | None) -> dict:
    rows, vectors = engine.dense.vectors()
    units = engine.dense.units.names(rows)
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
    row_of = UnitMap.from_pairs(enumerate(units))  # the view's rows are the vectors' positions

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
    card["_graph"] = served_graph(rows, vectors, k, weight) if served else None
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
