"""Failures a caller is told about, each carrying what it means to every protocol: its HTTP status
and its JSON-RPC code. A door maps them in one place (REST: a Starlette exception handler; MCP: a
tool error; A2A: a failed task), so a new kind of failure is declared once, where it is raised."""

from __future__ import annotations

from typing import ClassVar

# JSON-RPC 2.0: -32602 invalid params; -32000..-32099 are the server's own
INVALID_PARAMS = -32602
INTERNAL = -32603


class ServiceError(Exception):
    """Base of the failures a caller is answered with; ``headers`` go out with an HTTP answer."""

    status: ClassVar[int] = 500
    jsonrpc_code: ClassVar[int] = INTERNAL

    @property
    def headers(self) -> dict[str, str] | None:
        return None

    def __str__(self) -> str:  # KeyError's own str() quotes its message
        return str(self.args[0]) if self.args else type(self).__name__
