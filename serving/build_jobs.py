"""Collections built in the background (``POST /collections`` with ``data``), their progress
readable at ``GET /jobs/{id}``: the stage the build is in (what :class:`offline.progress.track`
reports), how far, and the time that stage has left at its rate so far."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import INVALID_PARAMS, ServiceError
from offline.progress import observed

log = logging.getLogger(__name__)


class UnknownJob(ServiceError, LookupError):
    """No job of that id here (404): ids are this process's, and only the most recent are kept."""

    status, jsonrpc_code = 404, INVALID_PARAMS


@dataclass
class Job:
    """One build: its state and where it got; read by any thread while the build's thread writes."""

    id: str
    collection: str
    source: str
    state: Literal["running", "done", "failed"] = "running"
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str | None = None
    stage: str | None = None
    done: int = 0
    total: int | None = None
    _stage_started: float = field(default_factory=time.perf_counter)
    _stages: int = 0

    def report(self, stage: str, done: int, total: int | None) -> None:
        """A :class:`~offline.progress.track` of the build got to ``done`` of ``total``."""
        if stage != self.stage:
            self.stage, self._stage_started, self._stages = stage, time.perf_counter(), self._stages + 1
        self.done, self.total = done, total

    def describe(self) -> dict:
        spent = time.perf_counter() - self._stage_started
        rate = self.done / spent if self.done and spent > 0 else None
        left = (self.total - self.done) / rate if rate and self.total is not None else None
        return {
            "id": self.id,
            "collection": self.collection,
            "source": self.source,
            "state": self.state,
            "stage": self.stage,
            "stages_seen": self._stages,
            "done": self.done,
            "total": self.total,
            "percent": round(100 * self.done / self.total, 1) if self.total else None,
            "stage_eta_s": round(left, 1) if left is not None and self.state == "running" else None,
            "elapsed_s": round((self.finished or time.time()) - self.started, 1),
            "error": self.error,
        }


class Jobs:
    """The builds of this process, the most recent ``kept`` of them."""

    def __init__(self, kept: int = 100) -> None:
        self.kept = kept
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, collection: str, source: str, work: Callable[[], None], failed: Callable[[], None]) -> Job:
        """Run ``work`` on a thread of its own, its progress reported to the job; ``failed`` runs
        when it raises (the job then says why)."""
        with self._lock:
            job = Job(f"build-{next(self._ids)}-{collection}", collection, source)
            self._jobs[job.id] = job
            while len(self._jobs) > self.kept:
                self._jobs.popitem(last=False)

        def run() -> None:
            try:
                with observed(job.report):
                    work()
                job.state = "done"
            except Exception as exc:  # the job says why; the server goes on
                log.exception("building collection %r failed", collection)
                job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
                failed()
            finally:
                job.finished = time.time()

        threading.Thread(target=run, name=job.id, daemon=True).start()
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"no job {job_id!r} (GET /jobs lists the most recent {self.kept})")
        return job

    def all(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())
