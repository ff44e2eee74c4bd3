"""One hit per document: a ranking's chunks gathered under their documents, so that a long PDF
whose chunks all rank high fills one place, with its best chunks, rather than the whole page."""

from __future__ import annotations

from collections.abc import Mapping

from engine.retrieval.protocol import Ranking


def by_document(ranking: Ranking, document_of: Mapping[str, str], top_k: int, size: int) -> list[Ranking]:
    """The first ``top_k`` documents of ``ranking`` in the order of their best chunk, each with its
    best ``size`` chunks in ranking order (a chunk ``document_of`` does not name is skipped)."""
    groups: dict[str, Ranking] = {}
    for unit, score in ranking:
        if (document := document_of.get(unit)) is None:
            continue
        if document in groups:
            if len(groups[document]) < size:
                groups[document].append((unit, score))
        elif len(groups) < top_k:
            groups[document] = [(unit, score)]
    return list(groups.values())
