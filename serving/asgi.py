"""ASGI plumbing shared by the doors: the path a mounted app routes on, and several doors on one port."""

from __future__ import annotations

import contextlib

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Scope
from uvicorn.lifespan.on import LifespanOn


def route_path(scope: Scope) -> str:
    """The request path below the app's mount point (Starlette's ``Mount`` keeps ``path`` whole and
    grows ``root_path``), so a door checks the same paths on its own port or mounted under a prefix."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def one_port(doors: dict[str, ASGIApp]) -> Starlette:
    """``{"/a2a": app, "": other}``: each door mounted at its prefix, longest first. Starlette runs
    no lifespan of a mounted app, so each door's startup and shutdown (the MCP session manager's
    task group, say) run here, as uvicorn would run them on a port of its own."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        started = []
        try:
            for app in doors.values():
                door = LifespanOn(uvicorn.Config(app, lifespan="auto"))
                await door.startup()
                if door.startup_failed or door.should_exit:
                    raise RuntimeError("a door failed to start (its error is logged above)")
                started.append(door)
            yield
        finally:
            for door in reversed(started):
                await door.shutdown()

    routes = [Mount(prefix, app) for prefix, app in sorted(doors.items(), key=lambda kv: -len(kv[0]))]
    return Starlette(routes=routes, lifespan=lifespan)
