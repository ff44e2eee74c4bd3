"""The sentences of a hit that answer its query, with their character offsets in its text.

Each sentence is scored by the index's own bi-encoder (the model that embedded the chunk): its
embedding's cosine with the query's vector, which the search made already. Only the sentences are
encoded (the top 5 of NFCorpus: ~50), by the served query encoder, one a call: on a CPU its ONNX
trace, one thread a call, took 0.5-0.6 s for 50 sentences on 2 busy cores where the torch model
in one batch took 2-4 s. A cross-encoder would read the query again with every sentence, and may
be served elsewhere or off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.retrieval.encoder import QueryEncoder
from engine.text import split_sentences


@dataclass(frozen=True)
class Highlight:
    """One sentence of a hit's text: ``text == hit.text[start:end]``, ``score`` its cosine with the query."""

    text: str
    start: int
    end: int
    score: float


def spans(text: str) -> list[tuple[int, int]]:
    """Each sentence of ``text`` (:func:`engine.text.split_sentences`) as (start, end) in ``text``."""
    found, cursor = [], 0
    for sentence in split_sentences(text):
        start = text.find(sentence, cursor)
        if start < 0:  # a segmenter that rewrote a sentence: nothing to point at
            continue
        found.append((start, start + len(sentence)))
        cursor = start + len(sentence)
    return found


def highlights(encoder: QueryEncoder, query: np.ndarray, texts: Sequence[str], best: int) -> list[list[Highlight]]:
    """The ``best`` sentences of each of ``texts`` by cosine with the ``query`` vector, best first."""
    cut = [spans(text) for text in texts]
    sentences = [text[start:end] for text, found in zip(texts, cut, strict=True) for start, end in found]
    if not sentences:
        return [[] for _ in texts]
    scores = np.vstack([encoder(sentence) for sentence in sentences]) @ query.reshape(-1)
    answer, at = [], 0
    for text, found in zip(texts, cut, strict=True):
        mine = scores[at : at + len(found)]
        at += len(found)
        order = sorted(range(len(found)), key=lambda i: -mine[i])[:best]
        answer.append([Highlight(text[found[i][0] : found[i][1]], *found[i], float(mine[i])) for i in order])
    return answer
