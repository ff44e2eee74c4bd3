"""A sharded index on Ray against the same corpus in one index, on a local Ray cluster.

    python -m benchmarks.ray_shards --index-dir indexes/nfcorpus --sharded-dir indexes/nfcorpus-4

Both indexes must be of the same corpus (``build`` and ``build --shards N``). One JSON
(``benchmarks/results/<machine>/ray-shards.json``):

- ``same``: every dev query through each deployment's REST door against the same index searched in
  this process: identical rankings and the largest score difference;
- ``merge``: one client, p50/p95 of the REST door, the one index's Ray path (a search replica
  holding the index) against the sharded one (a search replica asking a deployment a shard and
  merging): what the merge costs. No reranker, so the two differ only in retrieval;
- ``kill``: four clients keep searching while one replica of shard 0 is killed (``ray.kill``;
  R = 2; ``--shard-failure fail``, so a shard missing would fail its request): failed requests;
- ``shard_down``: redeployed with ``--shard-failure partial``, every replica of shard 1 killed with
  its folder away (Serve cannot start another): a search's ``missing_shards`` and how long it took
  (``--shard-timeout``, asked twice), and ``/health``'s;
- ``writes``: documents through REST, each found by 20 searches in a row, and found in its own
  shard's store only.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks import options
from benchmarks.ray_scale import RayDeployment, _summary, closed_loop, one_client, same_answers
from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE, read_manifest, shard_dir, shard_of
from offline.dataset import load_dataset
from offline.records import write_result


def _deploy(ray: RayDeployment, args, failure: str = "fail") -> float:
    """``serve --ray``'s application on ``ray.settings``' index: one search replica, and a sharded
    index's shards ``args.shard_replicas`` times each (a shard down: ``failure``)."""
    from serving.ray_app import APP_NAME, application

    started = time.perf_counter()
    deployed = ray.settings.with_values(
        ray_search_replicas=(1, 1),
        ray_replica_cpus=args.replica_cpus,
        ray_shard_replicas=args.shard_replicas,
        ray_shard_failure=failure,
        ray_shard_timeout_s=args.shard_timeout,
    )
    ray.serve.run(application(deployed), name=APP_NAME, route_prefix="/")
    return round(time.perf_counter() - started, 1)


def shard_down(ray: RayDeployment, index: Path, shard: int) -> dict:
    """Every replica of ``shard`` killed while its folder is away (so Serve cannot start another),
    then one search and ``/health``."""
    from serving.ray_app import APP_NAME

    prefix = f"SERVE_REPLICA::{APP_NAME}#shard-{shard}#"
    names = [a["name"] for a in ray.ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    away = shard_dir(index, shard).with_name(f"{shard}.away")
    shard_dir(index, shard).rename(away)
    try:
        for name in names:
            ray.ray.kill(ray.ray.get_actor(name, namespace="serve"), no_restart=True)
        started = time.perf_counter()
        answer = httpx.post(ray.url + "/search", json={"query": "soy and breast cancer", "top_k": 10}, timeout=60)
        seconds = time.perf_counter() - started
        health = httpx.get(ray.url + "/health", timeout=60).json()
    finally:
        away.rename(shard_dir(index, shard))
    return {
        "replicas_killed": len(names),
        "status": answer.status_code,
        "missing_shards": answer.json().get("missing_shards"),
        "hits": len(answer.json().get("results", [])),
        "answered_in_s": round(seconds, 2),
        "health_status": health["status"],
        "health_missing_shards": health.get("missing_shards"),
    }


def writes_routed(url: str, index: Path, documents: int = 8, searches: int = 20) -> dict:
    shards = read_manifest(index).shards
    ids = [f"routed-{i}" for i in range(documents)]
    found_every_time = own_store_only = 0
    with httpx.Client(timeout=60) as http:
        for doc_id in ids:
            text = f"quokka marsupial routed probe {doc_id}"
            body = {"document_id": doc_id, "chunks": [{"chunk_id": "c", "content": text}]}
            http.post(f"{url}/documents?refresh=wait_for", json=body).raise_for_status()
            hits = [http.post(url + "/search", json={"query": text, "top_k": 3}).json() for _ in range(searches)]
            found_every_time += all(h["results"] and h["results"][0]["document_id"] == doc_id for h in hits)
            held = [DocStore(shard_dir(index, i) / DOCS_FILE).document(doc_id) is not None for i in range(shards)]
            own_store_only += held == [i == shard_of(doc_id, shards) for i in range(shards)]
    return {
        "documents": documents,
        "shards_written": len({shard_of(d, shards) for d in ids}),
        "found_by_every_search": found_every_time,
        "searches_each": searches,
        "in_their_shards_store_only": own_store_only,
    }


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__, *options.WHERE, output="{machine}/ray-shards.json")
    parser.add_argument("--sharded-dir", type=Path, required=True, help="the same corpus built with --shards N")
    parser.add_argument("--cpus", type=int, default=2, help="logical CPUs of the local Ray cluster (default 2)")
    parser.add_argument("--shard-replicas", type=int, default=2, help="replicas of each shard (default 2)")
    parser.add_argument("--replica-cpus", type=float, default=0.2, help="CPUs a replica reserves (default 0.2)")
    parser.add_argument("--queries", type=int, default=200, help="dev queries for the one-client timing")
    parser.add_argument("--seconds", type=float, default=20, help="seconds of load while a replica is killed")
    parser.add_argument("--shard-timeout", type=float, default=2.0, help="seconds a shard has to answer (default 2)")
    args, loaded = options.load(parser, argv)
    settings = loaded.with_values(device="cpu", rerank=False, rerank_cache_size=0)
    queries = list(load_dataset(args.data_dir).split_queries("dev").values())
    work = Path(tempfile.mkdtemp(prefix="ray-shards-"))
    report: dict = {"ray_cpus": args.cpus, "shard_replicas": args.shard_replicas, "replica_cpus": args.replica_cpus}
    ray = RayDeployment(settings, args.cpus)
    try:
        for name, source in (("one_index", args.index_dir), ("sharded", args.sharded_dir)):
            index = work / name
            shutil.copytree(source, index)  # writers change it
            ray.settings = ray.settings.with_values(index_dir=index)
            part = {
                "shards": read_manifest(index).shards,
                "deploy_seconds": _deploy(ray, args),
            }
            part["same"] = same_answers(ray.url, ray.settings.with_values(index_dir=source), queries)
            part["one_client"] = one_client(ray.url, queries[: args.queries])
            report[name] = part
            print(json.dumps({name: part}), flush=True)
        killer_report = {}
        run_started = time.perf_counter()

        def kill_later() -> None:
            time.sleep(args.seconds / 3)
            killer_report["killed"] = ray.kill_one("shard-0")
            killer_report["at_s"] = round(time.perf_counter() - run_started, 1)

        thread = threading.Thread(target=kill_later)
        thread.start()
        run = closed_loop(ray.url, queries, 4, args.seconds)
        thread.join()
        report["kill"] = {**_summary(run), **killer_report}
        print(json.dumps({"kill": report["kill"]}), flush=True)
        report["writes"] = writes_routed(ray.url, work / "sharded")
        print(json.dumps({"writes": report["writes"]}), flush=True)
        report["partial_deploy_seconds"] = _deploy(ray, args, "partial")
        report["shard_down"] = shard_down(ray, work / "sharded", 1)
        print(json.dumps({"shard_down": report["shard_down"]}), flush=True)
    finally:
        ray.close()
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.output, report, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
