"""The serving path against a baseline commit, in one run on one machine: ``python -m
benchmarks.serving_speed --baseline DIR`` (DIR: a checkout of the baseline, e.g. ``git worktree add
/tmp/base e571f5f``, run with this environment's packages).

Each round starts the baseline's server and ours in turn on a copy of the index (the baseline on
its own, ``--baseline-index-dir``, when it cannot read ours) and sends the same
dev queries through the same client: REST without a reranker at 1, 8 and 64 clients; REST with the
reranker at depth 30 (pair cache off) at 8 and 64 clients; ours also through MCP and A2A at one client,
and again as ``serve --workers N`` for each N of ``--workers`` past 1 (side ``ours-workersN``). Then
``bench engine`` of the baseline and ours, each in its own process: per-stage p50 without and with the
reranker. Alternating the sides keeps the ratios fair when the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.settings import EngineSettings
from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.door_load import door_load
from offline.records import write_result
from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server, wait_until_up

BASE_CLI = [sys.executable, "-m", "serving.cli"]  # the entry point before the CLI moved to cli/


def side(name: str, baseline: Path) -> tuple[Path, list[str]]:
    return (baseline, BASE_CLI) if name == "baseline" else (ROOT, CLI)


def workers_flag(name: str) -> list[str]:
    """``ours-workers2`` serves with ``--workers 2``; the other sides with one process."""
    return ["--workers", name.removeprefix("ours-workers")] if name.startswith("ours-workers") else []


def served(name: str, baseline: Path, index: Path, queries: list[str], work: Path, extra: list[str], plan) -> dict:
    """Start one side's server with ``extra`` flags, run ``plan`` (door, concurrency) against it."""
    checkout, cli = side(name, baseline)
    port, a2a_port = free_port(), free_port()
    args = serve_args(index, port, *extra, a2a_port=a2a_port)
    proc = start_server(args, f"http://127.0.0.1:{port}/health", work / f"{name}.log", checkout=checkout, cli=cli)
    urls = {
        "rest": f"http://127.0.0.1:{port}/search_nfcorpus",
        "mcp": f"http://127.0.0.1:{port}/mcp",
        "a2a": f"http://127.0.0.1:{a2a_port}/",
    }
    try:
        wait_until_up(f"http://127.0.0.1:{a2a_port}/.well-known/agent-card.json")
        asyncio.run(door_load("rest", urls["rest"], queries[:20], 4, 5, 60))  # warm-up
        return {f"{door}@{c}": asyncio.run(door_load(door, urls[door], queries, c, 5, 120)) for door, c in plan}
    finally:
        stop_server(proc)


def engine_bench(name: str, baseline: Path, index: Path, data: Path, reranker: str, work: Path) -> dict:
    """``bench engine --depths 0,30`` of one side, in a process of its own."""
    checkout, cli = side(name, baseline)
    out = work / f"engine-{name}"
    args = ["bench", "engine", "--index-dir", str(index), "--data", str(data), "--device", "cpu"]
    args += ["--reranker", reranker, "--depths", "0,30", "--num-queries", "100", "--concurrency", "1,8"]
    args += ["--output", str(out), "--name", name]
    subprocess.run(
        cli + args,
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"},
        check=True,
        capture_output=True,
    )
    report = json.loads((out / f"{name}.json").read_text())
    per_stage = {d: {stage: round(v["p50"], 2) for stage, v in s.items()} for d, s in report["depths"].items()}
    concurrency = report["concurrency"]
    return {"p50_ms": per_stage, "qps_depth30": {c: round(v["qps"], 1) for c, v in concurrency.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline commit")
    parser.add_argument("--index-dir", type=Path, default=EngineSettings().index_dir)
    parser.add_argument(
        "--baseline-index-dir",
        type=Path,
        help="the index the baseline serves, when it cannot read ours (built by the baseline's own `build`);"
        " default: a copy of --index-dir",
    )
    parser.add_argument("--data", type=Path, default=BuildSettings().data_dir)
    parser.add_argument("--reranker", default="../shared/models/nfcorpus-reranker-cpu")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rerank-queries", type=int, default=150, help="queries of the runs with the reranker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", default="1", help="ours with each of these worker counts, e.g. 1,2")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/cpu-2core/serving-speed.json")
    args = parser.parse_args()
    queries = list(load_dataset(args.data).split_queries("dev").values())[: args.queries]
    reranker = str(Path(args.reranker).resolve())
    work = Path(tempfile.mkdtemp(prefix="serving-speed-"))
    indexes = {"ours": work / "index", "baseline": work / "index"}
    shutil.copytree(args.index_dir, indexes["ours"])
    if args.baseline_index_dir:
        indexes["baseline"] = work / "baseline-index"
        shutil.copytree(args.baseline_index_dir, indexes["baseline"])
    names = ["baseline", "ours"] + [f"ours-workers{n}" for n in args.workers.split(",") if int(n) > 1]
    runs: dict[str, list] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            index = indexes["baseline" if name == "baseline" else "ours"]
            plain = [("rest", 1), ("rest", 8), ("rest", 64)] + ([("mcp", 1), ("a2a", 1)] if name == "ours" else [])
            row = served(name, args.baseline, index, queries, work, ["--no-rerank", *workers_flag(name)], plain)
            deep = ["--reranker", reranker, "--rerank-depth", "30", "--rerank-cache-size", "0", *workers_flag(name)]
            deep_queries = queries[: args.rerank_queries]
            row |= {
                f"rerank30 {k}": v
                for k, v in served(
                    name, args.baseline, index, deep_queries, work, deep, [("rest", 8), ("rest", 64)]
                ).items()
            }
            if not name.startswith("ours-workers"):
                row["engine"] = engine_bench(name, args.baseline, index, args.data, reranker, work)
            runs[name].append(row)
            print(name, json.dumps(row), flush=True)
    result = {
        "baseline": str(args.baseline),
        "baseline_index": str(args.baseline_index_dir or args.index_dir),
        "queries": len(queries),
        "rerank_queries": min(len(queries), args.rerank_queries),
        "runs": runs,
    }
    print("saved", write_result(args.output, result))


if __name__ == "__main__":
    main()
