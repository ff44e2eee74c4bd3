"""The REST routes of ``serve --indexes DIR``: the collections, their aliases and build jobs
(declared as one table, as :mod:`serving.rest`'s are), and today's routes served per collection
at ``/collections/{name}/...`` and for the default collection at their own paths, each request
holding a lease on the collection it reached (:meth:`Collections.leased`), named back to the
caller in ``X-Collection``."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount
from starlette.types import Receive, Scope, Send

from engine.store.index_dir import IndexDirError
from serving.build_jobs import Jobs, UnknownJob
from serving.collections import (
    NAME,
    BadName,
    CollectionConflict,
    CollectionInfo,
    Collections,
    CollectionsReply,
    UnknownCollection,
)
from serving.openapi import Op
from serving.requests import BadRequest, json_body, validated

HEADER = "x-collection"  # the collection that answered, after aliases


class CollectionIn(BaseModel):
    """A collection to make: empty, or built from a folder on the server in the background."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{NAME.pattern}$", description="its name: the folder in DIR, and the URL's segment")
    data: str | None = Field(
        None,
        description="a folder on the server to build it from (a BEIR dataset or files, as `build --data` takes);"
        " none: an empty collection, written to with POST /collections/{name}/documents",
    )


class AliasIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    collection: str = Field(description="the collection (or the alias of one) the alias names from now on")


class Leased:
    """Today's routes, served by the collection the path names (or the default one): the request
    holds its lease while it runs, so a swap or a drop meanwhile never closes what it reads."""

    def __init__(self, collections: Collections) -> None:
        self.collections = collections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope.get("path_params", {}).get("name")
        async with self.collections.leased(name) as collection:

            async def named(message) -> None:
                if message["type"] == "http.response.start":
                    message.setdefault("headers", []).append((HEADER.encode(), collection.name.encode()))
                await send(message)

            await collection.app(scope, receive, named)


def routes(collections: Collections, jobs: Jobs) -> list[BaseRoute]:
    """The collection routes; today's routes follow them (their table: :func:`serving.rest.routes`),
    after whatever the caller adds between (``/mcp``) with :func:`default_routes`."""
    limit = collections.settings.serving.max_body_bytes

    async def listing(request: Request) -> Response:
        return JSONResponse((await run_in_threadpool(collections.listing)).model_dump())

    async def one(request: Request) -> Response:
        return JSONResponse((await run_in_threadpool(collections.describe, request.path_params["name"])).model_dump())

    async def create(request: Request) -> Response:
        asked = validated(CollectionIn, await json_body(request, limit))
        if asked.data is None:
            described = await run_in_threadpool(_make_empty, collections, asked.name)
            return JSONResponse(described, status_code=201)
        data = Path(asked.data)
        if not data.is_dir():
            raise BadRequest(f"data: {asked.data!r} is not a folder on this server")
        path = collections.reserve(asked.name)
        settings = collections.settings
        engine, build = (
            settings.engine.model_copy(update={"index_dir": path}),
            settings.build.model_copy(update={"data_dir": data}),
        )

        def work() -> None:
            from index_build.builder import build_index

            build_index(engine, build, progress=False)
            collections.created(asked.name)

        job = jobs.start(asked.name, str(data), work, lambda: collections.abandoned(asked.name))
        return JSONResponse(job.describe(), status_code=202, headers={"Location": f"/jobs/{job.id}"})

    async def drop(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(collections.drop, request.path_params["name"]))

    async def aliases(request: Request) -> Response:
        return JSONResponse(dict(sorted(collections.aliases.items())))

    async def put_alias(request: Request) -> Response:
        asked = validated(AliasIn, await json_body(request, limit))
        return JSONResponse(
            await run_in_threadpool(collections.set_alias, request.path_params["alias"], asked.collection)
        )

    async def delete_alias(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(collections.delete_alias, request.path_params["alias"]))

    async def job(request: Request) -> Response:
        return JSONResponse(jobs.get(request.path_params["job_id"]).describe())

    async def all_jobs(request: Request) -> Response:
        return JSONResponse({"jobs": [job.describe() for job in jobs.all()]})

    async def health(request: Request) -> Response:  # off the event loop: each collection's is asked
        return JSONResponse(await run_in_threadpool(_health, collections))

    table = [
        Op(
            "GET /collections",
            listing,
            "Every collection: name, description, size, health; the aliases, the default, the shared models",
            "the collections",
            reply=CollectionsReply,
        ),
        Op(
            "POST /collections",
            create,
            "Make a collection: empty (201), or built from a server folder in the background (202, a job)",
            {201: "the empty collection", 202: "the build's job (GET /jobs/{id})"},
            (400, 413, BadRequest, CollectionConflict),
            body=CollectionIn,
        ),
        Op(
            "GET /collections/{name}",
            one,
            "A collection (or the one an alias names)",
            "the collection",
            (UnknownCollection,),
            reply=CollectionInfo,
        ),
        Op(
            "DELETE /collections/{name}",
            drop,
            "Drop a collection: served no more, closed and deleted once its last search ends",
            "dropped",
            (UnknownCollection, CollectionConflict),
        ),
        Op("GET /aliases", aliases, "Every alias and the collection it names", "aliases"),
        Op(
            "PUT /aliases/{alias}",
            put_alias,
            "Point an alias at a collection, atomically: searches running finish on the old one",
            "the alias, its collection and the one before",
            (400, 413, BadRequest, BadName, UnknownCollection, CollectionConflict),
            body=AliasIn,
        ),
        Op(
            "DELETE /aliases/{alias}",
            delete_alias,
            "Delete an alias",
            "deleted",
            (UnknownCollection, CollectionConflict),
        ),
        Op("GET /jobs", all_jobs, "The most recent build jobs", "jobs"),
        Op(
            "GET /jobs/{job_id}",
            job,
            "A build job: state, stage, progress, the stage's time left",
            "the job",
            (UnknownJob,),
        ),
        Op("GET /health", health, "Liveness: the default collection's health and each collection's status", "health"),
    ]
    return [*(op.to_route() for op in table), Mount("/collections/{name}", app=Leased(collections))]


def default_routes(collections: Collections) -> list[BaseRoute]:
    """Today's routes at their own paths, served by the default collection: last, as they take every path."""
    return [Mount("", app=Leased(collections))]


def _make_empty(collections: Collections, name: str) -> dict:
    from index_build.builder import build_index
    from index_build.corpus import empty_corpus

    path = collections.reserve(name)
    settings = collections.settings
    try:
        build_index(
            settings.engine.model_copy(update={"index_dir": path}), settings.build, empty_corpus(), progress=False
        )
        collections.created(name)
    except (IndexDirError, ValueError) as exc:
        collections.abandoned(name)
        raise BadRequest(f"cannot make collection {name!r}: {exc}") from None
    except BaseException:
        collections.abandoned(name)
        raise
    return collections.describe(name).model_dump()


def _health(collections: Collections) -> dict:
    """The default collection's ``/health`` as today, with every collection's status beside it."""
    statuses = {}
    for name in collections.names():
        try:
            with collections.lease(name) as collection:
                statuses[name] = collection.service.health()["status"]
        except UnknownCollection:
            continue
    default = collections.default_name()
    found: dict = {"status": "ok", "index_loaded": bool(statuses)}
    if default is not None:
        try:
            with collections.lease(default) as collection:
                found = collection.service.health()
        except UnknownCollection:
            pass
    worst = "degraded" if any(status != "ok" for status in statuses.values()) else found["status"]
    return {**found, "status": worst, "default_collection": default, "collections": statuses}
