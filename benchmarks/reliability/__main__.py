"""Reliability on this machine: fuzz every door, load the three front doors past capacity, inject
faults; writes ``benchmarks/results/reliability.json`` (fuzz, load), ``reliability-load.png`` and
``reliability-faults.json``.

    python -m benchmarks.reliability                       # full size (about 40 minutes on 2 cores)
    python -m benchmarks.reliability --cases 100 --mcp-calls 300 --levels 1,8 --seconds 10 --rounds 3

Load and faults work on a copy of the index (``--index-dir``, default the NFCorpus build), never
the index itself; fuzzing on a small index of one-sentence NFCorpus records (see ``fuzz_index``).
The server under test is ``hybrid-search serve`` as a user starts it, plus ``--mcp-writes`` and a
high agent rate so the fuzz reaches the write tools and the message router instead of the rate
limiter; REST is fuzzed in-process through the same app, with every door keyed, so schemathesis
can check that auth is enforced where the OpenAPI document declares it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.reliability import faults, fuzz, load
from offline import server_process as server
from offline.records import write_result

RESULTS = Path("benchmarks/results")
log = logging.getLogger("benchmarks.reliability")
FAULTS_FILE = "reliability-faults.json"


@contextlib.contextmanager
def served(index: Path, work: Path, *extra: str) -> Iterator[dict[str, str]]:
    """``hybrid-search serve`` on free loopback ports until the block ends (SIGTERM)."""
    mcp, a2a = server.free_port(), server.free_port()
    args = server.serve_args(index, mcp, "--trace-db", str(work / "traces.sqlite"), *extra, a2a_port=a2a)
    proc = server.start_server(args, f"http://127.0.0.1:{mcp}/health", work / "serve.log")
    try:
        server.wait_until_up(f"http://127.0.0.1:{a2a}/")
        yield {"mcp": f"http://127.0.0.1:{mcp}", "a2a": f"http://127.0.0.1:{a2a}"}
    finally:
        server.stop_server(proc)


def fuzz_index(data_dir: Path, target: Path, documents: int = 300) -> Path:
    """The first ``documents`` NFCorpus records, each cut to its first sentence, RRF, no memory.

    Fuzzing tests input handling, which no corpus changes; but a schema-valid RAG turn or solver
    task with ``top_k`` 100 makes the extractive responder read 100 abstracts (~10 s), so at 1,000
    cases an operation the full corpus would take hours. One-sentence documents keep it minutes.
    """
    from dataclasses import replace

    from engine.settings import EngineSettings
    from engine.text import split_sentences
    from index_build.builder import build_index
    from index_build.corpus import beir_corpus
    from index_build.settings import BuildSettings
    from offline.dataset import Dataset, load_dataset

    full = load_dataset(data_dir)
    corpus = {
        doc.doc_id: replace(doc, text=(split_sentences(doc.text) or [doc.text])[0])
        for doc in list(full.corpus.values())[:documents]
    }
    engine = EngineSettings(index_dir=target, fusion="rrf", device="cpu")
    build_index(
        engine,
        BuildSettings(data_dir=data_dir, memory_split=None),
        beir_corpus(Dataset(full.root, corpus, {})),
        progress=False,
    )
    return target


def fuzz_all(index: Path, work: Path, cases: int, mcp_calls: int, at: int) -> dict:
    """Every door fuzzed; REST in-process (keyed), the rest through a served process."""
    from agents.messages import PAYLOADS
    from agents.system import SYSTEM_ID
    from serving.app import build_apps
    from serving.protocol_routes import hash_key
    from serving.settings import Settings

    key = secrets.token_urlsafe(24)
    keys = work / "agent-keys.toml"
    keys.write_text(
        f'[agents.{SYSTEM_ID}]\nkey_sha256 = "{hash_key(key)}"\nmessage_types = {json.dumps(sorted(PAYLOADS))}\n'
    )
    settings = Settings(
        index_dir=index,
        trace_db=work / "rest-traces.sqlite",
        agent_keys=keys,
        agent_rate="1000000/minute",
        key_all_doors=True,
        mcp_writes=True,
        max_queue_s=30,
    )
    service, apps = build_apps(settings, mcp=True, a2a=False, writable=True)
    try:
        report = {"rest": fuzz.fuzz_rest(apps["mcp"][0], cases, at, headers={"Authorization": f"Bearer {key}"})}
    finally:
        service.close()
    with served(
        index, work, "--mcp-writes", "--agent-rate", "1000000/minute", "--max-queue", "30", "--no-rerank"
    ) as urls:
        log.info("fuzzing mcp")
        report["mcp"] = fuzz.fuzz_mcp(urls["mcp"] + "/mcp", mcp_calls, at)
        log.info("fuzzing a2a_raw")
        report["a2a_raw"] = fuzz.fuzz_jsonrpc(urls["a2a"] + "/", mcp_calls, at)
        log.info("fuzzing a2a_client")
        report["a2a_client"] = fuzz.fuzz_a2a_client(urls["a2a"] + "/", max(1, mcp_calls // 10), at)
        log.info("fuzzing messages")
        report["messages"] = fuzz.fuzz_messages(urls["mcp"] + "/v1/messages", mcp_calls, at)
        log.info("fuzzing regex_bombs")
        report["regex_bombs"] = fuzz.regex_bombs(urls["mcp"] + "/api/a2a/purple-agent")
        report["health_after"] = httpx.get(urls["mcp"] + "/health", timeout=10).json()["status"]
    return report


def load_all(index: Path, work: Path, levels: list[int], seconds: int, data_dir: Path) -> dict:
    """The served defaults (reranker on) under 1 … N closed-loop users per door, asking the dev
    queries in turn."""
    from offline.dataset import load_dataset

    queries = work / "queries.txt"
    queries.write_text("\n".join(load_dataset(data_dir).split_queries("dev").values()) + "\n")
    with served(index, work) as urls:
        figures = load.run_load(urls, levels, seconds, queries, work / "locust")
        figures["health_after"] = httpx.get(urls["mcp"] + "/health", timeout=10).json()["status"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets/nfcorpus"), help="queries for the load")
    parser.add_argument("--cases", type=int, default=1000, help="schemathesis cases per REST operation")
    parser.add_argument("--mcp-calls", type=int, default=2000, help="MCP calls; also raw A2A and message cases")
    parser.add_argument("--levels", default="1,8,64,256", help="concurrent users per load level")
    parser.add_argument("--seconds", type=int, default=30, help="seconds per load level")
    parser.add_argument("--rounds", type=int, default=20, help="kill -9 rounds during ingestion")
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument("--parts", default="fuzz,load,faults", help="which parts to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "reliability.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parts = set(args.parts.split(","))
    report: dict = {}  # parts not run keep their last figures (write_result's update)
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        work = Path(tmp)
        index = work / "index"
        shutil.copytree(args.index_dir, index)
        if "fuzz" in parts:
            started = time.perf_counter()
            small = fuzz_index(args.data, work / "fuzz-index")
            report["fuzz"] = fuzz_all(small, work, args.cases, args.mcp_calls, args.seed)
            report["fuzz"]["seconds"] = round(time.perf_counter() - started)
            write_result(args.out, report, vars(args), update=True)
        if "load" in parts:
            levels = [int(n) for n in args.levels.split(",")]
            report["load"] = load_all(index, work, levels, args.seconds, args.data)
            load.plot(
                {k: v for k, v in report["load"].items() if k in load.DOORS}, args.out.with_name("reliability-load.png")
            )
            write_result(args.out, report, vars(args), update=True)
        if "faults" in parts:  # its own file, as `python -m benchmarks.reliability.faults` writes it
            figures = faults.run_faults(args.index_dir, work / "faults", args.rounds)
            write_result(args.out.with_name(FAULTS_FILE), figures, vars(args))
    print(json.dumps(summary(json.loads(args.out.read_text()) if args.out.is_file() else {}), indent=2))


def summary(report: dict) -> dict:
    """The README's table: cases per door, failures left, load held, faults survived, data lost."""
    fuzzed = report.get("fuzz", {})
    rest = fuzzed.get("rest", {})
    return {
        "rest_cases": sum(op["cases"] for op in rest.values()),
        "rest_failures": sum(len(op["failures"]) for op in rest.values()),
        **{
            f"{door}_cases": fuzzed[door].get("cases", fuzzed[door].get("calls"))
            for door in ("mcp", "a2a_raw", "a2a_client", "messages")
            if door in fuzzed
        },
        **{
            f"{door}_failures": len(fuzzed[door]["failures"])
            for door in ("mcp", "a2a_raw", "a2a_client", "messages")
            if door in fuzzed
        },
    }


if __name__ == "__main__":
    main()
