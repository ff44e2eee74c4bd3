"""A check in front of the A2A SDK's JSON-RPC dispatcher, for what it would call an internal error.

The dispatcher is not ours. Given bytes that are not UTF-8 it answers -32603 with Python's
exception text; it lets the JSON decoder take UTF-16 for JSON; nesting past the decoder's
recursion limit (or protobuf's 100 levels) is -32603 too; and a 0.3 method under a 1.0
``A2A-Version`` header is -32603 as well. JSON-RPC 2.0 names these: -32700 when the body is not
JSON (UTF-8, per RFC 8259), -32600 when it is not a request this server can take. Everything else
goes to the SDK with the body as it came.
"""

from __future__ import annotations

import json

from packaging.version import InvalidVersion, Version
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.asgi import route_path

PARSE_ERROR, INVALID_REQUEST = -32700, -32600
MAX_DEPTH = 64
V03_METHODS = frozenset(
    {
        "message/send",
        "message/stream",
        "tasks/get",
        "tasks/cancel",
        "tasks/resubscribe",
        "tasks/pushNotificationConfig/set",
        "tasks/pushNotificationConfig/get",
        "tasks/pushNotificationConfig/list",
        "tasks/pushNotificationConfig/delete",
        "agent/getAuthenticatedExtendedCard",
    }
)


class JsonRpcGuard:
    """Checks ``POST rpc_path`` bodies (size, encoding, JSON, depth, version) before the SDK does."""

    def __init__(self, app: ASGIApp, rpc_path: str = "/", max_bytes: int = 8 << 20) -> None:
        self.app, self.rpc_path, self.max_bytes = app, rpc_path, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) != self.rpc_path:
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await _error(INVALID_REQUEST, f"request body over {self.max_bytes:,} bytes", 413)(scope, receive, send)
                return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        problem = check(bytes(body), headers.get("a2a-version", ""))
        if problem is not None:
            await problem(scope, receive, send)
            return
        await self.app(scope, _replay(bytes(body), receive), send)


def check(body: bytes, version: str) -> JSONResponse | None:
    """The JSON-RPC error this body deserves before any SDK reads it, or None to let it through."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return _error(PARSE_ERROR, f"Parse error: the body is not UTF-8 (byte {exc.start})")
    except RecursionError:
        return _error(PARSE_ERROR, "Parse error: JSON nested too deep to parse")
    except json.JSONDecodeError as exc:
        return _error(PARSE_ERROR, f"Parse error: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if _depth(payload) > MAX_DEPTH:
        return _error(INVALID_REQUEST, f"Invalid Request: JSON nested deeper than {MAX_DEPTH} levels", ident=payload)
    method = payload.get("method") if isinstance(payload, dict) else None
    if isinstance(method, str) and method in V03_METHODS and version and not _is_v03(version):
        return _error(
            INVALID_REQUEST,
            f"Invalid Request: {method!r} is an A2A 0.3 method but A2A-Version is {version!r};"
            " send A2A-Version: 0.3 (or none), or the 1.0 method (e.g. SendMessage) with A2A-Version: 1.0",
            ident=payload,
        )
    return None


def _is_v03(version: str) -> bool:
    try:
        parsed = Version(version.strip())
    except InvalidVersion:
        return False
    return (parsed.major, parsed.minor) == (0, 3)


def _depth(value: object) -> int:
    """Nesting depth of decoded JSON, iteratively (the value may be nested thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _error(code: int, message: str, status: int = 200, ident: object = None) -> JSONResponse:
    """JSON-RPC error envelope; ``id`` echoed when the request had a valid one."""
    rid = ident.get("id") if isinstance(ident, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        rid = None
    return JSONResponse({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}, status)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the already-read body to the app, then the connection's own events."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
