"""``search``: one question from the command line, checked by the rules every door applies."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
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
    p.add_argument("--group-size", type=int, help="one hit a document, with its best N chunks (group_by document_id)")
    p.add_argument("--highlight", type=int, metavar="N", help="each hit's best N sentences, with their offsets")
    p.add_argument("--neighbors", type=int, metavar="N", help="each hit's N chunks before and after, in its section")
    p.add_argument(
        "--paginate",
        action="store_true",
        help="pin the ranking and print the next page's token (kept in the user's cache folder, one file an index)",
    )
    p.add_argument(
        "--page-token", help="the next page of a --paginate search: the token it printed, same query and flags"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_settings(p, SEARCH)
    p.set_defaults(run=search, answers_queries=True)


def search(settings: Settings, args: argparse.Namespace) -> int:
    from engine.search import HybridEngine
    from engine.search.pages import ExpiredPageToken

    fields = {"query": args.query, "top_k": args.top_k, "similarity_threshold": args.similarity_threshold}
    weights = _weights(args.weights)
    try:
        limited = SearchRequest.limited(settings.serving.max_query_chars)
        controls = {"explain": args.explain, "fusion": {"weights": weights} if weights else None}
        if args.group_size is not None:
            controls |= {"group_by": "document_id", "group_size": args.group_size}
        if args.highlight is not None:
            controls["highlight"] = {"sentences": args.highlight}
        if args.neighbors is not None:
            controls["context"] = {"neighbors": args.neighbors}
        paged = args.paginate or args.page_token is not None
        if paged:
            controls |= {"paginate": True, "page_token": args.page_token}
        request = limited.model_validate(fields | controls | {"filters": _filters(args)})
    except ValidationError as exc:
        raise ValueError(as_flags(exc)) from None
    if paged:  # a later run reads the pin: kept on disk, not in this process
        settings = settings.with_values(page_pins_file=_pins_file(Path(settings.engine.index_dir)))
    engine = HybridEngine(settings.engine)
    options = engine.options_for(request)
    started = time.perf_counter()
    try:
        hits = engine.search(request.query, request.top_k, request.filters, request.similarity_threshold, options)
    except ExpiredPageToken as exc:  # said as the CLI says a bad argument
        raise ValueError(str(exc)) from None
    elapsed = time.perf_counter() - started
    retrievers = [name for name, retriever in engine.retrievers().items() if retriever is not None]
    if args.json:
        shown = [_as_json(hit, retrievers) for hit in hits]
        print(json.dumps({"results": shown, "next_page_token": hits.next_page_token} if paged else shown, indent=2))
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
    for rank, hit in enumerate(hits, start=1):
        if hit.group:
            console.print(f"[bold]{rank}. {hit.doc_id}[/] also: {', '.join(member.doc_id for member in hit.group)}")
        for found in hit.highlights or []:
            console.print(f"[bold]{rank}.[/] [{found.start}:{found.end}] {found.score:.3f} {found.text}")
    if engine.reranker is None:
        console.print("[yellow]no reranker: fused order shown[/]")
    if hits.next_page_token is not None:
        console.print(f"next page: --page-token {hits.next_page_token}", highlight=False, soft_wrap=True)
    return 0


def _pins_file(index_dir: Path) -> Path:
    """Where ``search --paginate`` pins the rankings of ``index_dir``: a file of the user's cache
    folder (made mode 0700, as the rankings are kept pickled) named by the index's resolved path, so
    that one index's token is foreign to another's."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid-search"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder / f"pages-{hashlib.sha256(str(index_dir.resolve()).encode()).hexdigest()[:16]}.sqlite"


def checked(name: str, value: object) -> object:
    """``value`` by the rule every search door applies to the field ``name``."""
    field = SearchRequest.model_fields[name]
    try:
        return TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
    except ValidationError as exc:
        raise ValueError(as_flags(exc, name)) from None


_FLAGS = {
    ("fusion", "weights"): "weights",
    ("highlight", "sentences"): "highlight",
    ("context", "neighbors"): "neighbors",
}


def as_flags(exc: ValidationError, field: str | None = None) -> str:
    """A search request's validation error in the CLI's words: ``--top-k: ...``, ``query: ...``."""
    named = []
    for error in exc.errors():
        where = [field, *error["loc"]] if field else list(error["loc"])
        for given, flag in _FLAGS.items():  # what --weights, --highlight, --neighbors give
            if where[:2] == list(given):
                where = [flag, *where[2:]]
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
    asked = ("found", "explanation", "group", "highlights", "context")
    shown = {k: v for k, v in hit.__dict__.items() if k not in asked}
    for name in retrievers:
        shown[f"{name}_rank"], shown[f"{name}_score"] = hit.found.get(name, (None, None))
    if hit.explanation is not None:
        shown["explanation"] = hit.explanation.model_dump(mode="json")
    if hit.group:
        shown["group"] = [_as_json(member, retrievers) for member in hit.group]
    if hit.highlights is not None:
        shown["highlights"] = [vars(found) for found in hit.highlights]
    if hit.context is not None:
        shown["context"] = {side: [c.unit_id for c in near] for side, near in zip(("before", "after"), hit.context)}
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
