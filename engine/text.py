"""Sentences of running text, by pysbd (rule-based: abbreviations, decimals and citations stay whole)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _segmenter():
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def split_sentences(text: str) -> list[str]:
    """Non-empty, stripped sentences in order."""
    return [s.strip() for s in _segmenter().segment(text) if s.strip()]
