"""Commands that measure: evaluate (quality of every stage, or of a running agent) and bench (latency)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cli.flags import SEARCH, add_settings
from cli.query import checked
from engine.settings import EngineSettings
from engine.store.index_dir import REPORTS_DIR
from serving.settings import Settings

console = Console()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="quality of every stage on a split's judgments, or of a running agent")
    p.add_argument("--split", default="dev", help="judgments to score against (default dev)")
    p.add_argument("--num-queries", type=int, help="sample N judged queries (default: all; 100 with --agent-url)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed, as the evaluator's (default 42)")
    p.add_argument(
        "--output", type=Path, help="folder for run files and summary (default <index-dir>/reports/eval-<split>)"
    )
    g = p.add_argument_group("scoring a running A2A agent, as the benchmark's evaluator does")
    g.add_argument("--agent-url", help="A2A agent base URL, e.g. http://127.0.0.1:9010")
    g.add_argument("--top-k", type=int, default=5, help="documents asked for (default 5)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds per query (default 60)")
    add_settings(p, ["data_dir", *SEARCH])
    p.set_defaults(run=evaluate)

    p = sub.add_parser("bench", help="latency per stage in-process, or end to end through a front door")
    p.add_argument("target", choices=["engine", "rest", "mcp", "a2a"], help="engine = in-process per stage")
    p.add_argument("--url", help="front door URL, e.g. http://127.0.0.1:8000/search_nfcorpus, .../mcp, or the A2A root")
    p.add_argument("--num-queries", type=int, default=50, help="dev queries to send (default 50)")
    p.add_argument(
        "--depths",
        help="rerank depths, engine only; 0 = none (default 0,10,20,50,100,200 on CUDA, 0,10,20,30 on CPU)",
    )
    p.add_argument("--concurrency", default="1,8", help="concurrent clients to sweep, e.g. 1,8,32,64,128 (default 1,8)")
    p.add_argument(
        "--body",
        action="append",
        metavar="NAME=JSON",
        help="rest only, repeatable: also send each query with these fields added, timed apart under the same"
        """ load, e.g. highlight='{"highlight": {"sentences": 2}}' (the plain body is "none")""",
    )
    p.add_argument("--name", help="result file name (default: the target)")
    p.add_argument("--output", type=Path, help="results folder (default <index-dir>/reports/<machine>)")
    add_settings(p, ["data_dir", *SEARCH])
    p.set_defaults(run=bench, answers_queries=True)


def evaluate(settings: Settings, args: argparse.Namespace) -> int:
    from offline.dataset import load_dataset

    dataset = load_dataset(settings.build.data_dir)
    reports = Path(settings.engine.index_dir) / REPORTS_DIR
    if args.agent_url:
        from offline.agent_evaluation import evaluate_agent
        from offline.records import write_result

        checked("top_k", args.top_k)
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
    engine = HybridEngine(settings.engine)
    runs = stage_runs(engine, queries)
    report = {stage: evaluate_run(qrels, run) for stage, run in runs.items()}
    pairs = [(stage, stage.removesuffix("+rerank")) for stage in runs if stage.endswith("+rerank")]
    pairs += [(stage, "rrf") for stage in ("learned", "adapted") if stage in runs]
    gains = {f"{a} vs {b}": paired_test(qrels, runs[a], runs[b]) for a, b in pairs}
    out = args.output or reports / f"eval-{args.split}"
    out.mkdir(parents=True, exist_ok=True)
    for stage, run in runs.items():
        write_trec_run(out / f"run.{stage}.trec", run, stage)
    write_summary(
        out / "summary.json",
        {
            "split": args.split,
            "index": str(settings.engine.index_dir),
            "settings": search_settings(settings.engine, engine),
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


def bench(settings: Settings, args: argparse.Namespace) -> int:
    from offline.dataset import load_dataset
    from offline.door_load import bench_http
    from offline.latency import bench_engine, machine_name, save

    dataset = load_dataset(settings.build.data_dir)
    queries = list(dataset.split_queries("dev").values())[: args.num_queries]
    concurrency = _int_list(args.concurrency, "--concurrency")
    run = {"target": args.target, "queries": len(queries), "concurrency": concurrency}
    engine_settings = settings.engine
    if args.target == "engine":
        from engine.retrieval.encoder import pick_device
        from engine.search import HybridEngine

        default_depths = "0,10,20,50,100,200" if pick_device(engine_settings.device) == "cuda" else "0,10,20,30"
        depths = _int_list(args.depths or default_depths, "--depths")
        if max(depths) > 0 and engine_settings.reranker is None and not Path(engine_settings.reranker_path).is_dir():
            from engine.retrieval.encoder import resolve_model
            from index_build.train_reranker import TRAIN_MAX_LENGTH

            # latency does not depend on the weights: time an untrained MiniLM cross-encoder
            untrained = {
                "reranker": resolve_model(settings.build.encoder),
                "max_length": engine_settings.max_length or TRAIN_MAX_LENGTH,
            }
            engine_settings = engine_settings.model_copy(update=untrained)
        # no pair cache: each depth re-ranks the queries the shallower one did, and would read its scores
        engine = HybridEngine(engine_settings.model_copy(update={"rerank_cache_size": 0}))
        report = bench_engine(engine, queries, depths, concurrency)
        run |= search_settings(engine_settings, engine)
    else:
        if not args.url:
            raise ValueError(f"--url is required to benchmark the {args.target} front door")
        bodies = _bodies(args.body) if args.body else None
        report = bench_http(args.target, args.url, queries, concurrency, bodies=bodies)
        run["url"] = args.url
    out = args.output or Path(engine_settings.index_dir) / REPORTS_DIR / machine_name()
    path = save(report, args.name or args.target, out, run)
    console.print_json(json.dumps(report))
    console.print(f"saved {path} and its plot")
    return 0


def _bodies(given: list[str]) -> dict[str, dict]:
    """``--body NAME=JSON`` values, after the plain body ("none"), by name."""
    bodies: dict[str, dict] = {"none": {}}
    for value in given:
        name, _, text = value.partition("=")
        try:
            fields = json.loads(text)
        except json.JSONDecodeError:
            fields = None
        if not name or name in bodies or not isinstance(fields, dict):
            raise ValueError(f"--body takes NAME=JSON, a new name and a JSON object, got {value!r}")
        bodies[name] = fields
    return bodies


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{flag} takes non-negative integers, got {text!r}")
    return values


def search_settings(settings: EngineSettings, engine) -> dict:
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
