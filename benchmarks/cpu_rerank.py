"""CPU reranking variants side by side: speed per pair and per query, end to end, and dev quality.

    python -m benchmarks.cpu_rerank \\
        --variant teacher-128=indexes/nfcorpus/reranker:128 \\
        --variant teacher-96=indexes/nfcorpus/reranker:96 \\
        --variant teacher-96-int8=indexes/nfcorpus/reranker:int8:96 \\
        --variant L3-96=indexes/student/reranker

A variant is ``NAME=FOLDER[:int8][:MAX_LENGTH]`` (fp32 unless ``int8``; MAX_LENGTH by default the
served one: the trained length, at most 96 on a CPU); the first is the baseline every other one is
t-tested against (paired, per dev query, nDCG@10), so put today's served reranker first. Per
variant: the model's pairs/s and p50 milliseconds at rerank depth 10/20/30 (one query at a time,
as serving scores them), the rerank stage's p50 inside the engine at the configured depth, end to
end through the A2A door (a real ``serve`` process; one client, then four), and the served
pipeline's dev nDCG@10 and in-list NDCG@5. The pair cache is off throughout; ``--replay`` measures its hit rate
separately on one pass over every query in the dataset. Writes
``benchmarks/results/<machine>/cpu-rerank.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import options
from engine import threads
from engine.rerank.pair_cache import PairCache
from engine.search import HybridEngine
from engine.settings import EngineSettings
from offline.dataset import load_dataset
from offline.door_load import door_load
from offline.evaluation import continue_with_fused, evaluate_run, paired_test, sample_queries
from offline.progress import track
from offline.records import write_result
from offline.server_process import free_port, serve_args, start_server, stop_server, wait_until_up

DEPTHS = (10, 20, 30)
FLOP_LIMIT = "2 cores x 2 FMA x 8 fp32 lanes x 2 FLOP x ~2.5-3 GHz = 160-190 GFLOP/s"


@dataclass
class Variant:
    name: str
    folder: str
    quantize: str = "none"
    max_length: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, _, rest = spec.partition("=")
        folder, *options = rest.split(":")
        if not name or not folder:
            raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=FOLDER[:int8][:MAX_LENGTH]")
        variant = cls(name, folder)
        for option in options:
            if option == "int8":
                variant.quantize = "int8"
            elif option.isdigit():
                variant.max_length = int(option)
            else:
                raise argparse.ArgumentTypeError(f"{spec!r}: {option!r} is neither int8 nor a token count")
        return variant

    def flags(self) -> list[str]:
        """The same variant as ``serve`` flags."""
        length = ["--max-length", str(self.max_length)] if self.max_length else []
        return ["--reranker", self.folder, "--rerank-quantize", self.quantize, "--rerank-cache-size", "0", *length]


def measure(variant: Variant, args: argparse.Namespace, queries: dict[str, str], qrels) -> tuple[dict, dict]:
    """One variant's row, and its served dev run (for the t-test)."""
    settings = EngineSettings(
        index_dir=args.index_dir,
        device="cpu",
        reranker=variant.folder,
        rerank_quantize=variant.quantize,
        max_length=variant.max_length,
        rerank_cache_size=0,
    )
    engine = HybridEngine(settings)
    reranker = engine.reranker
    run, stage_s, timed = {}, [], {d: [] for d in DEPTHS}
    for i, (qid, text) in enumerate(track(queries.items(), f"{variant.name}: dev", "query")):
        result = engine.stages(text, top_k=1)
        fused = [d for d, _ in result.fused[:100]]
        run[qid] = continue_with_fused([d for d, _ in result.reranked], fused)
        stage_s.append(result.seconds["rerank"])
        if i < args.timed_queries:
            passages = engine.rerank_passages(text, fused[: max(DEPTHS)], reranker.memory_context, result.query_vector)
            for depth in DEPTHS:
                started = time.perf_counter()
                reranker.score(text, passages[:depth])
                timed[depth].append(time.perf_counter() - started)
    quality = evaluate_run(qrels, run)
    per_pair = {d: float(np.median(t)) * 1000 / d for d, t in timed.items()}
    row = {
        "variant": variant.name,
        "reranker": variant.folder,
        "layers": reranker.model.transformers_model.config.num_hidden_layers,
        "runtime": reranker.runtime,
        "max_length": reranker.max_length,
        "memory_context": reranker.memory_context,
        "pairs_per_s": round(1000 / per_pair[20], 1),
        "rerank_ms_p50": {str(d): round(float(np.median(t)) * 1000, 1) for d, t in timed.items()},
        "rerank_ms_per_pair_depth20": round(per_pair[20], 2),
        "rerank_stage_ms_p50": round(float(np.median(stage_s)) * 1000, 1),
        "rerank_depth": settings.rerank_depth_for("cpu"),
        "nDCG@10": quality["nDCG@10"],
        "in-list NDCG@5": quality["in-list NDCG@5"],
        "quality": quality,
    }
    del engine
    row["a2a"] = end_to_end(variant, args, list(queries.values())[: args.e2e_queries])
    return row, run


def end_to_end(variant: Variant, args: argparse.Namespace, texts: list[str]) -> dict:
    """``message/send`` through a real ``serve`` process: p50 with one client, and p50, p95 and
    queries/s with four (the admission limit: every slot busy, the cores shared)."""
    mcp_port, a2a_port = free_port(), free_port()
    log = Path(tempfile.mkdtemp(prefix="cpu-rerank-")) / "serve.log"
    proc = start_server(
        serve_args(args.index_dir, mcp_port, *variant.flags(), a2a_port=a2a_port),
        f"http://127.0.0.1:{mcp_port}/health",
        log,
    )
    try:
        url = f"http://127.0.0.1:{a2a_port}/"
        wait_until_up(url)
        asyncio.run(door_load("a2a", url, texts[:3], 1, 5, 60))  # warm-up
        one = asyncio.run(door_load("a2a", url, texts, 1, 5, 60))
        four = asyncio.run(door_load("a2a", url, texts, 4, 5, 60))
        if one["errors"] or four["errors"]:
            raise RuntimeError(f"{variant.name}: {one['errors'] + four['errors']} A2A requests failed; see {log}")
        return {
            "p50_ms_1_client": round(one["p50"], 1),
            "p50_ms_4_clients": round(four["p50"], 1),
            "p95_ms_4_clients": round(four["p95"], 1),
            "qps_4_clients": round(four["qps"], 2),
        }
    finally:
        stop_server(proc)


def replay_hit_rate(args: argparse.Namespace, dataset) -> dict:
    """The pair cache's hit rate over one pass of every query text in the dataset, in file order:
    the pairs the reranker would read at the CPU depth go through a real :class:`PairCache`."""
    engine = HybridEngine(EngineSettings(index_dir=args.index_dir, device="cpu", rerank=False))
    cache, depth = PairCache(20_000, 600), EngineSettings().rerank_depth_for("cpu")
    for text in track(dataset.queries.values(), "replay", "query"):
        ids = [d for d, _ in engine.stages(text, top_k=depth).fused[:depth]]
        cache.scores([(text, p) for p in engine.rerank_passages(text, ids, 5)], lambda todo: [0.0] * len(todo))
    return {
        "queries": len(dataset.queries),
        "pairs": cache.hits + cache.misses,
        "hits": cache.hits,
        "hit_rate": cache.hits / (cache.hits + cache.misses),
    }


def markdown(report: dict) -> str:
    """The README's table: one row a variant, the baseline first."""
    head = (
        "| variant | layers | tokens | runtime | pairs/s | model p50 ms at depth 10 / 20 / 30 | rerank stage p50"
        " | A2A p50, 1 client | A2A p50 / qps, 4 clients | dev nDCG@10 | in-list NDCG@5 | vs baseline (paired t) |\n"
        + "| --- " * 12
        + "|\n"
    )
    rows = []
    for r in report["variants"]:
        test = r.get("vs_baseline")
        versus = f"{test['gain']:+.4f}, p = {test['p_value']:.2f}" if test else "baseline"
        depths = " / ".join(f"{r['rerank_ms_p50'][str(d)]:.0f}" for d in DEPTHS)
        a2a = r["a2a"]
        rows.append(
            f"| {r['variant']} | {r['layers']} | {r['max_length']} | {r['runtime']} | {r['pairs_per_s']:.0f} | {depths}"
            f" | {r['rerank_stage_ms_p50']:.0f} ms | {a2a['p50_ms_1_client']:.0f} ms"
            f" | {a2a['p50_ms_4_clients']:.0f} ms / {a2a['qps_4_clients']:.2f} | {r['nDCG@10']:.4f}"
            f" | {r['in-list NDCG@5']:.4f} | {versus} |"
        )
    return head + "\n".join(rows)


def main() -> None:
    threads.for_queries()  # as `serve` runs: its A2A process and the in-process stage alike
    parser = options.parser(__doc__, *options.WHERE, split=True, num_queries=True, output="{machine}/cpu-rerank.json")
    parser.add_argument("--variant", type=Variant.parse, action="append", default=[], metavar="SPEC")
    parser.add_argument("--timed-queries", type=int, default=60, help="queries timed at each depth (default 60)")
    parser.add_argument("--e2e-queries", type=int, default=60, help="A2A requests per variant (default 60)")
    parser.add_argument("--replay", action="store_true", help="also measure the pair cache's hit rate")
    parser.add_argument("--table", type=Path, metavar="JSON", help="only print the markdown table of an earlier run")
    args, _ = options.load(parser)
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return
    if not args.variant:
        parser.error("give at least one --variant NAME=FOLDER[:int8][:MAX_LENGTH]")
    dataset = load_dataset(args.data_dir)
    queries, qrels = sample_queries(dataset.split_queries(args.split), args.num_queries, 42), dataset.qrels(args.split)
    rows, runs = [], []
    for variant in args.variant:
        row, run = measure(variant, args, queries, qrels)
        if runs:
            row["vs_baseline"] = paired_test(qrels, run, runs[0])
        rows.append(row)
        runs.append(run)
        print(json.dumps({k: v for k, v in row.items() if k != "quality"}), flush=True)
    report = {"split": args.split, "fp32_limit": FLOP_LIMIT, "baseline": rows[0]["variant"]}
    report["variants"] = rows
    if args.replay:
        report["cache_replay"] = replay_hit_rate(args, dataset)
    out = write_result(args.output, report, vars(args))
    print(markdown(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
