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
        keys = [_key(pair) for pair in pairs]
        with self._lock:
            found = [self._scores.get(key) for key in keys]
        todo = [i for i, score in enumerate(found) if score is None]
        fresh = compute([pairs[i] for i in todo]) if todo else []
        with self._lock:
            for i, score in zip(todo, fresh, strict=True):
                self._scores[keys[i]] = found[i] = score
            self.hits += len(pairs) - len(todo)
            self.misses += len(todo)
        return found


def _key(pair: Pair) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for text in pair:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()
