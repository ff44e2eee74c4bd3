"""Failures of the optional stages a query falls back from (the reranker, an LLM server), kept so
that a degraded server says so in ``/health`` and ``/metrics`` instead of only in its log."""

from __future__ import annotations

import threading
from datetime import UTC, datetime


class FailureCount:
    """Calls and failures of one fallible stage; ``failing`` while its latest call failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.failing = False
        self.last_error: str | None = None
        self.last_failure_at: str | None = None

    def ok(self) -> None:
        with self._lock:
            self.calls += 1
            self.failing = False

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.calls += 1
            self.failures += 1
            self.failing = True
            self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            self.last_failure_at = datetime.now(UTC).isoformat(timespec="seconds")

    def describe(self) -> dict:
        with self._lock:
            return {
                "status": "failing" if self.failing else "ok",
                "calls": self.calls,
                "failures": self.failures,
                "last_error": self.last_error,
                "last_failure_at": self.last_failure_at,
            }
