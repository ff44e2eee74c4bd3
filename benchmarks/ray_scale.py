"""Serving on Ray against the single process, on a local Ray cluster.

    python -m benchmarks.ray_scale [--index-dir indexes/nfcorpus] [--cpus 4] [--seconds 30] [--skip PARTS]

Six measurements, one JSON (``benchmarks/results/<machine>/ray-scale.json``):

- ``same``: every dev query through the Ray deployment's REST door against the in-process engine
  with the same settings: rankings that match exactly, and the largest score difference;
- ``hop``: one client, the single process (``hybrid-search serve``) against Ray with one search and
  one reranker replica of 2 CPUs each (two threads each, as the single process has), p50/p95 of the
  REST door: what the Ray proxy and the reranker deployment's hop cost; and the single process's
  queries/s at 4 and 8 clients, the reference for the replicas;
- ``replicas``: queries/s and latency at 1, 4 and 8 closed-loop clients for several search and
  reranker replica counts (Ray gives a replica as many threads as the CPUs it reserves);
- ``kill``: clients keep searching while one search replica and then one reranker replica are
  killed (``ray.kill``): failed requests, and seconds until Serve has every replica running again;
- ``visible``: on a copy of the index, seconds from a write's acknowledgement until searches on
  both search replicas find it, with ``?refresh=wait_for`` and without;
- ``writer``: on that copy, the writer replica killed while clients send documents: acknowledged
  writes lost, writes refused while it restarts, and how long that took.

The deployments are ``serve --ray``'s, the writer deployment included (idle but for ``visible``).
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
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result
from offline.server_process import free_port, serve_args, start_server, stop_server
from serving.settings import Settings

SEARCH = "/search_nfcorpus"


def closed_loop(url: str, queries: list[str], clients: int, seconds: float) -> dict:
    """``clients`` threads, each sending the next query as soon as its last one answered, for
    ``seconds``; every request's (start offset, seconds, ok) is kept for timelines."""
    samples: list[tuple[float, float, bool]] = []
    stop = time.perf_counter() + seconds
    origin = time.perf_counter()
    lock = threading.Lock()

    def client(offset: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = offset
            while time.perf_counter() < stop:
                started = time.perf_counter()
                try:
                    ok = http.post(url + SEARCH, json={"query": queries[i % len(queries)], "top_k": 10}).status_code
                    ok = ok == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    samples.append((started - origin, time.perf_counter() - started, ok))
                i += clients

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - origin
    good = [s for _, s, ok in samples if ok]
    return {
        "clients": clients,
        "qps": round(len(good) / wall, 2),
        "errors": sum(not ok for *_, ok in samples),
        **{k: round(v, 1) for k, v in percentiles(good or [0.0]).items()},
        "samples": samples,
    }


def _summary(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "samples"}


class RayDeployment:
    """The application of ``serve --ray`` on a local cluster this process starts, redeployable with
    other replica counts."""

    def __init__(self, settings: Settings, cpus: int) -> None:
        import ray
        from ray import serve

        from serving.ray_app import A2A_PREFIX

        self.ray, self.serve = ray, serve
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings.with_values(public_url=f"{self.url}{A2A_PREFIX}/")

    def deploy(self, search: int, rerankers: int, replica_cpus: float) -> float:
        from serving.ray_app import APP_NAME, application

        started = time.perf_counter()
        settings = self.settings.with_values(
            ray_search_replicas=(search, search),
            ray_reranker_replicas=(rerankers, rerankers),
            ray_replica_cpus=replica_cpus,
        )
        self.serve.run(application(settings), name=APP_NAME, route_prefix="/")
        return time.perf_counter() - started

    def replicas_running(self) -> dict[str, int]:
        from serving.ray_app import APP_NAME

        deployments = self.serve.status().applications[APP_NAME].deployments
        return {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}

    def kill_one(self, deployment: str) -> str:
        from serving.ray_app import APP_NAME

        actors = self.ray.util.list_named_actors(all_namespaces=True)
        name = next(a["name"] for a in actors if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#{deployment}#"))
        self.ray.kill(self.ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def close(self) -> None:
        self.serve.shutdown()
        self.ray.shutdown()


def same_answers(url: str, settings: Settings, queries: list[str]) -> dict:
    """Every query through the deployment against the in-process engine (same settings)."""
    from engine.search import HybridEngine

    engine = HybridEngine(settings.engine)
    same, worst = 0, 0.0
    with httpx.Client(timeout=60) as http:
        for query in queries:
            served = http.post(url + SEARCH, json={"query": query, "top_k": 10}).json()["results"]
            local = engine.search(query, 10)
            same += [h["doc_id"] for h in served] == [h.doc_id for h in local]
            worst = max([worst, *(abs(a["score"] - b.score) for a, b in zip(served, local, strict=False))])
    engine.close()
    return {"queries": len(queries), "identical_rankings": same, "max_score_difference": worst}


def one_client(url: str, queries: list[str]) -> dict:
    """p50/p95 of searches one after another, and of ``/health`` (the door alone, no engine work)."""
    timings: dict[str, list[float]] = {"search": [], "health": []}
    with httpx.Client(timeout=60) as http:
        http.post(url + SEARCH, json={"query": queries[0], "top_k": 10})  # warm the connection
        for query in queries:
            for part, send in (
                ("search", lambda q=query: http.post(url + SEARCH, json={"query": q, "top_k": 10})),
                ("health", lambda: http.get(url + "/health")),
            ):
                started = time.perf_counter()
                send().raise_for_status()
                timings[part].append(time.perf_counter() - started)
    return {part: {k: round(v, 1) for k, v in percentiles(t).items()} for part, t in timings.items()}


def write_visibility(url: str, writes: int = 20, replicas: int = 2) -> dict:
    """Seconds from a write's acknowledgement until searches on every replica find it: ``wait``
    writes (answered once applied and checkpointed) and plain ones (applied at the next refresh):
    until the first of ``4 * replicas`` searches in a row that ranked it first was sent."""
    found: dict[str, list[float]] = {"wait_for": [], "no_wait": []}
    with httpx.Client(timeout=60) as http:
        for n in range(writes):
            for mode in found:
                text = f"zyzzogeton{n}{mode.replace('_', '')} lorem ipsum"
                document = {"document_id": f"visibility-{mode}-{n}", "chunks": [{"chunk_id": "c", "content": text}]}
                refresh = "?refresh=wait_for" if mode == "wait_for" else ""
                http.post(f"{url}/documents{refresh}", json=document).raise_for_status()
                acked, streak, since = time.perf_counter(), 0, 0.0
                while streak < 4 * replicas:
                    started = time.perf_counter()
                    hits = http.post(url + "/search", json={"query": text, "top_k": 1}).json()["results"]
                    if hits and hits[0]["text"] == text:
                        streak, since = streak + 1, since if streak else started
                    else:
                        streak = 0
                    if started - acked > 60:
                        raise RuntimeError(f"{document['document_id']} not visible after 60 s")
                found[mode].append(since - acked)
    return {mode: {k: round(v, 1) for k, v in percentiles(t).items()} for mode, t in found.items()}


def writer_killed(ray: RayDeployment, seconds: float = 30, clients: int = 2) -> dict:
    """Clients send documents (no wait) while the writer replica is killed a third of the way in;
    once Serve runs a writer again, every acknowledged document is read back: acknowledged writes
    lost (must be 0), writes refused meanwhile (503 + Retry-After), how long acknowledgements took
    (Serve holds a call while no writer runs), and the outage's length."""
    acked: list[str] = []
    acked_s: list[float] = []
    refused = other = 0
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(n: int) -> None:
        nonlocal refused, other
        with httpx.Client(timeout=60) as http:
            i = 0
            while time.perf_counter() < stop:
                doc_id, i = f"durable-{n}-{i}", i + 1
                body = {"document_id": doc_id, "chunks": [{"chunk_id": "c", "content": f"durability probe {doc_id}"}]}
                sent = time.perf_counter()
                try:
                    status = http.post(f"{ray.url}/documents", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                with lock:
                    if status in (200, 201):
                        acked.append(doc_id)
                        acked_s.append(time.perf_counter() - sent)
                    elif status == 503:
                        refused += 1
                    else:
                        other += 1
                if status == 503:
                    time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(seconds / 3)
    ray.kill_one("writer")
    killed = time.perf_counter()
    while ray.replicas_running().get("writer", 0) >= 1 and time.perf_counter() - killed < 15:
        time.sleep(0.1)
    while ray.replicas_running().get("writer", 0) < 1 and time.perf_counter() - killed < 180:
        time.sleep(0.1)
    back = time.perf_counter() - killed
    for thread in threads:
        thread.join()
    with httpx.Client(timeout=60) as http:
        lost = [d for d in acked if http.get(f"{ray.url}/documents/{d}").status_code != 200]
    return {
        "clients": clients,
        "seconds": seconds,
        "acknowledged": len(acked),
        "acknowledged_then_lost": len(lost),
        "refused_while_restarting": refused,
        "other_failures": other,
        "acknowledgement_ms": {k: round(v, 1) for k, v in percentiles(acked_s).items()}
        | {"max": round(max(acked_s) * 1000, 1)},
        "writer_running_again_after_s": round(back, 1),
    }


def killed_under_load(ray: RayDeployment, queries: list[str], clients: int, seconds: float) -> dict:
    """Kill one search replica at a quarter of the run and one reranker replica at its half."""
    events: dict = {}
    origin = time.perf_counter()

    def _wait_for(condition, limit_s: float) -> float:
        """Seconds since the run began when ``condition`` held (or ``limit_s`` passed)."""
        deadline = time.perf_counter() + limit_s
        while not condition() and time.perf_counter() < deadline:
            time.sleep(0.1)
        return time.perf_counter() - origin

    def killer() -> None:
        for deployment, at in (("search", seconds / 4), ("reranker", seconds / 2)):
            time.sleep(max(0.0, at - (time.perf_counter() - origin)))
            killed_at = time.perf_counter() - origin
            ray.kill_one(deployment)
            noticed = _wait_for(lambda d=deployment: ray.replicas_running()[d] < wanted[d], 15)
            _wait_for(lambda d=deployment: ray.replicas_running()[d] >= wanted[d], 120)
            events[deployment] = {
                "killed_at_s": round(killed_at, 1),
                "serve_noticed_after_s": round(noticed - killed_at, 1),
                "all_running_again_after_s": round(time.perf_counter() - origin - killed_at, 1),
            }

    wanted = ray.replicas_running()
    thread = threading.Thread(target=killer)
    thread.start()
    run = closed_loop(ray.url, queries, clients, seconds)
    thread.join()
    for event in events.values():
        start, end = event["killed_at_s"], event["killed_at_s"] + event["all_running_again_after_s"]
        failed = [t for t, _, ok in run["samples"] if not ok and start - 1 <= t <= end + 5]
        event["failed_requests_after_kill"] = len(failed)
    per_second: dict[int, list[int]] = {}
    for t, _, ok in run["samples"]:
        per_second.setdefault(int(t), [0, 0])[0 if ok else 1] += 1
    return {**_summary(run), "replicas": wanted, "events": events, "per_second_ok_failed": per_second}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__, *options.WHERE)
    parser.add_argument(
        "--cpus", type=int, default=4, help="logical CPUs of the local Ray cluster (default 4: two 2-CPU replicas)"
    )
    parser.add_argument("--seconds", type=float, default=30, help="seconds of load per measurement (default 30)")
    parser.add_argument("--hop-queries", type=int, default=60, help="one-client queries per side (default 60)")
    parser.add_argument("--same-queries", type=int, default=None, help="dev queries to compare (default all)")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to leave out: hop,same,replicas,kill,visible,writer"
    )
    parser.add_argument("--output", type=Path, help="results folder (default benchmarks/results/<machine>)")
    args, loaded = options.load(parser, argv)
    skip = set(filter(None, args.skip.split(",")))
    # no pair cache: the same queries come back between parts and would be answered from it
    settings = loaded.with_values(device="cpu", rerank_cache_size=0)
    queries = list(load_dataset(args.data_dir).split_queries("dev").values())
    report: dict = {"ray_cpus": args.cpus, "seconds": args.seconds}
    if "hop" not in skip:  # the single process first, alone on the machine
        port, log = free_port(), Path("/tmp/ray-scale-serve.log")
        served = serve_args(args.index_dir, port, "--read-only", "--rerank-cache-size", "0")
        proc = start_server(served, f"http://127.0.0.1:{port}/health", log)
        url = f"http://127.0.0.1:{port}"
        report["hop"] = {"single_process": one_client(url, queries[: args.hop_queries])}
        report["single_process"] = [_summary(closed_loop(url, queries, c, args.seconds)) for c in (4, 8)]
        print(json.dumps(report["hop"] | {"load": report["single_process"]}), flush=True)
        stop_server(proc)
    ray = RayDeployment(settings, args.cpus)
    try:
        report["deploy_seconds"] = round(ray.deploy(1, 1, 2.0), 1)
        if "hop" not in skip:
            report["hop"]["ray"] = one_client(ray.url, queries[: args.hop_queries])
            print(json.dumps(report["hop"]), flush=True)
        if "same" not in skip:
            report["same"] = same_answers(ray.url, settings, queries[: args.same_queries])
            print(json.dumps(report["same"]), flush=True)
        if "replicas" not in skip:
            report["replicas"] = []
            for search, rerankers, cpus in ((1, 1, 2.0), (1, 1, 1.0), (2, 1, 1.0), (1, 2, 1.0), (2, 2, 1.0)):
                ray.deploy(search, rerankers, cpus)
                for clients in (1, 4, 8):
                    run = _summary(closed_loop(ray.url, queries, clients, args.seconds))
                    report["replicas"].append({"search": search, "rerankers": rerankers, "cpus_each": cpus, **run})
                    print(json.dumps(report["replicas"][-1]), flush=True)
        if "kill" not in skip:
            ray.deploy(2, 2, 1.0)
            report["kill"] = killed_under_load(ray, queries, 4, max(args.seconds * 2, 60))
            print(json.dumps({k: v for k, v in report["kill"].items() if k != "per_second_ok_failed"}), flush=True)
        if {"visible", "writer"} - skip:  # on a copy: the writer deployment changes the index
            copy = Path(tempfile.mkdtemp(prefix="ray-scale-")) / "index"
            shutil.copytree(args.index_dir, copy)
            ray.settings = ray.settings.with_values(index_dir=copy)
            ray.deploy(2, 1, 1.0)
            if "visible" not in skip:
                report["visible"] = write_visibility(ray.url)
                print(json.dumps(report["visible"]), flush=True)
            if "writer" not in skip:
                report["writer_killed"] = writer_killed(ray)
                print(json.dumps(report["writer_killed"]), flush=True)
            shutil.rmtree(copy.parent, ignore_errors=True)
    finally:
        ray.close()
    out = (args.output or Path("benchmarks/results") / machine_name()) / "ray-scale.json"
    write_result(out, report, vars(args), update=True)  # parts skipped keep their last figures
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
