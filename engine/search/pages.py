"""Stable pages: a search's whole ranking pinned under a token, so that its next pages are read off
the same ranking, concatenating to one longer list with no duplicate and no gap, whatever is
written meanwhile (a chunk deleted since is the one thing a later page leaves out).

The token names the pin, the offset of the next page and the request it belongs to (its query,
filters and controls, not its page size), signed with the pins' key: another server's or another
query's token is refused (422 naming ``page_token``), one whose pin has been dropped, by age or to
make room (settings ``page_pins``, ``page_pin_seconds``), has expired (410).

Pins and key live in one store (:class:`PinStore`): a SQLite database (:class:`PinFile`) in this
process's memory, or in the file ``page_pins_file`` that ``serve --workers N`` puts in its private
folder (mode 0700, as the workers' channel), so that any worker answers a page another pinned
(``search --paginate``: one in the user's cache folder, so that the next run does); under ``serve
--ray``, one deployment's, which every search replica calls. The first worker to open a file
makes the key; a ranking is kept pickled (what the workers' channel sends, in a folder only this
user can write), stored again after each page so that the chunks a page read stay the ones the
next reads, without its learned fusion, which the engine gives back (the same model in every
worker) and which would cost a pickled LightGBM booster a pin.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import pickle
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.errors import INVALID_PARAMS, ServiceError

if TYPE_CHECKING:
    from engine.search.results import StageResult

BUSY_MS = 5000  # a sibling worker's write holds the file this long at most
_SCHEMA = """
CREATE TABLE IF NOT EXISTS pins (
    seq INTEGER PRIMARY KEY, pin TEXT UNIQUE NOT NULL, made REAL NOT NULL, result BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS signing (one INTEGER PRIMARY KEY CHECK (one = 1), key BLOB NOT NULL);
"""


class ForeignPageToken(ServiceError, ValueError):
    """A page token this server did not make, or made for another query (422)."""

    status, jsonrpc_code = 422, INVALID_PARAMS


class ExpiredPageToken(ServiceError):
    """A page token whose ranking is no longer pinned (410): search again from the first page."""

    status, jsonrpc_code = 410, INVALID_PARAMS


class PinStore(Protocol):
    """Where pinned rankings live, as the bytes :class:`Pins` makes of them, with the key that signs
    their tokens: whoever shares a store answers the pages of each other's tokens."""

    def signing_key(self) -> bytes: ...

    def put(self, pin: str | None, blob: bytes) -> str:
        """``blob`` pinned under a new pin (``pin`` None), or kept again under ``pin``, its age kept."""
        ...

    def get(self, pin: str) -> bytes | None:
        """``pin``'s ranking, None once dropped."""
        ...


class PinFile:
    """A :class:`PinStore` in SQLite, the oldest dropped past ``kept`` or ``seconds``: in ``path``
    (shared by the processes that open it) or, without one, in this process's memory."""

    def __init__(self, kept: int, seconds: float, path: Path | None = None) -> None:
        self.kept, self.seconds = kept, seconds
        self._conn = sqlite3.connect(
            ":memory:" if path is None else path, isolation_level=None, check_same_thread=False, timeout=BUSY_MS / 1000
        )
        self._lock = threading.Lock()  # one connection, many threads
        with self._lock:
            if path is not None:
                self._conn.execute("PRAGMA journal_mode=WAL")  # a reader waits for no writer
                self._conn.execute("PRAGMA synchronous=OFF")  # pins outlive no server: nothing to keep on a crash
            self._conn.executescript(_SCHEMA)
            self._conn.execute("INSERT OR IGNORE INTO signing VALUES (1, ?)", (secrets.token_bytes(32),))
            self._key = self._conn.execute("SELECT key FROM signing").fetchone()[0]

    def signing_key(self) -> bytes:
        return self._key

    def put(self, pin: str | None, blob: bytes) -> str:
        with self._lock:
            if pin is not None:
                self._conn.execute("UPDATE pins SET result = ? WHERE pin = ?", (blob, pin))
                return pin
            pin = secrets.token_urlsafe(12)
            self._conn.execute("BEGIN IMMEDIATE")  # the oldest dropped while no sibling pins
            with self._conn:  # committed, or rolled back on an error
                self._conn.execute("DELETE FROM pins WHERE made < ?", (time.time() - self.seconds,))
                self._conn.execute("INSERT INTO pins (pin, made, result) VALUES (?, ?, ?)", (pin, time.time(), blob))
                self._conn.execute(
                    "DELETE FROM pins WHERE seq NOT IN (SELECT seq FROM pins ORDER BY seq DESC LIMIT ?)", (self.kept,)
                )
            return pin

    def get(self, pin: str) -> bytes | None:
        with self._lock:
            found = self._conn.execute(
                "SELECT result FROM pins WHERE pin = ? AND made >= ?", (pin, time.time() - self.seconds)
            ).fetchone()
        return None if found is None else found[0]


class Pins:
    """Page tokens over the rankings a :class:`PinStore` keeps for ``seconds`` at most."""

    def __init__(self, store: PinStore, seconds: float) -> None:
        self.store, self.seconds = store, seconds
        self._key = store.signing_key()

    def keep(self, pin: str | None, result: StageResult, offset: int, request: str) -> str:
        """The token of the page at ``offset`` of ``result``'s ranking for ``request`` (its
        fingerprint): ``result`` pinned anew (``pin`` None) or kept again under ``pin``, its age kept."""
        blob = pickle.dumps(dataclasses.replace(result, fusion=None), protocol=pickle.HIGHEST_PROTOCOL)
        pin = self.store.put(pin, blob)
        body = base64.urlsafe_b64encode(json.dumps([pin, offset, request]).encode()).decode().rstrip("=")
        return f"{body}.{self._signature(body)}"

    def page(self, token: str, request: str) -> tuple[str, int, StageResult]:
        """``token``'s pin, offset and ranking (its ``fusion`` None: the caller's to give back);
        :class:`ForeignPageToken`, :class:`ExpiredPageToken`."""
        body, _, signature = token.partition(".")
        if not token.isascii() or not hmac.compare_digest(signature, self._signature(body)):  # ours are ASCII
            raise ForeignPageToken("page_token: not a token this server made (send the one a reply carried)")
        pin, offset, made_for = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if made_for != request:
            raise ForeignPageToken("page_token: made for another query, filters or controls (send the same ones)")
        found = self.store.get(pin)
        if found is None:
            raise ExpiredPageToken(f"page_token: expired (pinned {self.seconds:g} s at most); search again")
        return pin, offset, pickle.loads(found)

    def _signature(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:32]


def fingerprint(request: str) -> str:
    """A short digest of a request's JSON (what a token is bound to)."""
    return hashlib.sha256(request.encode()).hexdigest()[:24]
