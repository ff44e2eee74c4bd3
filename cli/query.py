"""``search``: one question from the command line, checked by the rules every door applies."""

from __future__ import annotations

import argparse
import json
import time
from typing import Annotated

from pydantic import TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from cli.flags import SEARCH, add_settings
from engine.documents import SearchRequest
from serving.settings import Settings

console = Console()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search the index and print a table of hits")
    p.add_argument("query", help="the question, in plain words")
    p.add_argument("--top-k", type=int, default=5, help="hits to show, 1-100 (default 5)")
    p.add_argument(
        "--filters",
        help='JSON filters, e.g. \'{"document_types": ["guideline"], "date_range": ["2020-01-01", null]}\'',
    )
    p.add_argument("--filter", action="append", metavar="KEY=VALUE", help="metadata equality (repeatable)")
    p.add_argument(
        "--similarity-threshold",
        type=float,
        help="drop hits whose similarity_score (probability of relevance, 0-1) is below this",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_settings(p, SEARCH)
    p.set_defaults(run=search, answers_queries=True)


def search(settings: Settings, args: argparse.Namespace) -> int:
    from engine.search import HybridEngine

    fields = {"query": args.query, "top_k": args.top_k, "similarity_threshold": args.similarity_threshold}
    try:
        limited = SearchRequest.limited(settings.serving.max_query_chars)
        request = limited.model_validate(fields | {"filters": _filters(args)})
    except ValidationError as exc:
        raise ValueError(as_flags(exc)) from None
    engine = HybridEngine(settings.engine)
    started = time.perf_counter()
    hits = engine.search(request.query, request.top_k, request.filters, request.similarity_threshold)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps([hit.__dict__ for hit in hits], indent=2))
        return 0
    table = Table(
        title=f"{args.query!r}: {len(hits)} hits in {elapsed * 1000:.0f} ms",
        caption="BM25 / dense / memory: the document's rank in that retriever; rerank: cross-encoder score",
    )
    id_width = max((len(hit.doc_id) for hit in hits), default=6)
    for column in ("#", "doc id", "score", "fused", "BM25", "dense", "memory", "rerank"):
        table.add_column(column, no_wrap=True, min_width=id_width if column == "doc id" else None, justify="right")
    table.add_column("title", overflow="fold", ratio=1, min_width=10)
    for rank, hit in enumerate(hits, start=1):
        table.add_row(
            str(rank),
            hit.doc_id,
            f"{hit.score:.4f}",
            f"{hit.fused_score:.4f}",
            _opt(hit.bm25_rank),
            _opt(hit.dense_rank),
            _opt(hit.memory_rank),
            "-" if hit.rerank_score is None else f"{hit.rerank_score:.3f}",
            hit.title or hit.text[:80],
        )
    console.print(table)
    if engine.reranker is None:
        console.print("[yellow]no reranker: fused order shown[/]")
    return 0


def checked(name: str, value: object) -> object:
    """``value`` by the rule every search door applies to the field ``name``."""
    field = SearchRequest.model_fields[name]
    try:
        return TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
    except ValidationError as exc:
        raise ValueError(as_flags(exc, name)) from None


def as_flags(exc: ValidationError, field: str | None = None) -> str:
    """A search request's validation error in the CLI's words: ``--top-k: ...``, ``query: ...``."""
    named = []
    for error in exc.errors():
        where = [field, *error["loc"]] if field else list(error["loc"])
        flag = "query" if where[0] == "query" else "--" + str(where[0]).replace("_", "-")
        named.append(".".join([flag, *map(str, where[1:])]) + f": {error['msg']}")
    return "; ".join(named)


def _filters(args: argparse.Namespace) -> dict | None:
    """--filters JSON and --filter KEY=VALUE (repeatable) as one filters object."""
    raw, pairs = args.filters, args.filter
    data = {}
    if raw:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--filters is not JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise ValueError('--filters must be a JSON object, e.g. \'{"document_types": ["guideline"]}\'')
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--filter {pair!r}: expected KEY=VALUE")
        data[key] = value
    return data or None


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
