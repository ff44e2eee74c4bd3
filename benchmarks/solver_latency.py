"""Latency of the benchmark solver endpoint, with and without a long history.

    python -m benchmarks.solver_latency --url http://127.0.0.1:8000 --tasks 30

Each dev query becomes a task (under a deny-dosing policy); the long-history run sends 20 earlier
turns, so compression runs every time. One client, p50/p95 in ms. Writes
``benchmarks/results/<machine>/solver-latency.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result

POLICY = {"rules": [{"id": "r1", "type": "deny", "keywords": ["dose", "dosage"], "pattern": r"mg\s*/\s*day"}]}


def run(url: str, tasks: list[str], history: list[dict]) -> dict:
    times = []
    with httpx.Client(timeout=120) as client:
        for i, task in enumerate(tasks):
            body = {"task_id": f"t{i}", "task": task, "policy_doc": POLICY, "history": history}
            started = time.perf_counter()
            client.post(f"{url}/api/a2a/purple-agent", json=body).raise_for_status()
            times.append(time.perf_counter() - started)
    return {"history_turns": len(history), "latency_ms": percentiles(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--tasks", type=int, default=30)
    args = parser.parse_args()
    queries = list(load_dataset(BuildSettings().data_dir).split_queries("dev").values())
    tasks = queries[: args.tasks]
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": q} for i, q in enumerate(queries[-20:])]
    report = {
        "tasks": len(tasks),
        "runs": [run(args.url.rstrip("/"), tasks, []), run(args.url.rstrip("/"), tasks, history)],
    }
    write_result(Path("benchmarks/results") / machine_name() / "solver-latency.json", report, vars(args))
    print(json.dumps(report["runs"], indent=2))


if __name__ == "__main__":
    main()
