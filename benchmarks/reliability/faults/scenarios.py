"""The fault scenarios by name, as ``--faults`` picks them and the results file keys them: a table,
so that adding a scenario is a row (and its module), and a run walks the rows it was asked for in
the table's order rather than a chain of ifs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.reliability.faults import corruptions, degraded, sigterm, workers, writes
from benchmarks.reliability.faults.results import Result, as_json


@dataclass(frozen=True)
class Run:
    """What every scenario of one run is given: the index it copies, where it works, and the options
    some take."""

    index_dir: Path
    work_dir: Path
    rounds: int = 20  # kill -9 rounds
    reranker: str | None = None  # the reranker to break (default: the index's own)


Scenario = Callable[[Run], Result | list[Result]]

SCENARIOS: dict[str, Scenario] = {  # in the order they run and appear in the results file
    "corruptions": lambda run: corruptions.every_corruption(run.index_dir, run.work_dir),
    "reranker_failure": lambda run: degraded.reranker_fault(run.index_dir, run.work_dir, run.reranker),
    "sigterm": lambda run: sigterm.sigterm_drain(run.index_dir, run.work_dir),
    "disk_full": lambda run: writes.disk_full(run.index_dir, run.work_dir),
    "kill_9": lambda run: writes.sigkill_rounds(run.index_dir, run.work_dir, run.rounds),
    "workers": lambda run: workers.workers_killed_under_load(run.index_dir, run.work_dir),
    "kill_window": lambda run: workers.kill_window(run.index_dir, run.work_dir),
}


def run_faults(
    index_dir: Path, work_dir: Path, rounds: int = 20, reranker: str | None = None, faults: Iterable[str] = SCENARIOS
) -> dict[str, Any]:
    """The ``faults`` named (default all; names as in :data:`SCENARIOS`) against copies of
    ``index_dir``, as the results file's JSON (``reranker``: default the index's own; that case is
    skipped without one)."""
    chosen = set(faults)
    if unknown := chosen - set(SCENARIOS):
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run = Run(index_dir, work_dir, rounds, reranker)
    figures: dict[str, Any] = {"index_dir": str(index_dir)}
    for name, scenario in SCENARIOS.items():
        if name in chosen:
            figures[name] = as_json(scenario(run))
    if chosen == set(SCENARIOS):  # a part run alone keeps the whole run's time in the file
        figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures
