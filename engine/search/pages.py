"""Stable pages: a search's whole ranking pinned in memory under a token, so that its next pages
are read off the same ranking, concatenating to one longer list with no duplicate and no gap,
whatever is written meanwhile (a chunk deleted since is the one thing a later page leaves out).

The token names the pin, the offset of the next page and the request it belongs to (its query,
filters and controls, not its page size), signed with a key of this process: another process's or
another query's token is refused (422 naming ``page_token``), one whose pin has been dropped, by
age or to make room (settings ``page_pins``, ``page_pin_seconds``), has expired (410). Pins live in the process that made them: a server of
several workers answers a token in the worker that made it (``serve --workers 1`` for pages).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.errors import INVALID_PARAMS, ServiceError

if TYPE_CHECKING:
    from engine.search.results import StageResult

class ForeignPageToken(ServiceError, ValueError):
    """A page token this server did not make, or made for another query (422)."""

    status, jsonrpc_code = 422, INVALID_PARAMS


class ExpiredPageToken(ServiceError):
    """A page token whose ranking is no longer pinned (410): search again from the first page."""

    status, jsonrpc_code = 410, INVALID_PARAMS


class Pins:
    """Rankings pinned for their next pages, the oldest dropped past ``kept`` or ``seconds``."""

    def __init__(self, kept: int, seconds: float) -> None:
        self.kept, self.seconds = kept, seconds
        self._key = secrets.token_bytes(32)
        self._pins: OrderedDict[str, tuple[float, StageResult]] = OrderedDict()
        self._lock = threading.Lock()

    def pin(self, result: StageResult) -> str:
        """A new pin's id for ``result``."""
        pin = secrets.token_urlsafe(12)
        with self._lock:
            self._pins[pin] = (time.monotonic(), result)
            while len(self._pins) > self.kept:
                self._pins.popitem(last=False)
        return pin

    def token(self, pin: str, offset: int, request: str) -> str:
        """The token of the page at ``offset`` of ``pin``'s ranking, for ``request`` (its fingerprint)."""
        body = base64.urlsafe_b64encode(json.dumps([pin, offset, request]).encode()).decode().rstrip("=")
        return f"{body}.{self._signature(body)}"

    def page(self, token: str, request: str) -> tuple[str, int, StageResult]:
        """``token``'s pin, offset and ranking; :class:`ForeignPageToken`, :class:`ExpiredPageToken`."""
        body, _, signature = token.partition(".")
        if not hmac.compare_digest(signature, self._signature(body)):
            raise ForeignPageToken("page_token: not a token this server made (send the one a reply carried)")
        pin, offset, made_for = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if made_for != request:
            raise ForeignPageToken("page_token: made for another query, filters or controls (send the same ones)")
        with self._lock:
            found = self._pins.get(pin)
            if found is not None and time.monotonic() - found[0] > self.seconds:
                del self._pins[pin]
                found = None
        if found is None:
            raise ExpiredPageToken(f"page_token: expired (pinned {self.seconds:g} s at most); search again")
        return pin, offset, found[1]

    def _signature(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:32]


def fingerprint(request: str) -> str:
    """A short digest of a request's JSON (what a token is bound to)."""
    return hashlib.sha256(request.encode()).hexdigest()[:24]
