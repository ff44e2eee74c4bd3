"""The sentences of a hit that answer its query, with their character offsets in its text.

Each sentence is scored by the index's own bi-encoder (the model that embedded the chunk): its
embedding's cosine with the query's vector, which the search made already. Only the sentences are
encoded (the top 5 of NFCorpus: ~50, ~1,800 tokens), by the served query encoder, one a call: on a
CPU its ONNX trace, one thread a call, took 0.5-0.6 s for 50 sentences on 2 busy cores where the
torch model in one batch took 2-4 s; padded batches of the ONNX trace, and its int8 copy, were no
faster (docs/experiments.md). A chunk's sentence vectors depend on its text alone, so they are kept
(:class:`SentenceVectors`): a chunk that ranks again costs no encoding. A cross-encoder would read
the query again with every sentence, and may be served elsewhere or off.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
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


class SentenceVectors:
    """Each chunk text's sentence spans and their embeddings, the ``kept`` most recently used (1,024:
    ~15 MB at NFCorpus' ten sentences a chunk). Keyed by the text's digest, so a rewritten chunk is
    another entry and nothing goes stale; the encoder is the engine's own, the same for every call."""

    def __init__(self, kept: int = 1024) -> None:
        self.kept = kept
        self._found: OrderedDict[bytes, tuple[list[tuple[int, int]], np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, encoder: QueryEncoder, texts: Sequence[str]) -> list[tuple[list[tuple[int, int]], np.ndarray]]:
        """(spans, one row a sentence) of each of ``texts``, encoding only the texts not kept."""
        keys = [hashlib.blake2b(text.encode(), digest_size=16).digest() for text in texts]
        with self._lock:
            found = [self._found.get(key) for key in keys]
            for key, kept in zip(keys, found, strict=True):
                if kept is not None:
                    self._found.move_to_end(key)
        for i, text in enumerate(texts):
            if found[i] is None:  # outside the lock: encoding is the slow part
                cut = spans(text)
                vectors = np.vstack([encoder(text[start:end]) for start, end in cut]) if cut else np.empty((0, 0))
                found[i] = (cut, vectors)
                with self._lock:
                    self._found[keys[i]] = found[i]
                    while len(self._found) > self.kept:
                        self._found.popitem(last=False)
        return found


def highlights(
    vectors: SentenceVectors, encoder: QueryEncoder, query: np.ndarray, texts: Sequence[str], best: int
) -> list[list[Highlight]]:
    """The ``best`` sentences of each of ``texts`` by cosine with the ``query`` vector, best first."""
    answer = []
    for text, (found, encoded) in zip(texts, vectors(encoder, texts), strict=True):
        scores = encoded @ query.reshape(-1) if found else []
        order = sorted(range(len(found)), key=lambda i: -scores[i])[:best]
        answer.append([Highlight(text[found[i][0] : found[i][1]], *found[i], float(scores[i])) for i in order])
    return answer
