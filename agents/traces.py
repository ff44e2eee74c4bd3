"""Stored traces: every message the router saw, masked, in SQLite (WAL mode).

Trace ids are ``<prefix>-<YYYYMMDD>-<seq>`` (``ing``, ``ret``, ``llm``, ``err``, ``sys``) when the
sender gives none; the messages of one conversation share a base and carry suffixes
(``ret-rag-conversation-123-002``). Payloads are masked before they are stored: e-mail
addresses, phone numbers, bearer tokens and API keys, and any configured pattern. Each row also
keeps the OpenTelemetry trace id of the request it was handled in (``otel_trace_id``).

Every commit is fsynced, which can take milliseconds (or seconds behind another process's write), so
SQLite runs on the store's one thread, never on the event loop: rows are queued in order and written
in batches, a reader sees every row added before it asked, and closing writes what is still queued.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from agents.messages import Message
from engine.telemetry import current_trace_id

log = logging.getLogger(__name__)
PREFIXES = {
    "DOCUMENT_INGESTION": "ing",
    "INGESTION_ACK": "ing",
    "RETRIEVAL_REQUEST": "ret",
    "RETRIEVAL_RESULT": "ret",
    "RESPONSE_REQUEST": "llm",
    "RESPONSE_RESULT": "llm",
    "ERROR_MESSAGE": "err",
    "RAG": "rag",
}
_MASKS = [
    re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+"),  # e-mail
    re.compile(r"(?<!\w)\+?\d[\d\s().-]{7,}\d(?!\w)"),  # phone numbers
    re.compile(r"(?i)\bbearer\s+[\w.~+/=-]+"),  # bearer tokens
    re.compile(r"\b(?:hsk|sk|pk|api|key|tok)[-_][A-Za-z0-9_-]{12,}"),  # API keys and tokens
]
_FAILED = "outcome NOT IN ('ok', 'received') OR type = 'ERROR_MESSAGE'"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, trace_id TEXT NOT NULL, type TEXT NOT NULL, sender TEXT NOT NULL,
    receiver TEXT NOT NULL, timestamp TEXT NOT NULL, duration_ms REAL, outcome TEXT NOT NULL, body TEXT NOT NULL,
    otel_trace_id TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_trace ON messages(trace_id);
CREATE TABLE IF NOT EXISTS counters (day TEXT NOT NULL, prefix TEXT NOT NULL, seq INTEGER NOT NULL,
    PRIMARY KEY (day, prefix));
"""


class Masker:
    """Replaces secrets and personal data in any JSON-like value with ``[masked]``."""

    def __init__(self, patterns: list[str] | None = None) -> None:
        self.patterns = _MASKS + [re.compile(p) for p in patterns or []]

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            for pattern in self.patterns:
                value = pattern.sub("[masked]", value)
            return value
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value


class TraceStore:
    """Append and read messages; keeps at most ``max_messages`` and nothing older than ``max_age_days``."""

    def __init__(
        self, path: Path, max_age_days: float = 7, max_messages: int = 100_000, masker: Masker | None = None
    ) -> None:
        self.path = Path(path)
        self.max_age, self.max_messages = timedelta(days=max_age_days), max_messages
        self.mask = masker or Masker()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="traces")  # all SQLite, in order
        self._rows: deque[tuple] = deque()  # added, not yet written
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.OperationalError) as exc:  # e.g. an MCP host starting us in /
            log.warning("cannot keep traces in %s (%s); keeping them in memory", self.path, exc)
            self._conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(_SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(messages)")}
        if "otel_trace_id" not in columns:  # a store written before OpenTelemetry: its rows keep NULL
            self._conn.execute("ALTER TABLE messages ADD COLUMN otel_trace_id TEXT")
        self._conn.execute("CREATE INDEX IF NOT EXISTS messages_by_otel_trace ON messages(otel_trace_id)")
        self._since_prune = 0

    async def new_trace_id(self, message_type: str, conversation: str | None = None) -> str:
        """``<prefix>-<YYYYMMDD>-<seq>``, or ``<prefix>-<conversation>-<seq>`` within one conversation;
        the counter is the file's, so processes sharing it never hand out one id twice."""
        return await asyncio.wrap_future(self._thread.submit(self._next_id, message_type, conversation))

    def _next_id(self, message_type: str, conversation: str | None) -> str:
        prefix = PREFIXES.get(message_type, "sys")
        scope = conversation or datetime.now(UTC).strftime("%Y%m%d")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute(
                "INSERT INTO counters VALUES (?, ?, 1) ON CONFLICT(day, prefix) DO UPDATE SET seq = seq + 1",
                (scope, prefix),
            )
            seq = self._conn.execute(
                "SELECT seq FROM counters WHERE day = ? AND prefix = ?", (scope, prefix)
            ).fetchone()[0]
            self._conn.execute("COMMIT")
        except sqlite3.Error:  # the connection is shared by every write: leave it out of a transaction
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        return f"{prefix}-{scope}-{seq:03d}" if conversation else f"{prefix}-{scope}-{seq:06d}"

    def add(self, message: Message, outcome: str, duration_ms: float | None = None) -> None:
        """Queue ``message`` to be stored masked, with the OpenTelemetry trace id of the span it was
        handled in (read here: the span is this thread's)."""
        self._rows.append((message.model_dump(mode="json"), outcome, duration_ms, current_trace_id()))
        self._thread.submit(self._write)

    def _write(self) -> None:
        """Every queued row in one transaction: rows that arrived during the last fsync share the next."""
        rows = [self._rows.popleft() for _ in range(len(self._rows))]
        if not rows:  # an earlier call wrote them
            return
        try:
            self._conn.execute("BEGIN")
            self._conn.executemany(
                "INSERT INTO messages (trace_id, type, sender, receiver, timestamp, duration_ms, outcome, body,"
                " otel_trace_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [self._row(*row) for row in rows],
            )
            self._since_prune += len(rows)
            if self._since_prune >= 100:
                self._prune()
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:  # a full disk, a lock held too long: the requests they record go on
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            log.warning("could not store %d trace rows (%s)", len(rows), exc)

    def _row(self, body: dict, outcome: str, duration_ms: float | None, otel_trace_id: str | None) -> tuple:
        # the envelope's ids and times are ours, not personal data (masks would take their digits)
        body |= {part: self.mask(body[part]) for part in ("payload", "metadata")}
        return (
            body["trace_id"],
            body["type"],
            body["sender"],
            body["receiver"],
            body["timestamp"],
            duration_ms,
            outcome,
            json.dumps(body),
            otel_trace_id,
        )

    def _prune(self) -> None:
        self._since_prune = 0
        cutoff = (datetime.now(UTC) - self.max_age).isoformat()
        self._conn.execute("DELETE FROM messages WHERE timestamp < ?", (cutoff,))
        self._conn.execute("DELETE FROM messages WHERE id <= (SELECT max(id) FROM messages) - ?", (self.max_messages,))

    def recent(
        self, limit: int = 50, agent: str | None = None, type_: str | None = None, errors: bool = False
    ) -> list[dict]:
        """The newest traces (one row each: first message, count, outcome, span, and the
        OpenTelemetry traces its messages were handled in); blocks until the rows queued before it
        are written (call it off the event loop)."""
        return self._thread.submit(self._recent, limit, agent, type_, errors).result()

    def _recent(self, limit: int, agent: str | None, type_: str | None, errors: bool) -> list[dict]:
        where, args = [], []
        if agent:
            where.append("(sender = ? OR receiver = ?)")
            args += [agent, agent]
        if type_:
            where.append("type = ?")
            args.append(type_)
        if errors:
            where.append(f"({_FAILED})")
        clause = f"WHERE trace_id IN (SELECT trace_id FROM messages WHERE {' AND '.join(where)})" if where else ""
        rows = self._conn.execute(
            f"SELECT trace_id, min(timestamp), max(timestamp), count(*), max(id),"
            f" sum({_FAILED}), group_concat(type, ' > '), group_concat(DISTINCT otel_trace_id)"
            f" FROM messages {clause} GROUP BY trace_id ORDER BY max(id) DESC LIMIT ?",
            [*args, limit],
        ).fetchall()
        return [
            {
                "trace_id": t,
                "started": a,
                "ended": b,
                "messages": n,
                "errors": e,
                "types": types,
                "otel_trace_ids": otel.split(",") if otel else [],
            }
            for t, a, b, n, _, e, types, otel in rows
        ]

    def trace(self, trace_id: str) -> list[dict]:
        """Every message of a trace in order, with its outcome and duration; a conversation's id
        gives every trace of that conversation (``ret-<id>-001``, ``llm-<id>-001``, ...), and an
        OpenTelemetry trace id the messages handled in that trace. Blocks as :meth:`recent` does."""
        return self._thread.submit(self._trace, trace_id).result()

    def _trace(self, trace_id: str) -> list[dict]:
        pattern = "%-" + trace_id.replace("%", "").replace("_", "\\_") + "-%"
        rows = self._conn.execute(
            "SELECT body, outcome, duration_ms, otel_trace_id FROM messages"
            " WHERE trace_id = ? OR otel_trace_id = ? OR trace_id LIKE ? ESCAPE '\\' ORDER BY id",
            (trace_id, trace_id, pattern),
        ).fetchall()
        return [{**json.loads(body), "outcome": o, "duration_ms": d, "otel_trace_id": ot} for body, o, d, ot in rows]

    def close(self) -> None:
        """Write the rows still queued, then close."""
        self._thread.submit(self._conn.close)
        self._thread.shutdown()
