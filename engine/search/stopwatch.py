"""One clock for a query's stages, so each stage's time is measured one way and named once."""

from __future__ import annotations

import time
from collections.abc import Iterable

# a query's stages before and after its retrievers' (each named as the engine registers it); "pairs":
# the reranker's inputs made (passages read, pairs tokenized)
BEFORE, AFTER = ("encode",), ("fusion", "pairs", "rerank")


class Stopwatch:
    """Times consecutive stages: each :meth:`lap` ends the stage it names, the next starts there; a
    stage run again (a filtered search's second pass) adds to its time. A stage run beside the laps
    on another thread is added with its own times (:meth:`beside`)."""

    def __init__(self, retrievers: Iterable[str] = ()) -> None:
        self.stages = (*BEFORE, *retrievers, *AFTER)  # in the order a query runs them
        self.started = time.perf_counter_ns()
        self._last = self.started
        # stage: [its first start, its time so far], in perf_counter nanoseconds (spans: telemetry)
        self.spans: dict[str, list[int]] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter_ns()
        self._add(stage, self._last, now)
        self._last = now

    def beside(self, stage: str, start: int, end: int) -> None:
        """A stage that ran from ``start`` to ``end`` (perf_counter nanoseconds) beside the laps since
        the last; the wait for it past them is in the total only."""
        self._add(stage, start, end)
        self._last = time.perf_counter_ns()

    def _add(self, stage: str, start: int, end: int) -> None:
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(self.stages)}")
        self.spans.setdefault(stage, [start, 0])[1] += end - start

    def stop(self) -> dict[str, float]:
        """Every stage's time, in the order a query runs them, and the ``total`` since the start, in
        seconds."""
        seconds = {stage: self.spans[stage][1] / 1e9 for stage in self.stages if stage in self.spans}
        seconds["total"] = (time.perf_counter_ns() - self.started) / 1e9
        return seconds
