"""What each fault scenario found, typed: one dataclass per scenario, so a reader (or a test) sees
the shape of ``reliability-faults.json`` in one place, and a figure missing or misspelt fails where
the result is made or read, not in a comparison months later. The JSON keeps the shape it has always
had, so old results stay comparable: :meth:`Result.to_json` writes each field under its own name in
the order declared, except that a :func:`spread` field lends its keys to its parent (the write
counts two scenarios share; keys that are not names)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


def spread() -> Any:
    """A field whose keys go into its parent's JSON in its place (its own name does not appear)."""
    return field(metadata={"spread": True})


@dataclass(frozen=True)
class Result:
    """A scenario's figures, and the JSON the results file holds of them."""

    omit_none: ClassVar[bool] = False  # True: a field left None is absent from the JSON, not null

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = as_json(getattr(self, f.name))
            if f.metadata.get("spread"):
                out.update(value)
            elif value is not None or not self.omit_none:
                out[f.name] = value
        return out


def as_json(value: Any) -> Any:
    """``value`` with every :class:`Result` in it (in lists and dicts too) made JSON."""
    if isinstance(value, Result):
        return value.to_json()
    if isinstance(value, list):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Skipped(Result):
    skipped: str  # why the scenario could not run here


@dataclass(frozen=True)
class WriteCounts(Result):
    """What became of the writes a client sent: acknowledged (and deletes), cut short by a kill
    (``in_doubt``: either outcome is right), and what the checks after found wrong."""

    acknowledged: int
    acknowledged_deletes: int
    in_doubt: int
    lost: int
    half_applied: int
    resurrected: int


@dataclass(frozen=True)
class Opened(Result):
    """How a damaged copy opened: refused (``message``) or not (``logged_present``: the crashed
    copy's logged writes a recovery kept); through the CLI also its exit code and whether it printed
    a traceback. What does not apply is absent."""

    omit_none = True
    refused: bool
    message: str | None = None
    logged_present: int | None = None
    exit_code: int | None = None
    traceback: bool | None = None


@dataclass(frozen=True)
class CorruptionOutcome(Result):
    case: str
    file: str  # the file damaged, relative to the index
    opened: Opened = spread()
    names_file: bool  # the refusal names the damaged file
    as_expected: bool


@dataclass(frozen=True)
class RerankerFailure(Result):
    queries: int
    answered: int
    served_fused_order: bool
    health: dict[str, Any]  # /health's reranker_health while the reranker failed
    health_shows: bool
    metrics_show: bool
    recovers: bool
    llm_answered: bool
    llm_health_shows: bool
    llm_metrics_show: bool


@dataclass(frozen=True)
class SigtermDrain(Result):
    requests: int
    in_flight: int  # searches still running at the signal
    completed: int
    ok: int
    in_flight_outcomes: dict[str, int]
    new_after_signal: int
    refused_after: int
    served_after: int
    refused_until_exit: bool
    first_refusal_s: float | None
    last_in_flight_answer_s: float
    exit_code: int
    traceback: bool


@dataclass(frozen=True)
class FullHealth(Result):
    status: str
    refresh_error: str | None


@dataclass(frozen=True)
class DiskFull(Result):
    limit_bytes: int
    acknowledged_before: int
    refused_status: int
    refused_error: str
    logged_not_yet_searchable: int
    searches_while_full: int
    health_while_full: FullHealth
    exit_code_while_full: int
    lost: int
    half_applied: int
    refused_present: int


@dataclass(frozen=True)
class SigkillRounds(Result):
    rounds: int
    writes: WriteCounts = spread()
    replayed_records: int
    seconds: float


@dataclass(frozen=True)
class Kill(Result):
    sockets_closed_s: float
    serving_again_s: float
    first_write_acknowledged_s: float | None


@dataclass(frozen=True)
class Phase(Result):
    phase: str
    seconds: float
    searches: dict[str, dict[str, int]]  # where (killed worker, other worker, ...) -> outcome -> count
    writes: dict[str, dict[str, int]]  # door -> outcome -> count


@dataclass(frozen=True)
class WorkersKilled(Result):
    workers: int
    readers: int
    searches: int
    searches_per_s: float
    kills: dict[str, Kill]  # by role
    phases: list[Phase]
    writes: WriteCounts = spread()
    health_after: str
    exit_code: int
    traceback: bool


@dataclass(frozen=True)
class FailedConnections(Result):
    kills: int
    kills_with_a_failure: int
    failed: int


@dataclass(frozen=True)
class KillWindow(Result):
    connections_per_kill: int
    waited: dict[str, FailedConnections] = spread()  # by what the kill waited for
    exit_code: int
