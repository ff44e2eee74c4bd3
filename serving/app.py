"""``hybrid-search serve``: MCP + REST and the A2A agent, two ports, one engine a process (several
processes on the same ports with ``--workers N``: :mod:`serving.workers`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serving import collection_routes, rest, telemetry
from serving.a2a_agent import CollectionSearch, EngineSearch, McpSearch, build_a2a_app
from serving.a2a_tasks import RecentTaskStore, WorkerTasks
from serving.asgi import route_path
from serving.build_jobs import Jobs
from serving.collections import Collections
from serving.mcp_events import RETRY_MS, RecentEvents
from serving.mcp_tool import build_mcp_server
from serving.openapi import unkeyed
from serving.presentation import Presentation
from serving.protocol_routes import ProtocolDoor, hash_key, load_keys
from serving.replies import json_errors
from serving.requests import bearer
from serving.search_service import SearchService
from serving.settings import Settings
from serving.tls import scheme, tls_options

log = logging.getLogger(__name__)


class RequestLog:
    """Tags each HTTP request with an id (the caller's ``X-Request-ID`` or a new one) and logs it."""

    def __init__(self, app: ASGIApp, door: str) -> None:
        self.app = app
        self.door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex[:12]
        started = time.perf_counter()
        status, trace_id = 500, ""

        async def send_with_id(message) -> None:
            nonlocal status, trace_id
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.setdefault("headers", [])
                parent = next((v for k, v in headers if k == b"traceparent"), b"")  # TracedDoor's, inside
                trace_id = f" trace {parent.decode('latin-1')[3:35]}" if parent else ""
                headers.append((b"x-request-id", rid.encode("latin-1")))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info(
                "[%s] %s %s %s -> %d in %.1f ms%s",
                rid,
                self.door,
                scope["method"],
                scope["path"],
                status,
                (time.perf_counter() - started) * 1000,
                trace_id,
            )


class KeyGate:
    """With ``--key-all-doors``: every route but health, metrics, the OpenAPI document, agent cards
    and the agent protocol's ``/v1`` (which checks keys itself, per agent) wants a Bearer key from
    the agent-keys file, ``/v1/rerank`` too; 401 otherwise."""

    def __init__(self, app: ASGIApp, hashes: set[str]) -> None:
        self.app, self.hashes = app, hashes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not unkeyed(route_path(scope)):
            key = bearer(Headers(scope=scope))
            if key is None or hash_key(key) not in self.hashes:
                reply = JSONResponse({"error": "send 'Authorization: Bearer <key>' (this server keys all doors)"}, 401)
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_apps(
    settings: Settings,
    mcp: bool = True,
    a2a: bool = True,
    mcp_url: str | None = None,
    writable: bool = False,
    service: SearchService | None = None,
    tasks: WorkerTasks | None = None,
):
    """The ASGI apps to serve, with the engine loaded now so no request pays for loading.

    ``service``: one built by the caller (a Ray replica's, around an engine whose reranker is a
    deployment; a worker's of ``serve --workers N``); MCP is then stateless, since any replica or
    worker may take a session's next request. ``tasks``: a worker's A2A tasks, reachable from its
    siblings (default: this process's ``--a2a-tasks-kept`` most recent). With ``--indexes DIR``:
    every collection in DIR (:mod:`serving.collections`), returned in the service's place."""
    telemetry.install(settings)  # once per process: spans, and their export with --otlp-endpoint
    stateless = service is not None
    ports = door_ports(settings, mcp, a2a, mcp_url)
    collections = None
    if settings.serving.indexes is not None and service is None and "mcp" in ports:
        collections = Collections(settings, writable, lambda one: http_app(one, mcp=False))
    elif service is None and "mcp" in ports:
        service = SearchService(settings, writable=writable)
    apps = {}
    if collections is not None:
        apps["mcp"] = (collections_app(collections, mcp), settings.serving.mcp_port)
    elif service is not None:
        apps["mcp"] = (http_app(service, mcp, stateless), settings.serving.mcp_port)
    if a2a:
        url = (
            settings.serving.public_url
            or f"{scheme(settings)}://{_display_host(settings.serving.host)}:{settings.serving.a2a_port}/"
        )
        search = (
            McpSearch(mcp_url) if mcp_url else CollectionSearch(collections) if collections else EngineSearch(service)
        )
        apps["a2a"] = (
            build_a2a_app(
                search,
                url,
                Presentation.of(settings.engine.index_dir),
                settings.serving.max_query_chars,
                settings.serving.query_timeout_s,
                service.solve if service else None,
                settings.serving.max_body_bytes,
                tasks=tasks if tasks is not None else RecentTaskStore(settings.serving.a2a_tasks_kept),
                task_ids=tasks.ids if tasks is not None else None,
                collections=collections,
            ),
            settings.serving.a2a_port,
        )
    if settings.security.key_all_doors:
        hashes = set(load_keys(settings.security.agent_keys, settings.security.agent_rate))
        if not hashes:
            raise ValueError("--key-all-doors needs --agent-keys with at least one key")
        apps = {door: (KeyGate(app, hashes), port) for door, (app, port) in apps.items()}
    served = collections if collections is not None else service
    return served, {door: (telemetry.TracedDoor(app, door), port) for door, (app, port) in apps.items()}


def check_ports(ports: dict[str, int], host: str) -> None:
    """Fail now, naming the port, when a door's port is taken: before a build or an engine's load
    (minutes), not after them in a server's traceback. Port 0 (any free one) is never taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for door, port in ports.items():
        if not port:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            try:
                probe.bind((host, port))
            except OSError as exc:
                reason = exc.strerror or str(exc)
                raise RuntimeError(f"cannot listen on {host}:{port} ({reason}): choose another --{door}-port") from None


def door_ports(settings: Settings, mcp: bool = True, a2a: bool = True, mcp_url: str | None = None) -> dict[str, int]:
    """The port of each door :func:`build_apps` serves: REST (with MCP unless ``mcp`` is off) beside
    the engine, unless only an A2A agent searching through ``mcp_url`` is asked for; and A2A."""
    ports = {"mcp": settings.serving.mcp_port} if mcp or mcp_url is None else {}
    return ports | ({"a2a": settings.serving.a2a_port} if a2a else {})


def http_app(service: SearchService, mcp: bool = True, stateless: bool = False) -> Starlette:
    """The REST routes, with the MCP endpoint at ``/mcp`` unless ``mcp`` is off."""
    settings = service.settings
    door = ProtocolDoor(
        service.router,
        load_keys(settings.security.agent_keys, settings.security.agent_rate),
        settings.security.agent_rate,
        settings.serving.max_message_bytes,
        settings.serving.max_body_bytes,
        service.admission,
    )
    routes, lifespan = rest.routes(service, door), None
    if mcp:
        resumable = (
            {}
            if stateless
            else {"event_store": RecentEvents(settings.serving.mcp_resume_bytes), "retry_interval": RETRY_MS}
        )
        mcp_app = build_mcp_server(service).streamable_http_app(
            host=settings.serving.host, stateless_http=stateless, **resumable
        )
        routes, lifespan = routes + mcp_app.routes, mcp_app.router.lifespan_context
    return json_errors(Starlette(routes=routes, lifespan=lifespan))


def collections_app(collections: Collections, mcp: bool = True) -> Starlette:
    """``serve --indexes``: the collections' routes, ``/mcp`` over all of them unless ``mcp`` is off,
    and today's routes for the default collection (:mod:`serving.collection_routes`)."""
    settings = collections.settings
    routes, lifespan = collection_routes.routes(collections, Jobs()), None
    if mcp:
        resumable = {"event_store": RecentEvents(settings.serving.mcp_resume_bytes), "retry_interval": RETRY_MS}
        mcp_app = build_mcp_server(collections).streamable_http_app(host=settings.serving.host, **resumable)
        routes, lifespan = routes + mcp_app.routes, mcp_app.router.lifespan_context
    return json_errors(Starlette(routes=[*routes, *collection_routes.default_routes(collections)], lifespan=lifespan))


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def run_servers(
    settings: Settings, mcp: bool = True, a2a: bool = True, mcp_url: str | None = None, writable: bool = True
) -> None:
    """Serve until Ctrl-C or SIGTERM; uvicorn drains open requests, then a writable index is
    checkpointed before the process exits."""
    tls = tls_options(settings)  # bad TLS files stop here, before the engine loads
    service, apps = build_apps(settings, mcp, a2a, mcp_url, writable)
    for door, (_, port) in apps.items():
        log.info("%s listening on %s://%s:%d", door, scheme(settings), _display_host(settings.serving.host), port)
    try:
        serve_apps(settings, apps, tls)
    finally:
        if service is not None:
            service.close()
        telemetry.shutdown()


def serve_apps(settings: Settings, apps: dict, tls: dict, sockets: dict[str, socket.socket] | None = None) -> None:
    """Serve ``apps`` (:func:`build_apps`' second half) until Ctrl-C or SIGTERM, each on its port, or
    on the listening socket ``sockets`` names for its door (a worker of ``serve --workers N``)."""
    servers = {
        door: _Server(
            uvicorn.Config(
                RequestLog(app, door), host=settings.serving.host, port=port, log_config=None, access_log=False, **tls
            )
        )
        for door, (app, port) in apps.items()
    }
    asyncio.run(_serve_all(servers, sockets or {}))


class _Server(uvicorn.Server):
    """Signals are handled once for all servers in :func:`_serve_all`, not per server."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _serve_all(servers: dict[str, uvicorn.Server], sockets: dict[str, socket.socket]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: [setattr(s, "should_exit", True) for s in servers.values()])
    tasks = [asyncio.create_task(s.serve([sockets[door]] if door in sockets else None)) for door, s in servers.items()]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for server in servers.values():  # one stopped (signal or failed bind): stop the others too
        server.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        if task.exception():
            raise task.exception()
