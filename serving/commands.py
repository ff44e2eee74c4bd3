"""What each ``hybrid-search`` subcommand does; the parser lives in :mod:`serving.cli`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Annotated

from rich.console import Console
from rich.table import Table

from engine.config import Settings
from engine.documents import SearchRequest
from engine.store.index_dir import FUSION_DIR, MANIFEST_FILE, REPORTS_DIR

console = Console()


def build(settings: Settings, args: argparse.Namespace) -> int:
    from index_build.builder import build_index
    from index_build.corpus import open_corpus

    started = time.perf_counter()
    if args.ray:
        _ray_app()  # Ray installed, or a clear error before any work
    corpus = open_corpus(settings.data_dir, settings.chunk_words, settings.chunk_overlap_words)
    for name, why in corpus.skipped:
        print(f"hybrid-search: skipped {name}: {why}", file=sys.stderr)
    manifest = build_index(settings, corpus, on_ray=args.ray)
    fusion = "learned fusion" if (Path(settings.index_dir) / FUSION_DIR).is_dir() else "RRF only"
    read = f"{corpus.files} files, {len(corpus.skipped)} skipped; " if corpus.dataset is None else ""
    console.print(
        f"built [bold]{settings.index_dir}[/]: {read}{manifest.documents} documents ({corpus.chunks} chunks),"
        f" encoder {manifest.encoder} ({manifest.dimension}-d, {manifest.dense_index}), {fusion},"
        f" {time.perf_counter() - started:.0f} s"
    )
    if getattr(args, "distil_from", None):  # serve --build-if-missing has no --distil-from
        from index_build.train_reranker import STUDENT_MAX_LENGTH, student_options, train

        card = train(
            settings.model_copy(update={"max_length": settings.max_length or STUDENT_MAX_LENGTH}),
            student_options(args.distil_from, args.distil_steps),
        )
        console.print(
            f"student reranker in {settings.index_dir}/reranker: {card['layers']} layers, dev nDCG@10"
            f" {card['dev_reranked']['nDCG@10']:.4f} (fused {card['dev_fused']['nDCG@10']:.4f})"
        )
    return 0


def search(settings: Settings, args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engine.search import HybridEngine

    fields = {"query": args.query, "top_k": args.top_k, "similarity_threshold": args.similarity_threshold}
    try:
        request = SearchRequest.limited(settings.max_query_chars).model_validate(fields | {"filters": _filters(args)})
    except ValidationError as exc:
        raise ValueError(_as_flags(exc)) from None
    engine = HybridEngine(settings)
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


def evaluate(settings: Settings, args: argparse.Namespace) -> int:
    from offline.dataset import load_dataset

    dataset = load_dataset(settings.data_dir)
    reports = Path(settings.index_dir) / REPORTS_DIR
    if args.agent_url:
        from agents.evaluator import evaluate_agent
        from offline.records import write_result

        _checked("top_k", args.top_k)
        report = evaluate_agent(
            args.agent_url, dataset, args.split, args.num_queries or 100, args.seed, args.top_k, args.timeout
        )
        console.print_json(json.dumps(report))
        path = write_result((args.output or reports / f"agent-eval-{args.split}") / "agent-eval.json", report)
        console.print(f"saved {path}")
        return 0 if report["failures"] == 0 else 1
    from engine.search import HybridEngine
    from offline.evaluation import evaluate_run, paired_test, sample_queries, stage_runs, write_summary, write_trec_run

    qrels = dataset.qrels(args.split)
    queries = sample_queries(dataset.split_queries(args.split), args.num_queries, args.seed)
    engine = HybridEngine(settings)
    runs = stage_runs(engine, queries)
    report = {stage: evaluate_run(qrels, run) for stage, run in runs.items()}
    pairs = [(stage, stage.removesuffix("+rerank")) for stage in runs if stage.endswith("+rerank")]
    if "learned" in runs:
        pairs.append(("learned", "rrf"))
    gains = {f"{a} vs {b}": paired_test(qrels, runs[a], runs[b]) for a, b in pairs}
    out = args.output or reports / f"eval-{args.split}"
    out.mkdir(parents=True, exist_ok=True)
    for stage, run in runs.items():
        write_trec_run(out / f"run.{stage}.trec", run, stage)
    write_summary(
        out / "summary.json",
        {
            "split": args.split,
            "index": str(settings.index_dir),
            "settings": _search_settings(settings, engine),
            "stages": report,
            "gain_ndcg@10": gains,
        },
    )
    table = Table(title=f"{args.split}: {len(queries)} queries")
    columns = ["nDCG@5", "nDCG@10", "Recall@100", "MRR@10", "in-list NDCG@5"]
    table.add_column("stage")
    for column in columns:
        table.add_column(column, justify="right")
    for stage, metrics in report.items():
        table.add_row(stage, *(f"{metrics[c]:.4f}" for c in columns))
    console.print(table)
    for pair, test in gains.items():
        console.print(f"{pair}: nDCG@10 {test['gain']:+.4f} (paired t-test p = {test['p_value']:.3g})")
    console.print(f"runs and summary in {out}")
    return 0


def train_reranker(settings: Settings, args: argparse.Namespace) -> int:
    from index_build.train_reranker import TrainOptions, train

    options = TrainOptions(
        base=args.base or args.distil_from or settings.encoder,
        split=args.split,
        max_steps=args.max_steps,
        queries=args.queries,
        batch_queries=args.batch_queries,
        group_size=args.group_size,
        mine_depth=args.mine_depth,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_queries=args.eval_queries,
        freeze_layers=args.freeze_layers,
        seed=args.seed,
        loss=args.loss,
        memory_context=args.memory_context,
        distil_from=args.distil_from,
        distil_weight=args.distil_weight,
        student_layers=args.student_layers,
    )
    card = train(settings, options, dataset=_judgments(settings, args))
    console.print_json(json.dumps(card))
    return 0


def train_fusion(settings: Settings, args: argparse.Namespace) -> int:
    from index_build.train_fusion import train_fusion as train

    card = train(settings, _judgments(settings, args), queries=args.queries, seed=args.seed)
    console.print_json(json.dumps(card))
    return 0


def _judgments(settings: Settings, args: argparse.Namespace):
    """``--judgments DIR`` for an index built from files (its chunks are the corpus), else None: the
    BEIR dataset in --data."""
    if args.judgments is None:
        return None
    from index_build.corpus import index_dataset

    return index_dataset(settings.index_dir, args.judgments)


def serve(settings: Settings, args: argparse.Namespace) -> int:
    from serving.app import run_servers

    if args.no_mcp and args.no_a2a:
        raise ValueError("--no-mcp and --no-a2a together leave nothing to serve")
    if args.ray and (args.no_mcp or args.no_a2a or args.mcp_url):
        raise ValueError("--ray serves MCP + REST and A2A on one port; leave out --no-mcp, --no-a2a and --mcp-url")
    if args.ray and settings.tls_cert is not None:
        raise ValueError("--ray serves through Ray Serve's proxy, which has no TLS here: terminate TLS in front of it")
    if args.build_if_missing and not (Path(settings.index_dir) / MANIFEST_FILE).is_file():
        build(settings, args)
    if args.ray:
        _ray_app().run_on_ray(settings, writable=not args.read_only)
        return 0
    run_servers(settings, mcp=not args.no_mcp, a2a=not args.no_a2a, mcp_url=args.mcp_url, writable=not args.read_only)
    return 0


def init(settings: Settings, args: argparse.Namespace) -> int:
    """An empty index to ingest into or serve (POST /documents); never over an existing one."""
    from index_build.builder import build_index
    from index_build.corpus import empty_corpus

    if (Path(settings.index_dir) / MANIFEST_FILE).is_file():
        raise ValueError(f"{settings.index_dir} already holds an index; `ingest` adds to it, `build` replaces it")
    manifest = build_index(settings, empty_corpus(), progress=False)
    console.print(
        f"made an empty index in [bold]{settings.index_dir}[/] (encoder {manifest.encoder}): add documents with"
        f" `hybrid-search ingest FILES --index-dir {settings.index_dir}` or POST /documents while it serves"
    )
    return 0


def ingest(settings: Settings, args: argparse.Namespace) -> int:
    """Read and validate each file whole, then log its documents; one bad file adds nothing. A
    folder that holds no index yet gets an empty one first."""
    from engine.search import HybridEngine
    from index_build.ingest import IngestError, read_documents
    from offline.progress import track

    if not Path(settings.index_dir).exists():
        init(settings, args)
    engine = HybridEngine(settings.model_copy(update={"rerank": False}), writable=True)
    added = chunks = failed = 0
    started = time.perf_counter()
    try:
        for path in track(args.paths, "ingesting", "file"):
            try:
                documents = read_documents(path, settings.chunk_words, settings.chunk_overlap_words)
            except IngestError as exc:
                print(f"hybrid-search: skipped {exc}", file=sys.stderr)
                failed += 1
                continue
            for document in documents:
                chunks += engine.live.upsert(document)["chunks"]
            added += len(documents)
        engine.live.refresh()
    finally:
        engine.close()
    seconds = time.perf_counter() - started
    skipped = f"; {failed} file{'s' * (failed > 1)} skipped (see above)" if failed else ""
    print(f"added {added} documents ({chunks} chunks) to {settings.index_dir} in {seconds:.1f} s{skipped}")
    return 1 if failed else 0


def compact(settings: Settings, args: argparse.Namespace) -> int:
    """Apply and checkpoint every logged write, so the log is empty and readers can open the index."""
    from engine.search import HybridEngine

    engine = HybridEngine(settings.model_copy(update={"rerank": False}), writable=True)
    recovered = engine.live.recovery
    result = engine.live.checkpoint()
    engine.close()
    print(
        f"checkpointed {settings.index_dir} at write {result['seq']}: replayed {recovered['records']}"
        f" logged writes, emptied {result['log_bytes']:,} bytes of log in {result['seconds']:.2f} s"
    )
    return 0


def mcp_stdio(settings: Settings, args: argparse.Namespace) -> int:
    from serving.mcp_tool import run_stdio

    run_stdio(settings)
    return 0


def bench(settings: Settings, args: argparse.Namespace) -> int:
    from agents.door_load import bench_http
    from offline.dataset import load_dataset
    from offline.latency import bench_engine, machine_name, save

    dataset = load_dataset(settings.data_dir)
    queries = list(dataset.split_queries("dev").values())[: args.num_queries]
    concurrency = _int_list(args.concurrency, "--concurrency")
    run = {"target": args.target, "queries": len(queries), "concurrency": concurrency}
    if args.target == "engine":
        from engine.retrieval.encoder import pick_device
        from engine.search import HybridEngine

        default_depths = "0,10,20,50,100,200" if pick_device(settings.device) == "cuda" else "0,10,20,30"
        depths = _int_list(args.depths or default_depths, "--depths")
        if max(depths) > 0 and settings.reranker is None and not Path(settings.reranker_path).is_dir():
            from engine.retrieval.encoder import resolve_model
            from index_build.train_reranker import TRAIN_MAX_LENGTH

            # latency does not depend on the weights: time an untrained MiniLM cross-encoder
            untrained = {
                "reranker": resolve_model(settings.encoder),
                "max_length": settings.max_length or TRAIN_MAX_LENGTH,
            }
            settings = settings.model_copy(update=untrained)
        # no pair cache: each depth re-ranks the queries the shallower one did, and would read its scores
        engine = HybridEngine(settings.model_copy(update={"rerank_cache_size": 0}))
        report = bench_engine(engine, queries, depths, concurrency)
        run |= _search_settings(settings, engine)
    else:
        if not args.url:
            raise ValueError(f"--url is required to benchmark the {args.target} front door")
        report = bench_http(args.target, args.url, queries, concurrency)
        run["url"] = args.url
    out = args.output or Path(settings.index_dir) / REPORTS_DIR / machine_name()
    path = save(report, args.name or args.target, out, run)
    console.print_json(json.dumps(report))
    console.print(f"saved {path} and its plot")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{flag} takes non-negative integers, got {text!r}")
    return values


def _checked(name: str, value: object) -> object:
    """``value`` by the rule every search door applies to the field ``name``."""
    from pydantic import TypeAdapter, ValidationError

    field = SearchRequest.model_fields[name]
    try:
        return TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
    except ValidationError as exc:
        raise ValueError(_as_flags(exc, name)) from None


def _as_flags(exc, field: str | None = None) -> str:
    """A search request's validation error in the CLI's words: ``--top-k: ...``, ``query: ...``."""
    named = []
    for error in exc.errors():
        where = [field, *error["loc"]] if field else list(error["loc"])
        flag = "query" if where[0] == "query" else "--" + str(where[0]).replace("_", "-")
        named.append(".".join([flag, *map(str, where[1:])]) + f": {error['msg']}")
    return "; ".join(named)


def schemas(settings: Settings, args: argparse.Namespace) -> int:
    """Write the JSON Schema of every agent-protocol message into a folder (or print them)."""
    from agents.messages import schemas as all_schemas

    found = all_schemas()
    if args.out is None:
        print(json.dumps(found, indent=2))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, schema in found.items():
        (args.out / f"{name}.schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote {len(found)} schemas to {args.out}")
    return 0


def agent_key(settings: Settings, args: argparse.Namespace) -> int:
    """A new random key for an agent: the key once, and the hashed entry for the keys file."""
    import secrets

    from serving.protocol_routes import hash_key

    key = "hsk-" + secrets.token_urlsafe(32)
    types = ", ".join(json.dumps(t) for t in args.types.split(",") if t)
    print(f"# key for {args.agent_id} (shown once; send it as 'Authorization: Bearer <key>'):\n# {key}")
    print(f'[agents.{args.agent_id}]\nkey_sha256 = "{hash_key(key)}"\nmessage_types = [{types}]')
    if args.rate:
        print(f'rate = "{args.rate}"')
    return 0


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


def _search_settings(settings: Settings, engine) -> dict:
    """The settings a run was made with, reranking as the engine resolved it."""
    keys = (
        "bm25_depth",
        "dense_depth",
        "rrf_k",
        "bm25_weight",
        "dense_weight",
        "memory",
        "memory_weight",
        "memory_neighbors",
        "fusion",
        "rerank",
    )
    return {k: getattr(settings, k) for k in keys} | engine.describe()


def _ray_app():
    """:mod:`serving.ray_app`, or a clear error when the optional Ray extra is not installed."""
    try:
        from serving import ray_app
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("ray"):
            raise
        raise RuntimeError("--ray needs Ray: pip install 'hybrid-search[ray]'") from None
    return ray_app
