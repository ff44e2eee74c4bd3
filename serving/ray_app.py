"""``hybrid-search serve --ray``: the same doors and answers, on a Ray Serve cluster.

Deployments behind Serve's HTTP proxy (one port):

- ``SearchReplica``, the ingress: the MCP + REST doors at ``/`` and the A2A agent at ``/a2a/``,
  each replica with a read-only engine of its own (BM25, dense, judgment memory, fusion: a query's
  CPU work, docs/ray.md). Retrieval stays beside the doors so that candidates and their texts never
  cross the wire; the replicas are stateless (MCP runs stateless), so any replica answers any request.
- ``RerankerReplica``: the cross-encoder, on a GPU when the cluster has one, scoring the queries of
  every search replica together with ``@serve.batch`` (the cross-request batching that
  :class:`engine.rerank.batching.RerankBatcher` does inside one process);
- ``PagesReplica``: the rankings pinned for their next pages, which every search replica keeps
  and reads there, so that any replica answers a page token another made;
- ``WriterReplica`` (unless ``--read-only``): the index's one writer. The doors send it every
  write; it checkpoints after each refresh, and each search replica shows the newest checkpoint
  before it searches (:mod:`engine.live.follower`): a write is visible on every replica within the
  refresh interval, and at once when it was sent with ``wait``.

Over a sharded index (``build --shards N``) the search replicas hold no BM25, dense index or
store: each shard is a deployment of its own (``ShardReplica``, ``--shard-replicas`` of them, which
Serve spreads over the nodes), with its own writer, and a search replica asks every shard and
merges (:mod:`engine.shards`), running the memory, the fusion and the reranker once on the merged
candidates. A write goes to the writer of its document's shard (:class:`engine.shards.writes.ShardedWriter`).

The deployments that hold no door live in :mod:`serving.ray_replicas`, so that their processes never
import the doors. Index directories are read from the same path on every node (a shared disk). Ray
is an optional extra (``pip install 'hybrid-search[ray]'``): nothing else imports these modules.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.retrieval.java import jvm_signals_kept
from engine.search import HybridEngine
from engine.search.opening import Remotes
from engine.shards.opened import SHARD_ONLY
from engine.shards.writes import ShardedWriter
from engine.store.index_dir import read_manifest, shard_dir
from serving.app import RequestLog, build_apps
from serving.asgi import one_port
from serving.ray_replicas import PagesReplica, RerankerReplica, ShardReplica, WriterReplica
from serving.remotes import RemotePins, RemoteReranker, RemoteShards, RemoteWriter, RerankerCalls
from serving.search_service import SearchService
from serving.settings import Settings
from serving.signals import sleep_until
from serving.transport import RayTransport

log = logging.getLogger(__name__)
APP_NAME = "hybrid-search"
A2A_PREFIX = "/a2a"


@serve.deployment(name="search")
@serve.ingress()
class SearchReplica:
    """The doors and retrieval; reranking through the reranker deployment when there is one. Over a
    sharded index, retrieval asks the shard deployments and merges (the judgment memory and the
    fusion run here, on the merged candidates)."""

    def __init__(
        self,
        settings: Settings,
        reranker: DeploymentHandle | None,
        writer: DeploymentHandle | None,
        pages: DeploymentHandle,
        shards: list[DeploymentHandle] | None = None,
        writers: list[DeploymentHandle] | None = None,
    ) -> None:
        self.settings = settings
        # Serve runs constructors on the replica's event loop, where a handle's answer cannot be
        # waited for; the engine (which asks the reranker what it reads) is built on a thread
        with ThreadPoolExecutor(1) as pool:
            self.service = pool.submit(self._service, settings, reranker, writer, pages, shards, writers).result()

    @staticmethod
    def _service(
        settings: Settings,
        reranker: DeploymentHandle | None,
        writer: DeploymentHandle | None,
        pages: DeploymentHandle,
        shards: list[DeploymentHandle] | None,
        writers: list[DeploymentHandle] | None,
    ):
        timeout = settings.serving.query_timeout_s
        remote = None
        if reranker is not None:
            deployment = RayTransport(reranker, "the reranker deployment")
            described = deployment.call(RerankerCalls.describe.__name__, timeout_s=timeout)
            remote = RemoteReranker(deployment, described, settings.engine, timeout)
        follow = RemoteWriter(RayTransport(writer, "writer"), timeout) if writer is not None else None
        sharded = None
        if shards:
            out = settings.scale_out
            named = [RayTransport(h, f"shard {i}") for i, h in enumerate(shards)]
            sharded = RemoteShards(named, out.ray_shard_timeout_s, out.ray_shard_failure == "partial")
            if writers:
                named = [RayTransport(h, f"writer of shard {i}") for i, h in enumerate(writers)]
                follow = ShardedWriter([RemoteWriter(t, timeout) for t in named])
        pins = RemotePins(RayTransport(pages, "pages"), timeout)
        remotes = Remotes(writer=follow, shards=sharded, pins=pins)
        return SearchService(settings, HybridEngine(settings.engine, reranker=remote, remotes=remotes))

    def __serve_build_asgi_app__(self):
        _, apps = build_apps(self.settings, service=self.service)
        prefixes = {"mcp": "", "a2a": A2A_PREFIX}
        return one_port({prefixes[door]: RequestLog(app, door) for door, (app, _) in apps.items()})

    def __del__(self) -> None:
        service = getattr(self, "service", None)  # absent when the constructor failed
        if service is not None:
            service.close()
            service.engine.close()


def _deployment_options(bounds: tuple[int, int], cpus: float, gpus: float = 0.0) -> dict:
    low, high = bounds
    scale = (
        {"num_replicas": low} if low == high else {"autoscaling_config": {"min_replicas": low, "max_replicas": high}}
    )
    return {**scale, "ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus}}


def application(settings: Settings, gpus: float = 0.0, writable: bool = True):
    """The Serve application: search replicas, a reranker deployment when the index has a reranker
    (on ``gpus`` GPUs a replica), and the one writer unless read-only."""
    search_settings = settings.with_values(device="cpu")
    reranker = None
    if settings.engine.reranker_wanted:
        device = "cuda" if gpus else "cpu"
        options = _deployment_options(
            settings.scale_out.ray_reranker_replicas, settings.scale_out.ray_replica_cpus, gpus
        )
        reranker = RerankerReplica.options(**options).bind(settings, device)
    options = _deployment_options(settings.scale_out.ray_search_replicas, settings.scale_out.ray_replica_cpus)
    pages = PagesReplica.options(ray_actor_options={"num_cpus": 0}).bind(search_settings)
    shards = read_manifest(settings.engine.index_dir).shards
    if shards:
        return SearchReplica.options(**options).bind(
            search_settings, reranker, None, pages, *_shards(search_settings, shards, writable)
        )
    writer = WriterReplica.options(ray_actor_options={"num_cpus": 0}).bind(search_settings) if writable else None
    return SearchReplica.options(**options).bind(search_settings, reranker, writer, pages)


def build_app(args: dict[str, str]):
    """The application for a cluster that runs already: ``serve run serving.ray_app:build_app
    index_dir=...`` or a KubeRay RayService (``import_path`` in its ``serveConfigV2``, with these
    ``args``; docs/kuberay-rayservice.yaml). ``args``: settings by their flat names, over the
    environment's (``HYBRID_SEARCH_*``); with ``device: cuda`` each reranker replica takes a GPU."""
    settings = Settings().with_values(**args)
    read_manifest(settings.engine.index_dir)  # a missing index fails here, not in every replica
    gpus = 1.0 if settings.engine.device == "cuda" else 0.0
    return application(settings, gpus, writable=not settings.serving.read_only)


def _shards(settings: Settings, shards: int, writable: bool) -> tuple[list, list]:
    """A deployment a shard (its replicas spread over the cluster's nodes by Serve) and, unless
    read-only, its writer."""
    index_dir = settings.engine.index_dir
    replicas = {"num_replicas": settings.scale_out.ray_shard_replicas}
    cpus = {"num_cpus": settings.scale_out.ray_replica_cpus}
    writers = (
        [
            WriterReplica.options(name=f"writer-{i}", ray_actor_options={"num_cpus": 0}).bind(
                settings.with_values(index_dir=shard_dir(index_dir, i), **SHARD_ONLY)
            )
            for i in range(shards)
        ]
        if writable
        else []
    )
    deployed = [
        ShardReplica.options(name=f"shard-{i}", ray_actor_options=cpus, **replicas).bind(
            settings, i, writers[i] if writable else None
        )
        for i in range(shards)
    ]
    return deployed, writers


def _check_fits(settings: Settings, resources: dict, gpus: float, local: bool) -> None:
    """Refuse, before deploying, what the cluster cannot place (Serve would wait for it forever):
    on a local cluster the CPUs; on any cluster the GPUs the reranker replicas ask for."""
    ray = settings.scale_out
    shards = ray.ray_shard_replicas * read_manifest(settings.engine.index_dir).shards
    cpus = ray.ray_replica_cpus * (ray.ray_search_replicas[0] + ray.ray_reranker_replicas[0] + shards)
    if local and cpus > resources.get("CPU", 0):
        raise RuntimeError(
            f"{ray.ray_search_replicas[0]} search + {ray.ray_reranker_replicas[0]} reranker"
            f"{f' + {shards} shard' if shards else ''} replicas of"
            f" {ray.ray_replica_cpus:g} CPUs need {cpus:g} CPUs; this machine's Ray cluster has"
            f" {resources.get('CPU', 0):g}: lower --replica-cpus or the replicas, or join a cluster (--address)"
        )
    if gpus and gpus * ray.ray_reranker_replicas[0] > resources.get("GPU", 0):
        raise RuntimeError(
            f"{ray.ray_reranker_replicas[0]} reranker replicas want a GPU each; the cluster has"
            f" {resources.get('GPU', 0):g}: lower --reranker-replicas"
        )


def _local_cpus() -> float:
    """The CPUs a local Ray cluster started here will have: Ray's own count (a container's CPU
    quota included), the machine's where this Ray version does not say."""
    try:
        from ray._private.utils import get_num_cpus
    except ImportError:
        return float(os.cpu_count() or 1)
    return float(get_num_cpus())


def run_on_ray(settings: Settings, writable: bool = True, stop: threading.Event | None = None) -> None:
    """Start (or join) a Ray cluster, deploy, and serve until Ctrl-C, SIGTERM or ``stop``."""
    read_manifest(settings.engine.index_dir)  # a missing index fails here, not in every replica
    if settings.scale_out.ray_address is None:  # refused before a cluster starts, in a second, not after it
        _check_fits(settings, {"CPU": _local_cpus()}, 0.0, local=True)
    with jvm_signals_kept():  # a JVM here (`--build-if-missing` built with it) keeps its handlers
        ray.init(address=settings.scale_out.ray_address, include_dashboard=False, log_to_driver=False)
    stop, started = stop or threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        if not started.is_set():
            raise SystemExit(0)  # start-up is cut short; `finally` takes the deployment down
        stop.set()

    if threading.current_thread() is threading.main_thread():
        # ours at once: ray.init put in its own SIGTERM handler, which aborted the process (exit -6)
        # when the signal came while the deployment was still starting
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": settings.serving.host, "port": settings.serving.mcp_port})
        resources = ray.cluster_resources()
        gpus = 1.0 if settings.engine.device != "cpu" and resources.get("GPU", 0) >= 1 else 0.0
        _check_fits(settings, resources, gpus, local=settings.scale_out.ray_address is None)
        host = "127.0.0.1" if settings.serving.host in ("0.0.0.0", "::", "") else settings.serving.host
        url = f"http://{host}:{settings.serving.mcp_port}"
        settings = settings.with_values(public_url=settings.serving.public_url or f"{url}{A2A_PREFIX}/")
        serve.run(application(settings, gpus, writable), name=APP_NAME, route_prefix="/")
        log.info(
            "on Ray: MCP + REST at %s/, the A2A agent at %s%s/ (reranker on %s)",
            url,
            url,
            A2A_PREFIX,
            "GPU" if gpus else "CPU",
        )
        started.set()
        sleep_until(stop)
    finally:
        serve.shutdown()
        with jvm_signals_kept():
            ray.shutdown()
