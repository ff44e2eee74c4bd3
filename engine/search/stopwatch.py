"""One clock for a query's stages, so each stage's time is measured one way and named once."""

from __future__ import annotations

import time
from collections.abc import Iterable

# a query's stages besides its retrievers' (each named as the engine registers it); "pairs": the
# reranker's inputs made (passages read, pairs tokenized)
STAGES = ("encode", "fusion", "pairs", "rerank")


class Stopwatch:
    """Times consecutive stages: each :meth:`lap` ends the stage it names, the next starts there; a
    stage run again (a filtered search's second pass) adds to its time."""

    def __init__(self, retrievers: Iterable[str] = ()) -> None:
        self.stages = (*STAGES, *retrievers)
        self.started = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(self.stages)}")
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now

    def stop(self) -> dict[str, float]:
        """Every lap and the ``total`` since the start."""
        self.seconds["total"] = time.perf_counter() - self.started
        return self.seconds
