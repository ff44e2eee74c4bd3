"""A search's answer, from what its stages found: the page of hits a caller gets (chunks, or
documents with their best chunks), each hit's similarity, the texts read past the reranked head
(so a later page reads the view as it is then), and the passages a request asked for."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Literal

from engine.retrieval.protocol import Ranking
from engine.search.groups import by_document
from engine.search.highlights import highlights
from engine.search.results import Hits, SearchOptions, StageResult, make_hits

if TYPE_CHECKING:
    from engine.search.hybrid import HybridEngine


def similarity(result: StageResult, ranking: list[tuple[str, float]]) -> list[float]:
    """What ``similarity_score`` means: with a calibrated fusion, the probability that the hit is
    relevant (from its fused score and final rank); without one (no training judgments), the
    cosine of the query and the chunk in 0-1 (a chunk pointing away from the query is as
    dissimilar as one at right angles), never above the score of the hit ranked before it, so
    the scores fall down the list and a threshold keeps a prefix of the ranking. Without
    judgments it is a similarity, not a probability."""
    calibration = result.fusion.calibration if result.fusion is not None else None
    if calibration is None:
        cosines = [result.cosines[d] for d, _ in ranking]
        return list(itertools.accumulate((min(1.0, max(0.0, c)) for c in cosines), min))
    fused = dict(result.fused)
    return [calibration.probability(fused[d], rank) for rank, (d, _) in enumerate(ranking, start=1)]


def hits(
    engine: HybridEngine,
    result: StageResult,
    top_k: int,
    similarity_threshold: float | None = None,
    explain: bool | Literal["full"] = False,
    group_size: int = 0,
    offset: int = 0,
) -> Hits:
    """The answer: ``result``'s hits ``offset`` to ``offset + top_k`` (its first ``top_k`` as
    :meth:`HybridEngine.stages` read them under the view lock, so a write since cannot take a row from them;
    past those, :func:`reach` reads on); ``explain``: each hit with its explanation.
    ``group_size``: documents, not chunks (:func:`~engine.search.groups.by_document`), each hit
    its document's best chunk with the next ones in its ``group``. ``more``: whether the ranking
    holds hits past these."""
    end = offset + top_k
    head = result.final[:end] if end <= len(result.final) else result.ranked[:end]  # the same, read once
    window = result.ranked if group_size else head
    held = reach(engine, result, window)
    similar = dict(zip((d for d, _ in held), similarity(result, held), strict=True))
    if not group_size:
        page = [hit for hit in window[offset:end] if hit[0] in similar]
        hits = make_hits(result, page, result.chunks, [similar[d] for d, _ in page], similarity_threshold, explain)
        hits.more = len(result.ranked) > end
        return hits
    groups = by_document(held, {d: c.document_id for d, c in result.chunks.items()}, end + 1, group_size)
    leaders = [group[0] for group in groups[offset:end]]
    threshold = similarity_threshold
    hits = make_hits(result, leaders, result.chunks, [similar[d] for d, _ in leaders], threshold, explain)
    members = {group[0][0]: group[1:] for group in groups}
    for hit in hits:
        rest = members[hit.doc_id]
        hit.group = make_hits(result, rest, result.chunks, [similar[d] for d, _ in rest], None, explain)
    hits.grouped, hits.more = True, len(groups) > end
    return hits


def passages(engine: HybridEngine, hits: Hits, result: StageResult, options: SearchOptions) -> None:
    """What a request asked of each hit's text (its group's too): its best sentences, scored by the
    index's bi-encoder (the served query encoder) against the query's vector
    (:mod:`engine.search.highlights`), and the chunks around it in its section."""
    every = [chunk for hit in hits for chunk in (hit, *hit.group)]
    if options.highlight and every:
        encoder, texts = engine.dense.query_encoder, [h.text for h in every]
        found = highlights(engine.sentences, encoder, result.query_vector, texts, options.highlight)
        for hit, best in zip(every, found, strict=True):
            hit.highlights = best
    if options.neighbors:
        for hit in every:
            hit.context = engine.store.neighbors(hit.doc_id, options.neighbors)


def reach(engine: HybridEngine, result: StageResult, ranking: Ranking) -> Ranking:
    """``ranking`` with the chunks and cosines :func:`hits` reads, past the head :meth:`HybridEngine.stages` read
    in the view as it is now (kept in ``result``, so that its later pages read the same); a chunk
    deleted since is left out."""
    cosines = result.fusion is None or result.fusion.calibration is None
    if all(d in result.chunks and (d in result.cosines or not cosines) for d, _ in ranking):
        return ranking
    with engine.view_lock.reading():
        missing = [d for d, _ in ranking if d not in result.chunks]
        if missing:
            result.chunks.update(engine.store.chunks(missing))
        held = [hit for hit in ranking if hit[0] in result.chunks]
        if cosines:
            ids = [d for d, _ in held if d not in result.cosines]
            ids = [d for d, kept in zip(ids, engine.dense.units.contains(ids).tolist(), strict=True) if kept]
            result.cosines.update(zip(ids, engine.dense.similarity(result.query_vector, ids), strict=True))
            held = [hit for hit in held if hit[0] in result.cosines]
    return held
