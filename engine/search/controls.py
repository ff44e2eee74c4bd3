"""A request's controls as one search's :class:`SearchOptions`, checked against the engine that
answers it: its retrievers, fusion and reranker, and the limits and pins of its settings. Each
refusal is a 422 naming the field, at every door."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.documents import MAX_DEPTH, MAX_RERANK_DEPTH, QueryRequest, SearchRequest
from engine.errors import INVALID_PARAMS, ServiceError
from engine.search.pages import fingerprint
from engine.search.results import AS_LOADED, SearchOptions

if TYPE_CHECKING:
    from engine.search.hybrid import HybridEngine


PAGING = {"top_k", "paginate", "page_token"}  # what a request may change between its pages


class InvalidControl(ServiceError, ValueError):
    """A request's control this engine cannot honour (422); the message starts with the field."""

    status, jsonrpc_code = 422, INVALID_PARAMS


def search_options(request: QueryRequest, engine: HybridEngine) -> SearchOptions:
    """What ``request`` asks of ``engine`` beyond its query (a plain :class:`QueryRequest`: nothing)."""
    if not isinstance(request, SearchRequest):
        return AS_LOADED
    settings, names = engine.settings, list(engine.retrievers())
    fusion, rerank = request.fusion, request.rerank
    given = {
        "fusion.method": fusion and fusion.method,
        "fusion.k": fusion and fusion.k,
        "fusion.weights": fusion and fusion.weights,
        "rerank.enabled": rerank and rerank.enabled,
        "rerank.depth": rerank and rerank.depth,
        "retrievers.depth": request.retrievers,
    }
    for control, value in given.items():
        if value is not None and control not in settings.request_controls:
            raise InvalidControl(f"{control}: this server does not let a request change it")
    weights = dict(fusion.weights or {}) if fusion else {}
    depths = {name: asked.depth for name, asked in (request.retrievers or {}).items() if asked.depth is not None}
    for field, named in (("fusion.weights", weights), ("retrievers", request.retrievers or {})):
        for name in named:
            if name not in names:
                raise InvalidControl(f"{field}.{name}: no such retriever; this index's are {', '.join(names)}")
    deepest = settings.max_request_depth or MAX_DEPTH
    rerank_deepest = settings.max_request_rerank_depth or MAX_RERANK_DEPTH
    for name, depth in depths.items():
        if depth > deepest:
            raise InvalidControl(f"retrievers.{name}.depth: at most {deepest} on this server")
    if weights and not any(weights.get(name, settings.retriever(name).weight) for name in names):
        raise InvalidControl("fusion.weights: at least one retriever needs a weight above 0")
    if given["fusion.method"] == "learned" and engine.fusion is None:
        raise InvalidControl("fusion.method: this index serves no learned fusion (train one with `build`); use rrf")
    if given["rerank.enabled"] and engine.reranker is None:
        raise InvalidControl("rerank.enabled: this server serves no reranker (none in the index, or --no-rerank)")
    if (given["rerank.depth"] or 0) > rerank_deepest:
        raise InvalidControl(f"rerank.depth: at most {rerank_deepest} on this server")
    return SearchOptions(
        rerank_depth=0 if given["rerank.enabled"] is False else given["rerank.depth"],
        method=given["fusion.method"],
        rrf_k=given["fusion.k"],
        weights=weights,
        depths=depths,
        explain=request.explain,
        group_size=request.group_size if request.group_by else 0,
        paginate=request.paginate or request.page_token is not None,
        page_token=request.page_token,
        fingerprint=fingerprint(request.model_dump_json(exclude=PAGING)),
        highlight=request.highlight.sentences if request.highlight else 0,
        neighbors=request.context.neighbors if request.context else 0,
    )
