"""Admission control: a bounded number of requests do engine work at once; the rest wait a bounded
time, then are refused fast with a time to come back, instead of queueing into a 20-second answer.

One gate per process, shared by every door (REST, MCP, A2A, the agent protocol), so a saturated
CPU answers 503 + ``Retry-After`` (or the door's equivalent) within ``max_queue_s``, and the
requests it admits keep their latency. Health, metrics and cards never pass through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.errors import ServiceError


class Overloaded(ServiceError, RuntimeError):
    """Every slot stayed busy for the whole queue time, or a part the request needs is restarting;
    ``retry_after_s`` says when to come back (a 503 with Retry-After)."""

    status, jsonrpc_code = 503, -32005

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(f"{message}; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Admission:
    """At most ``max_in_flight`` requests in the engine; a request waits at most ``max_queue_s``."""

    def __init__(self, max_in_flight: int, max_queue_s: float, registry: CollectorRegistry) -> None:
        self.max_in_flight, self.max_queue_s = max_in_flight, max_queue_s
        self._slots = asyncio.Semaphore(max_in_flight)
        self._busy_s = 0.0  # smoothed seconds a request holds a slot: what Retry-After is made of
        self._queue = 0
        self.in_flight = Gauge("admission_in_flight", "Requests doing engine work now", registry=registry)
        self.waiting = Gauge("admission_waiting", "Requests queued for a slot", registry=registry)
        self.refused = Counter(
            "admission_refused", "Requests refused after the queue time", ["door"], registry=registry
        )
        self.queued = Histogram(
            "admission_queue_seconds",
            "Seconds an admitted request waited for a slot",
            registry=registry,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
        )

    @contextlib.asynccontextmanager
    async def slot(self, door: str) -> AsyncIterator[Callable[[Awaitable], None]]:
        """Hold a slot for the block; :class:`Overloaded` when none frees up within the queue time.

        The block may hand work it started but will not wait for (a thread past its time limit: a
        thread cannot be stopped) to the callable it is given: the slot is then given back when that
        work ends, not when the block does, so admission sees all the work there is."""
        release = await self._acquire(door)
        outliving: list[Awaitable] = []
        try:
            yield outliving.append
        finally:
            if outliving:
                asyncio.gather(*outliving, return_exceptions=True).add_done_callback(lambda _: release())
            else:
                release()

    async def _acquire(self, door: str) -> Callable[[], None]:
        """A slot and the call that gives it back; :class:`Overloaded` when none frees up within the
        queue time."""
        started = time.perf_counter()
        self._queue += 1
        self.waiting.inc()
        try:
            if self.max_queue_s > 0 or not self._slots.locked():
                await asyncio.wait_for(self._slots.acquire(), timeout=self.max_queue_s or None)
            else:
                raise TimeoutError
        except TimeoutError:
            self.refused.labels(door).inc()
            raise Overloaded(f"server busy: no capacity within {self.max_queue_s:g} s", self.retry_after()) from None
        finally:
            self._queue -= 1
            self.waiting.dec()
        admitted = time.perf_counter()
        self.queued.observe(admitted - started)
        self.in_flight.inc()

        def release() -> None:
            self.in_flight.dec()
            self._slots.release()
            self._busy_s = 0.8 * self._busy_s + 0.2 * (time.perf_counter() - admitted)

        return release

    def retry_after(self) -> int:
        """Whole seconds until the queue now waiting has likely drained (at least 1)."""
        backlog = self._queue + self.max_in_flight
        return max(1, math.ceil(backlog * self._busy_s / self.max_in_flight))
