"""One clock for a query's stages, so each stage's time is measured one way and named once."""

from __future__ import annotations

import time

# in the order a query runs them; "pairs": the reranker's inputs made (passages read, pairs tokenized)
STAGES = ("encode", "bm25", "dense", "memory", "fusion", "pairs", "rerank")


class Stopwatch:
    """Times consecutive stages: each :meth:`lap` ends the stage it names, the next starts there."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        now = time.perf_counter()
        self.seconds[stage] = now - self._last
        self._last = now

    def stop(self) -> dict[str, float]:
        """Every lap and the ``total`` since the start."""
        self.seconds["total"] = time.perf_counter() - self.started
        return self.seconds
