"""Resumable MCP streams: the last events of every SSE stream, kept in memory, so that a client
whose stream dropped reconnects with ``Last-Event-ID`` and gets what it missed instead of asking
again (MCP's resumability; the library primes each stream with an event id and a ``retry``)."""

from __future__ import annotations

import itertools
from collections import OrderedDict

from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import JSONRPCMessage

RETRY_MS = 1000  # how soon a client whose stream dropped should reconnect
EVENT_BYTES = 128  # what an event holds besides its message: its ids, its entry in the store


class RecentEvents(EventStore):
    """The newest events of all streams together, at most ``max_bytes`` of them: bytes, not a count,
    since one answer can be a few hundred bytes or megabytes. An event weighs its message's JSON
    plus :data:`EVENT_BYTES`, so the empty priming events count too. The oldest are forgotten first,
    and a client resuming from one of those gets nothing replayed (it asks again, as without a store)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._events: OrderedDict[EventId, tuple[StreamId, JSONRPCMessage | None, int]] = OrderedDict()
        self._bytes = 0
        self._ids = itertools.count(1)

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = str(next(self._ids))
        size = EVENT_BYTES + (len(message.model_dump_json(by_alias=True, exclude_unset=True)) if message else 0)
        self._events[event_id] = (stream_id, message, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._bytes -= self._events.popitem(last=False)[1][2]
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        if last_event_id not in self._events:
            return None
        stream_id = self._events[last_event_id][0]
        after = itertools.dropwhile(lambda item: item[0] != last_event_id, list(self._events.items()))
        next(after)  # the last event the client has
        for event_id, (stream, message, _) in after:
            if stream == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id
