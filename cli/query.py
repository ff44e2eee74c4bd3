"""``search``: one question from the command line, checked by the rules every door applies."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Annotated

from pydantic import TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from cli.flags import SEARCH, add_settings
from engine.documents import SearchRequest
from serving.settings import Settings

if TYPE_CHECKING:
    from engine.search import Hit
    from engine.search.explain import Explanation

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
    p.add_argument(
        "--explain", action="store_true", help="say why each hit is where it is: every stage's rank and score"
    )
    p.add_argument(
        "--weights",
        metavar="NAME=W,...",
        help="this search's RRF weight of each retriever named, e.g. bm25=1,dense=0.5 (0 leaves one out)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_settings(p, SEARCH)
    p.set_defaults(run=search, answers_queries=True)


def search(settings: Settings, args: argparse.Namespace) -> int:
    from engine.search import HybridEngine

    fields = {"query": args.query, "top_k": args.top_k, "similarity_threshold": args.similarity_threshold}
    weights = _weights(args.weights)
    try:
        limited = SearchRequest.limited(settings.serving.max_query_chars)
        controls = {"explain": args.explain, "fusion": {"weights": weights} if weights else None}
        request = limited.model_validate(fields | controls | {"filters": _filters(args)})
    except ValidationError as exc:
        raise ValueError(as_flags(exc)) from None
    engine = HybridEngine(settings.engine)
    options = engine.options_for(request)
    started = time.perf_counter()
    hits = engine.search(request.query, request.top_k, request.filters, request.similarity_threshold, options)
    elapsed = time.perf_counter() - started
    retrievers = [name for name, retriever in engine.retrievers().items() if retriever is not None]
    if args.json:
        print(json.dumps([_as_json(hit, retrievers) for hit in hits], indent=2))
        return 0
    table = Table(
        title=f"{args.query!r}: {len(hits)} hits in {elapsed * 1000:.0f} ms",
        caption=f"{' / '.join(retrievers)}: the document's rank in that retriever; rerank: cross-encoder score",
    )
    id_width = max((len(hit.doc_id) for hit in hits), default=6)
    for column in ("#", "doc id", "score", "fused", *retrievers, "rerank"):
        table.add_column(column, no_wrap=True, min_width=id_width if column == "doc id" else None, justify="right")
    table.add_column("title", overflow="fold", ratio=1, min_width=10)
    for rank, hit in enumerate(hits, start=1):
        table.add_row(
            str(rank),
            hit.doc_id,
            f"{hit.score:.4f}",
            f"{hit.fused_score:.4f}",
            *(_opt(hit.found.get(name, (None,))[0]) for name in retrievers),
            "-" if hit.rerank_score is None else f"{hit.rerank_score:.3f}",
            hit.title or hit.text[:80],
        )
    console.print(table)
    if args.explain:
        for rank, hit in enumerate(hits, start=1):
            console.print(f"[bold]{rank}. {hit.doc_id}[/] {_told(hit.explanation)}")
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
        if where[:2] == ["fusion", "weights"]:  # what --weights gives
            where = ["weights", *where[2:]]
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


def _weights(given: str | None) -> dict[str, str] | None:
    """--weights bm25=1,dense=0.5 as the request's fusion.weights (the model checks the values)."""
    if not given:
        return None
    pairs = [part.partition("=") for part in given.split(",") if part.strip()]
    if not pairs or any(not sep or not name.strip() for name, sep, _ in pairs):
        raise ValueError(f"--weights {given!r}: expected NAME=WEIGHT,... e.g. bm25=1,dense=0.5")
    try:
        return {name.strip(): float(value) for name, _, value in pairs}
    except ValueError:
        raise ValueError(f"--weights {given!r}: each weight is a number") from None


def _as_json(hit: Hit, retrievers: list[str]) -> dict:
    """A hit as the CLI prints it: each retriever's rank and score as ``<name>_rank``, ``<name>_score``."""
    shown = {k: v for k, v in hit.__dict__.items() if k not in ("found", "explanation")}
    for name in retrievers:
        shown[f"{name}_rank"], shown[f"{name}_score"] = hit.found.get(name, (None, None))
    if hit.explanation is not None:
        shown["explanation"] = hit.explanation.model_dump(mode="json")
    return shown


def _told(why: Explanation) -> str:
    """One line of how a hit got its place: each retriever's rank and share, fusion, the rerank blend."""
    parts = [
        f"{name} #{part.rank} (+{part.contribution:.4f})" if part.rank else f"{name} -"
        for name, part in why.retrievers.items()
    ]
    fusion = why.fusion
    said = f"{', '.join(parts)} -> rrf #{fusion.rrf_rank} {fusion.rrf_score:.4f}"
    if fusion.method != "rrf":
        said += f" -> {fusion.method} #{fusion.rank} {fusion.score:.4f}"
    if why.rerank is not None:
        r = why.rerank
        said += f" -> rerank {r.score:.3f}: {1 - r.blend:g} x {r.fused_z:+.2f} + {r.blend:g} x {r.reranker_z:+.2f}"
    return said + f" = #{why.final.rank} {why.final.score:.4f}"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
