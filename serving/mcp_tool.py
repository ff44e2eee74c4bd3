"""The MCP server, over streamable HTTP (mounted at ``/mcp`` beside the REST routes) or stdio.

Tools: ``search_nfcorpus`` (the benchmark's, unchanged), ``search`` (filters, threshold, chunk
fields) and, with ``--mcp-writes``, ``add_document`` / ``delete_document``. Each tool's arguments
are read from the request model its REST twin validates with, so the two cannot drift.
Resources: ``document://{document_id}``, a whole document with its chunks and metadata (each
``search`` hit names its URI), so an agent can search, then read. Prompt: ``answer_from_documents``.
Serving collections (``serve --indexes DIR``): a ``list_collections`` tool and ``collections://``
resource, and every tool but ``search_nfcorpus`` (the default collection's) takes ``collection``.
"""

import contextlib
import inspect
import io
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS
from pydantic import BaseModel, Field

from engine.documents import SEARCH_TOOL, DocumentIn, FacetRequest
from engine.errors import ServiceError
from engine.live.writer import DocumentNotFound
from serving.collections import Collections, CollectionsReply
from serving.presentation import Presentation
from serving.replies import (
    DOCUMENT_URI,
    ChunkResponse,
    FacetResponse,
    SearchResponse,
    to_chunks,
    to_facets,
    to_response,
)
from serving.requests import validated
from serving.search_service import SearchService


def takes(model: type[BaseModel], *names: str) -> Callable[[Callable], Callable]:
    """Give a ``**arguments`` tool the signature of ``model``'s fields ``names``: the MCP library
    reads the tool's JSON Schema from it, so limits and descriptions are the model's own."""

    def sign(tool: Callable) -> Callable:
        fields = model.model_fields
        tool.__signature__ = inspect.Signature(
            [
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=Annotated[fields[name].annotation, fields[name]],
                    default=inspect.Parameter.empty if fields[name].is_required() else fields[name].get_default(),
                )
                for name in names
            ],
            return_annotation=inspect.signature(tool).return_annotation,
        )
        return tool

    return sign


COLLECTION = Annotated[
    str | None,
    Field(description="the collection (or alias) to use, as list_collections names them; default: the default one"),
]


def with_collection(served: SearchService | Collections) -> Callable[[Callable], Callable]:
    """Serving collections: one more argument, ``collection``, at the end of a tool's signature."""

    def sign(tool: Callable) -> Callable:
        signature = inspect.signature(tool)
        named = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        if isinstance(served, Collections):
            named.append(
                inspect.Parameter("collection", inspect.Parameter.KEYWORD_ONLY, annotation=COLLECTION, default=None)
            )
        tool.__signature__ = signature.replace(parameters=named)
        return tool

    return sign


def build_mcp_server(served: SearchService | Collections) -> MCPServer:
    """An MCP server exposing the engine (or each collection of ``serve --indexes``); errors reach
    the client as tool errors, never crashes."""
    collections = served if isinstance(served, Collections) else None
    default = collections.default_name() if collections is not None else None
    index_dir = collections.root / default if collections is not None and default else served.settings.engine.index_dir
    shown = Presentation.of(index_dir)
    server = MCPServer(
        name="hybrid-search",
        instructions=f"Search {shown.description} with hybrid BM25 + dense retrieval and reranking."
        + (" More collections: list_collections; the tools take collection=NAME." if collections else ""),
        version="0.1.0",
    )

    @contextlib.asynccontextmanager
    async def using(collection: str | None = None) -> AsyncIterator[SearchService]:
        """The service a call uses: the one served, or the collection named (a lease for the call)."""
        if collections is None:
            yield served
            return
        async with collections.leased(collection) as leased:
            yield leased.service

    async def searched(model: type[BaseModel], arguments: dict):
        try:
            async with using(arguments.pop("collection", None)) as service:
                return await service.search(validated(model, arguments), door="mcp")
        except ServiceError as exc:  # a tool error: a message for the calling model, never a crash
            raise ToolError(str(exc)) from None

    @server.tool(
        name=SEARCH_TOOL, description=f"Find the {shown.name} documents most relevant to a plain-English query."
    )
    @takes(served.query_request, "query", "top_k")
    async def search_nfcorpus(**arguments) -> SearchResponse:
        return to_response(await searched(served.query_request, arguments))

    @server.tool(
        name="search",
        description="Search the index's chunks, optionally narrowed by filters (document_types, date_range"
        " [from, to], document_ids, any metadata key equal to a value or under operators: eq, in, not_in, gt, gte,"
        ' lt, lte, exists; and, or, not combine them) and a similarity_threshold (0-1);'
        ' explain: true says why each hit is where it is; fusion {"method", "k", "weights": {"bm25": 1, ...}},'
        ' rerank {"enabled", "depth"} and retrievers {"dense": {"depth": N}} set this search\'s stages;'
        ' group_by "document_id" with group_size N: one hit a document, its best N chunks; paginate: true'
        " answers next_page_token, sent back as page_token with the same arguments for the next page;"
        ' highlight {"sentences": N}: each hit\'s best sentences with offsets; context {"neighbors": N}: the chunks'
        " around each hit.",
    )
    @with_collection(served)
    @takes(served.search_request, *served.search_request.model_fields)  # the whole request model
    async def search(**arguments) -> ChunkResponse:
        return to_chunks(await searched(served.search_request, arguments))

    @server.tool(
        name="facets",
        description="Exact counts of one metadata key's values (e.g. document_type) among the chunks that match"
        " filters (as search takes them) and optionally a query's candidates; count: chunks or documents.",
    )
    @with_collection(served)
    @takes(FacetRequest, *FacetRequest.model_fields)
    async def facets(**arguments) -> FacetResponse:
        try:
            async with using(arguments.pop("collection", None)) as service:
                asked = validated(FacetRequest, arguments)
                return to_facets(asked.key, asked.count, await service.facets(asked, door="mcp"))
        except ServiceError as exc:
            raise ToolError(str(exc)) from None

    if served.settings.serving.mcp_writes:

        @server.tool(name="add_document", description="Add a document with its chunks, or replace it whole.")
        @with_collection(served)
        @takes(DocumentIn, "document_id", "document_name", "chunks", "metadata")
        async def add_document(**arguments) -> dict:
            try:
                async with using(arguments.pop("collection", None)) as service:
                    return await service.upsert(arguments, wait=True)
            except ServiceError as exc:  # a tool error: a message for the calling model, never a crash
                raise ToolError(str(exc)) from None

        @server.tool(name="delete_document", description="Delete a document and all its chunks.")
        @with_collection(served)
        async def delete_document(document_id: str, **arguments) -> dict:
            try:
                async with using(arguments.get("collection")) as service:
                    return await service.delete(document_id, wait=True)
            except DocumentNotFound:
                raise ToolError(f"no document {document_id!r}") from None
            except ServiceError as exc:  # a tool error: a message for the calling model, never a crash
                raise ToolError(str(exc)) from None

    @server.resource(
        DOCUMENT_URI,
        name="document",
        title="A whole document",
        description="A document with all its chunks and metadata; the search tool's hits name it in resource_uri.",
        mime_type="application/json",
    )
    async def document(document_id: str) -> str:
        try:
            async with using() as service:
                return json.dumps(await service.document(document_id), ensure_ascii=False)
        except DocumentNotFound:  # INVALID_PARAMS with data.uri: resource-not-found as MCP 2026-07-28 has it
            raise ResourceNotFoundError(f"no document {document_id!r}") from None

    if collections is not None:
        _collection_tools(server, collections)

    @server.prompt(
        name="answer_from_documents",
        title="Answer from the indexed documents",
        description="Answer a question from this index only: search, read the best documents whole, cite them.",
    )
    def answer_from_documents(question: str) -> str:
        return (
            f"Answer this question from the indexed documents only: {question}\n\n"
            "Call the `search` tool with it; read the whole documents of the best hits through their"
            " `resource_uri`; cite the document_id behind each claim; say so when the documents do not answer it."
        )

    server.middleware.append(_known_prompts(server))
    return server


def _collection_tools(server: MCPServer, collections: Collections) -> None:
    """``list_collections`` and ``collections://``: each collection as its manifest describes it."""
    from starlette.concurrency import run_in_threadpool

    @server.tool(
        name="list_collections",
        description="The collections this server searches: each one's name, what it holds (its manifest's"
        " description), documents, health and aliases; pass a name (or alias) as the tools' collection argument.",
    )
    async def list_collections() -> CollectionsReply:
        return await run_in_threadpool(collections.listing)

    @server.resource(
        "collections://",
        name="collections",
        title="The collections",
        description="Every collection with what it holds, its size and health; the aliases and the default.",
        mime_type="application/json",
    )
    async def listed() -> str:
        return (await run_in_threadpool(collections.listing)).model_dump_json()


def _known_prompts(server: MCPServer):
    """``prompts/get`` of a prompt this server does not have is the caller's error (-32602), not an
    internal one: the library answers it with code 0."""

    async def check(ctx, call_next):
        if ctx.method == "prompts/get":
            name = (ctx.params or {}).get("name")
            if name not in {prompt.name for prompt in await server.list_prompts()}:
                raise MCPError(code=INVALID_PARAMS, message=f"unknown prompt {name!r}")
        return await call_next(ctx)

    return check


def run_stdio(settings) -> None:
    """Serve the tool over stdin/stdout.

    The JVM and native libraries print to file descriptor 1, which would corrupt the protocol
    stream, so fd 1 is pointed at stderr and the protocol gets a private copy of the real stdout.
    """
    import anyio

    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(os.fdopen(protocol_fd, "wb"), encoding="utf-8", line_buffering=True)
    service = SearchService(settings)
    anyio.run(build_mcp_server(service).run_stdio_async)
