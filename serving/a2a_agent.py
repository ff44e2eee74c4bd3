"""The A2A "purple agent": a message ``{"query": ..., "top_k": 5}`` in, ``{"doc_ids": [...]}`` out
(with ``"explain": true``, also ``"explanations"``, one a hit).

Built on the official a2a-sdk (protocol 1.0) with its v0.3 compatibility switched on, because the
benchmark's evaluator speaks 0.3. The reply is exactly one artifact with exactly one data part and
no text anywhere: the evaluator joins every part it sees and parses the result as JSON.

Serving collections (``serve --indexes DIR``), the card lists one skill per collection, and a
message's ``"collection"`` (a name or alias) picks the one searched (default: the default one).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from a2a.helpers.proto_helpers import (
    get_data_parts,
    get_text_parts,
    new_data_part,
    new_task_from_user_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext, SimpleRequestContextBuilder
from a2a.server.events import EventQueue
from a2a.server.id_generator import IDGenerator
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import TaskStore, TaskUpdater
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Part
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0
from a2a.utils.errors import InvalidParamsError
from starlette.applications import Starlette

from engine.documents import SEARCH_TOOL, SearchRequest
from engine.errors import ServiceError
from serving.collections import Collections
from serving.jsonrpc_guard import JsonRpcGuard
from serving.presentation import Presentation
from serving.replies import json_errors, to_chunks
from serving.requests import BadRequest, validated
from serving.search_service import SearchService

log = logging.getLogger(__name__)
SKILL_ID = "nfcorpus_retrieval"
DETAILS = ("group_by", "highlight", "context")  # asked for, a reply carries REST's results
# what only the MCP server's general tool takes: a message that sets any of them is sent there
GENERAL = set(SearchRequest.model_fields) - {"query", "top_k"}


class DocSearch(Protocol):
    """Where the agent's searches go: the in-process engine or a remote MCP tool."""

    async def answer(self, request: SearchRequest, collection: str | None = None) -> dict:
        """The reply's data part: ``doc_ids``, ``explanations`` when the request asked, and
        ``next_page_token`` when it paginates and more remain; ``collection``: the one to search
        (None: the default; only a server of collections is given one)."""
        ...


class EngineSearch:
    def __init__(self, service: SearchService) -> None:
        self.service = service

    async def answer(self, request: SearchRequest, collection: str | None = None) -> dict:
        hits = await self.service.search(request, door="a2a")
        explained = [hit.explanation.model_dump(mode="json") for hit in hits] if request.explain else None
        paged = {"next_page_token": hits.next_page_token} if getattr(hits, "next_page_token", None) else {}
        return {
            "doc_ids": [hit.doc_id for hit in hits],
            **({"explanations": explained} if request.explain else {}),
            **({"results": to_chunks(hits).model_dump(mode="json")["results"]} if _detailed(request) else {}),
            **paged,
        }


class CollectionSearch:
    """The collection a message names (or the default one), leased for its search."""

    def __init__(self, collections: Collections) -> None:
        self.collections = collections

    async def answer(self, request: SearchRequest, collection: str | None = None) -> dict:
        async with self.collections.leased(collection) as leased:
            return await EngineSearch(leased.service).answer(request)


class McpSearch:
    """Calls ``search_nfcorpus`` on any MCP server through the official client."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def answer(self, request: SearchRequest, collection: str | None = None) -> dict:
        from mcp import Client

        arguments = {"query": request.query, "top_k": request.top_k}
        tool = SEARCH_TOOL
        asked = request.model_dump(mode="json", include=GENERAL, exclude_unset=True)
        if asked or collection is not None:
            tool = "search"  # the general tool takes them; the benchmark's stays as it is
            arguments |= asked | ({"collection": collection} if collection is not None else {})
        async with Client(self.url) as client:
            result = await client.call_tool(tool, arguments)
        if result.is_error:
            message = " ".join(getattr(c, "text", "") for c in result.content).strip()
            raise BadRequest(f"MCP tool failed: {message or 'no message'}")
        content = result.structured_content or {}
        results = content.get("results", [])
        paged = {"next_page_token": content["next_page_token"]} if "next_page_token" in content else {}
        if _detailed(request):  # the general tool's chunks, as the engine's answer carries them
            return {"doc_ids": [r["doc_id"] for r in results], "results": results, **paged}
        if request.explain:  # the general tool's chunks, one a hit
            explained = [r.get("explanation") for r in results]
            return {"doc_ids": [r["doc_id"] for r in results], "explanations": explained, **paged}
        return {"doc_ids": _unique([r["doc_id"] for r in results])[: request.top_k], **paged}


def _detailed(request: SearchRequest) -> bool:
    """Whether ``request`` asks for what a hit's id cannot say (its group, best sentences, neighbours):
    the data part then carries ``results``, REST's ``/search`` results."""
    return any(getattr(request, name) is not None for name in DETAILS)


def _unique(ids: list[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def solver_task(parts: list[Part]) -> dict | None:
    """A solver task (an object with ``task``), as a data part or as JSON text; else None."""
    data = get_data_parts(parts)
    if data:
        return data[0] if isinstance(data[0], dict) and "task" in data[0] else None
    try:
        payload = json.loads("".join(get_text_parts(parts)))
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) and "task" in payload else None


def parse_message(parts: list[Part], max_chars: int, collections: bool = False) -> tuple[SearchRequest, str | None]:
    """A data part with the keys, a text part holding that JSON, or plain text as the query (top 5);
    JSON of the wrong shape is refused, never guessed at. With ``collections``, the collection a
    JSON message names (``"collection"``), else None."""
    data = get_data_parts(parts)
    if data:
        payload = data[0]
    else:
        text = "".join(get_text_parts(parts)).strip()
        if not text:
            raise BadRequest('send a text part with JSON like {"query": "...", "top_k": 5}')
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:  # plain words, as chat UIs and generic clients send: the question itself
            payload = {"query": text}
    collection = None
    if collections and isinstance(payload, dict) and "collection" in payload:
        payload = dict(payload)
        collection = payload.pop("collection")
        if not isinstance(collection, str):
            raise BadRequest(f"collection: a collection's name (a string), got {collection!r}")
    return validated(SearchRequest.limited(max_chars), payload), collection


class RetrievalExecutor(AgentExecutor):
    """Retrieval for ``{"query", ...}``; with ``solve``, the solver skill for ``{"task_id", "task", ...}``."""

    def __init__(
        self,
        search: DocSearch,
        max_chars: int,
        timeout_s: float,
        solve: Callable[[dict], Awaitable[dict]] | None = None,
    ) -> None:
        self.search = search
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.solve = solve
        self.collections = isinstance(search, CollectionSearch)  # messages may name a collection

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task = context.current_task
        if task is None:
            try:
                task = new_task_from_user_message(context.message)
            except ValueError as exc:  # an empty text part, no parts: the client's mistake, not ours
                raise InvalidParamsError(f"message: {exc}") from None
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        task_payload = solver_task(list(context.message.parts)) if self.solve is not None else None
        if task_payload is not None:
            await self._solve(updater, task_payload)
            return
        try:
            request, collection = parse_message(list(context.message.parts), self.max_chars, self.collections)
            found = await asyncio.wait_for(self.search.answer(request, collection), timeout=self.timeout_s)
        except ServiceError as exc:  # the caller is told why: a failed task
            await self._fail(updater, str(exc))
            return
        except TimeoutError:
            await self._fail(updater, f"query took longer than {self.timeout_s:g} s")
            return
        except Exception as exc:  # a broken backend must fail the task, not the server
            log.exception("search failed")
            await self._fail(updater, f"search failed: {exc}")
            return
        await updater.add_artifact([new_data_part(found)], name="doc_ids")
        await updater.complete()

    async def _solve(self, updater: TaskUpdater, payload: dict) -> None:
        try:
            answer = await asyncio.wait_for(self.solve(payload), timeout=self.timeout_s)
        except ServiceError as exc:
            await self._fail(updater, str(exc))
            return
        except TimeoutError:
            await self._fail(updater, f"task took longer than {self.timeout_s:g} s")
            return
        except Exception as exc:  # the solver's backend failing must fail the task, not the server
            log.exception("solver failed")
            await self._fail(updater, f"solver failed: {type(exc).__name__}")
            return
        await updater.add_artifact([new_data_part(answer)], name="answers")
        await updater.complete()

    async def _fail(self, updater: TaskUpdater, message: str) -> None:
        await updater.failed(updater.new_agent_message([new_text_part(message)]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        task = context.current_task
        if task is not None:
            await TaskUpdater(event_queue, task.id, task.context_id).cancel()


SOLVER_SKILL = AgentSkill(
    id="benchmark_solver",
    name="Benchmark task solver",
    description='Input: a data part {"task_id", "task", "policy_doc"?: {"rules": [...], "default_action"}, '
    '"history"?: [{"role", "content"}], "expected_format"?: "list" | "single" | "json", "context"?}. The policy is '
    "enforced before anything else. Output: one artifact with one data part {task_id, answers, metadata} whose "
    "metadata says policy_compliant, policy_violations, applied_rules, memory_compressed, memory_summary, citations.",
    tags=["solver", "policy", "rag", "nfcorpus"],
    examples=[json.dumps({"task_id": "t1", "task": "Which foods lower LDL cholesterol?", "expected_format": "list"})],
    input_modes=["application/json"],
    output_modes=["application/json"],
)


def agent_card(
    url: str, shown: Presentation, solver: bool = False, collections: Collections | None = None
) -> AgentCard:
    """The card, with a 1.0 and a 0.3 interface so both generations of clients accept it; ``shown``:
    what the index says it holds. ``collections``: one skill for each (the default one's is the
    index's skill as ever), read when the card is asked for, so a collection made since is there."""
    default = collections.default_name() if collections is not None else None
    if default is not None:
        shown = Presentation.of(collections.root / default)
    listed = [name for name in collections.names() if name != default] if collections is not None else []
    others = [_collection_skill(name, Presentation.of(collections.root / name)) for name in listed]
    index_skill = [retrieval_skill(shown)] if collections is None or default is not None else []
    return AgentCard(
        name=f"hybrid-search {shown.name} retriever",
        description=f"Retrieves {shown.description} for a plain-English query: BM25 + dense "
        "retrieval, learned fusion and cross-encoder reranking. Replies with ranked doc ids.",
        version="0.1.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version=PROTOCOL_VERSION_1_0),
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version=PROTOCOL_VERSION_0_3),
        ],
        capabilities=AgentCapabilities(streaming=False, push_notifications=False),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["application/json"],
        skills=[*index_skill, *others, *([SOLVER_SKILL] if solver else [])],
    )


def retrieval_skill(shown: Presentation, skill_id: str = SKILL_ID, collection: str | None = None) -> AgentSkill:
    """Retrieval from an index (``shown``: what it holds); from a collection, reached by naming it in the message."""
    asked = {"query": "does vitamin D prevent falls in older adults?", "top_k": 5}
    named = {"collection": collection} if collection is not None else {}
    reach = f' Add "collection": "{collection}" to the JSON to search this collection.' if collection else ""
    return AgentSkill(
        id=skill_id,
        name=f"{shown.name} retrieval" + (f" (collection {collection})" if collection else ""),
        description='Input: a text part with JSON {"query": str, "top_k": int 1..100, default 5} '
        "(or a data part with those keys, or plain text: the question, top 5; optional filters "
        "{document_types, date_range, document_ids, "
        "metadata key: value} and similarity_threshold 0..1; this search's fusion {method, k, weights}, "
        'rerank {enabled, depth} and retrievers {"dense": {"depth": N}}). Output: one artifact with one data'
        " part "
        f'{{"doc_ids": [...]}} holding top_k ranked, unique {shown.name} document ids; with "explain": true'
        ' also "explanations", each hit\'s every stage rank and score; with group_by, highlight or context also'
        ' "results", the /search results (each hit\'s group, highlights, context).' + reach,
        tags=["retrieval", "search", *shown.tags, *([f"collection:{collection}"] if collection else [])],
        examples=[json.dumps(asked | named), json.dumps({"doc_ids": ["MED-1", "MED-2", "MED-3", "MED-4", "MED-5"]})],
        input_modes=["text/plain", "application/json"],
        output_modes=["application/json"],
    )


def _collection_skill(name: str, shown: Presentation) -> AgentSkill:
    return retrieval_skill(shown, f"retrieval.{name}", name)


def build_a2a_app(
    search: DocSearch,
    url: str,
    shown: Presentation,
    max_chars: int,
    timeout_s: float,
    solve: Callable[[dict], Awaitable[dict]] | None = None,
    max_body_bytes: int = 8 << 20,
    *,
    tasks: TaskStore,
    task_ids: IDGenerator | None = None,
    collections: Collections | None = None,
) -> JsonRpcGuard:
    """JSON-RPC at ``/`` (1.0 and 0.3) behind :class:`JsonRpcGuard`, the card at the well-known
    path and at ``/``. ``tasks``: where tasks are kept; ``task_ids``: how new ones are named
    (default: random UUIDs); ``collections``: the card lists them as they are when it is read."""
    card = agent_card(url, shown, solve is not None, collections)
    handler = DefaultRequestHandler(
        agent_executor=RetrievalExecutor(search, max_chars, timeout_s, solve),
        task_store=tasks,
        agent_card=card,
        request_context_builder=SimpleRequestContextBuilder(task_store=tasks, task_id_generator=task_ids),
    )
    current = None
    if collections is not None:

        async def current(_: AgentCard) -> AgentCard:  # the collections as they are now
            return agent_card(url, shown, solve is not None, collections)

    routes = [
        *create_agent_card_routes(card, current),
        *create_agent_card_routes(card, current, card_url="/"),
        *create_agent_card_routes(card, current, card_url="/.well-known/agent.json"),
        *create_jsonrpc_routes(handler, rpc_url="/", enable_v0_3_compat=True),
    ]
    return JsonRpcGuard(json_errors(Starlette(routes=routes)), "/", max_body_bytes)
