"""Scores of (query, passage) pairs seen lately: a repeated question costs no cross-encoder work."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence

from cachetools import TTLCache

Pair = tuple[str, str]


class PairCache:
    """At most ``size`` scores, each kept ``ttl_s`` seconds.

    Keys hash the exact texts the model read (the query, and the document with its memory context),
    so an edited document or a grown memory misses instead of returning a stale score.
    """

    def __init__(self, size: int, ttl_s: float) -> None:
        self._scores: TTLCache = TTLCache(size, ttl_s)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def scores(self, pairs: Sequence[Pair], compute: Callable[[list[Pair]], list[float]]) -> list[float]:
        """Each pair's score, from the cache or from one ``compute`` call over the pairs it lacks."""
        keys, found = self.lookup(pairs)
        todo = [i for i, score in enumerate(found) if score is None]
        fresh = compute([pairs[i] for i in todo]) if todo else []
        self.keep([keys[i] for i in todo], fresh)
        for i, score in zip(todo, fresh, strict=True):
            found[i] = score
        return found

    def lookup(self, pairs: Sequence[Pair]) -> tuple[list[bytes], list[float | None]]:
        """Each pair's key, and its score where the cache holds one (None where not: a miss)."""
        keys = [_key(pair) for pair in pairs]
        with self._lock:
            found = [self._scores.get(key) for key in keys]
            missed = found.count(None)
            self.hits += len(pairs) - missed
            self.misses += missed
        return keys, found

    def keep(self, keys: Sequence[bytes], scores: Sequence[float]) -> None:
        """Remember the scores of the pairs whose keys :meth:`lookup` gave."""
        with self._lock:
            for key, score in zip(keys, scores, strict=True):
                self._scores[key] = score


def _key(pair: Pair) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for text in pair:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()
