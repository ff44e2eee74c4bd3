"""A chunk's text as every stage reads it, and sentences of running text."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _segmenter():
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def split_sentences(text: str) -> list[str]:
    """Non-empty, stripped sentences in order, by pysbd (rule-based: abbreviations, decimals and
    citations stay whole)."""
    return [s.strip() for s in _segmenter().segment(text) if s.strip()]


def chunk_text(title: str, content: str) -> str:
    """What BM25 indexes, the encoder embeds and the reranker reads of a chunk: title and body joined
    the way Anserini's BEIR "flat" collections index them. The stages must agree on it, so it is
    written here once."""
    return f"{title} {content}".strip()
