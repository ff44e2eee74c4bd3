"""The chunks searches read lately, in memory, for as long as the store has not changed.

Every search reads its fused head's chunks (100 on CUDA) to answer and to rerank: a SQLite join with
two JSON documents parsed a chunk, 1.5-3 ms of a query's CPU stages on 2 cores (docs/gpu.md). The same
chunks come back query after query, so the store keeps the last :data:`CHUNKS` it read. A write bumps
the store's ``version`` (meta) in its own transaction, from any process, and a read takes its version
and its rows in one snapshot: entries are served only for the version they were read at, the cache is
emptied when a newer version is seen, and rows read at an older one are never kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

CHUNKS = 16384  # ~30 MB of NFCorpus chunks with their token ids: a few heads' worth, whatever the corpus

Value = TypeVar("Value")


class ChunkCache(Generic[Value]):
    """Least recently read first out, at most ``size`` entries, all of one store version."""

    def __init__(self, size: int = CHUNKS) -> None:
        self.size = size
        self.version = -1
        self._entries: OrderedDict[str, Value] = OrderedDict()
        self._lock = threading.Lock()

    def found(self, keys: Iterable[str], version: int) -> dict[str, Value]:
        """Those of ``keys`` held for ``version`` (none when the cache holds a newer one)."""
        with self._lock:
            if version > self.version:
                self._entries.clear()
                self.version = version
            if version != self.version:
                return {}
            found = {}
            for key in keys:
                value = self._entries.get(key)
                if value is not None:
                    self._entries.move_to_end(key)
                    found[key] = value
            return found

    def keep(self, values: dict[str, Value], version: int) -> None:
        """``values`` as read at ``version``: kept only if that is still the store's newest seen."""
        with self._lock:
            if version != self.version:
                return
            self._entries.update(values)
            for key in values:
                self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
