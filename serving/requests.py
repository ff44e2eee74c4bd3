"""Reading a request the same way at every door: a JSON body within a size limit, a bearer key, and
a body checked against its pydantic model (the one the OpenAPI document and MCP tools are read from)."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request

from engine.documents import problems
from engine.errors import INVALID_PARAMS, ServiceError

Model = TypeVar("Model", bound=BaseModel)


class BadRequest(ServiceError, ValueError):
    """The caller's input is wrong; the message says how."""

    status, jsonrpc_code = 422, INVALID_PARAMS


class BodyError(BadRequest):
    """The body cannot be read as JSON: too large (413) or not JSON (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 past ``limit`` (declared or read: nothing further is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"body is {int(declared):,} bytes; the limit is {limit:,}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise BodyError(413, f"body is over the limit of {limit:,} bytes")
    return bytes(body)


def parse_json(body: bytes) -> object:
    """``body`` as JSON; 400 when it is not JSON in UTF-8."""
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise BodyError(400, "body must be JSON (UTF-8)") from None


async def json_body(request: Request, limit: int) -> object:
    """The body as JSON: 413 past ``limit`` bytes, 400 when it is not JSON."""
    return parse_json(await read_body(request, limit))


def validated(model: type[Model], payload: object) -> Model:
    """``payload`` as ``model``; BadRequest names each field that is wrong."""
    if not isinstance(payload, dict):
        raise BadRequest(f"expected a JSON object ({model.__name__}); got {type(payload).__name__}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise BadRequest(problems(exc)) from None


def bearer(headers: Headers | dict) -> str | None:
    """The key of ``Authorization: Bearer <key>``, or None when there is none."""
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
