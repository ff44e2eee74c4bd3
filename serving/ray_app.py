"""``hybrid-search serve --ray``: the same doors and answers, on a Ray Serve cluster.

Deployments behind Serve's HTTP proxy (one port):

- ``SearchReplica``, the ingress: the MCP + REST doors at ``/`` and the A2A agent at ``/a2a/``,
  each replica with a read-only engine of its own (BM25, dense, judgment memory, fusion: a query's
  CPU work, docs/ray.md). Retrieval stays beside the doors so that candidates and their texts never
  cross the wire; the replicas are stateless (MCP runs stateless), so any replica answers any request.
- ``RerankerReplica``: the cross-encoder, on a GPU when the cluster has one, scoring the queries of
  every search replica together with ``@serve.batch`` (the cross-request batching that
  :class:`engine.rerank.batching.RerankBatcher` does inside one process);
- ``WriterReplica`` (unless ``--read-only``): the index's one writer. The doors send it every
  write; it checkpoints after each refresh, and each search replica shows the newest checkpoint
  before it searches (:mod:`engine.live.follower`): a write is visible on every replica within the
  refresh interval, and at once when it was sent with ``wait``.

Index directories are read from the same path on every node (a shared disk). Ray is an optional
extra (``pip install 'hybrid-search[ray]'``): nothing else imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.handle import DeploymentHandle

from engine.documents import DocumentIn
from engine.rerank.batching import score_together
from engine.rerank.loading import open_reranker
from engine.retrieval.java import jvm_signals_kept
from engine.search import HybridEngine
from engine.store.index_dir import read_manifest
from serving.admission import Overloaded
from serving.app import RequestLog, build_apps
from serving.asgi import one_port
from serving.search_service import SearchService
from serving.settings import Settings
from serving.signals import sleep_until

log = logging.getLogger(__name__)
APP_NAME = "hybrid-search"
A2A_PREFIX = "/a2a"


@serve.deployment(name="reranker")
class RerankerReplica:
    """The index's reranker as a deployment; concurrent queries share one forward pass."""

    def __init__(self, settings: Settings, device: str) -> None:
        self.reranker = open_reranker(settings.engine, device)
        if self.reranker is None:
            raise RuntimeError(f"no reranker could be loaded from {settings.engine.reranker_path}")
        wait_ms = settings.scale_out.ray_batch_wait_ms
        if wait_ms is None:  # waiting pays only where a bigger batch costs little more (a GPU)
            wait_ms = settings.engine.rerank_batch_wait_ms if device == "cuda" else 0.0
        self.score.set_max_batch_size(settings.scale_out.ray_batch_size)
        self.score.set_batch_wait_timeout_s(wait_ms / 1000)

    def describe(self) -> dict:
        r = self.reranker
        return {k: getattr(r, k) for k in ("name", "device", "runtime", "max_length", "memory_context")}

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)
    async def score(self, requests: list[tuple[str, list[str]]]) -> list[list[float]]:
        """One call per query, ``(query, passages)``; Serve hands them over in batches."""
        return await asyncio.to_thread(score_together, self.reranker, requests)


@serve.deployment(name="writer", num_replicas=1)
class WriterReplica:
    """The index's one writer: takes every replica's writes and publishes each refresh that applied
    some, which is what the search replicas follow (:mod:`engine.live.follower`)."""

    def __init__(self, settings: Settings) -> None:
        self.engine = HybridEngine(
            settings.engine.model_copy(update={"rerank": False, "followed": True}), writable=True
        )

    def upsert(self, document: dict, wait: bool) -> dict:
        return self.engine.live.upsert(DocumentIn.model_validate(document), wait)

    def delete(self, document_id: str, wait: bool) -> dict:
        return self.engine.live.delete(document_id, wait)

    def document(self, document_id: str) -> dict | None:
        return self.engine.live.document(document_id)

    def status(self) -> dict:
        return self.engine.live.status()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # a checkpoint: the next writer replays nothing


class RemoteWriter:
    """The writer deployment as the engine's ``live``: the same calls, its errors as raised there."""

    def __init__(self, handle: DeploymentHandle, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def _call(self, method: str, *args):
        try:
            return getattr(self.handle, method).remote(*args).result(timeout_s=self.timeout_s)
        except RayTaskError as exc:  # DocumentNotFound, StorageFull...: the doors phrase them
            raise exc.cause from None
        except RayError as exc:  # the writer replica died (Serve starts another) or outlasted the timeout
            log.warning("the writer deployment failed a call (%s)", type(exc).__name__)
            message = "the index's writer is restarting or busy; send it again (a document sent twice is kept once)"
            raise Overloaded(message, 5) from None

    def upsert(self, document: DocumentIn, wait: bool = False) -> dict:
        return self._call("upsert", document.model_dump(mode="json"), wait)

    def delete(self, document_id: str, wait: bool = False) -> dict:
        return self._call("delete", document_id, wait)

    def document(self, document_id: str) -> dict | None:
        return self._call("document", document_id)

    def status(self) -> dict:
        return {"writer": "the Ray deployment 'writer' (one replica)"}

    def close(self) -> None:
        """The writer deployment closes itself."""


class RemoteReranker:
    """The engine's reranker when it is a deployment: the same ``score``, one batched call away."""

    def __init__(self, handle: DeploymentHandle, info: dict, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s
        self.name, self.device, self.runtime = info["name"], info["device"], info["runtime"]
        self.max_length, self.memory_context = info["max_length"], info["memory_context"]

    def score(self, query: str, passages: list[str]) -> list[float]:
        if not passages:
            return []
        return self.handle.score.remote((query, passages)).result(timeout_s=self.timeout_s)


@serve.deployment(name="search")
@serve.ingress()
class SearchReplica:
    """The doors and retrieval; reranking through the reranker deployment when there is one."""

    def __init__(self, settings: Settings, reranker: DeploymentHandle | None, writer: DeploymentHandle | None) -> None:
        self.settings = settings
        # Serve runs constructors on the replica's event loop, where a handle's answer cannot be
        # waited for; the engine (which asks the reranker what it reads) is built on a thread
        with ThreadPoolExecutor(1) as pool:
            self.service = pool.submit(self._service, settings, reranker, writer).result()

    @staticmethod
    def _service(settings: Settings, reranker: DeploymentHandle | None, writer: DeploymentHandle | None):
        timeout = settings.serving.query_timeout_s
        remote = None
        if reranker is not None:
            remote = RemoteReranker(reranker, reranker.describe.remote().result(timeout_s=timeout), timeout)
        follow = RemoteWriter(writer, timeout) if writer is not None else None
        return SearchService(settings, HybridEngine(settings.engine, reranker=remote, follow=follow))

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
    writer = WriterReplica.options(ray_actor_options={"num_cpus": 0}).bind(search_settings) if writable else None
    options = _deployment_options(settings.scale_out.ray_search_replicas, settings.scale_out.ray_replica_cpus)
    return SearchReplica.options(**options).bind(search_settings, reranker, writer)


def _check_fits(settings: Settings, resources: dict, gpus: float, local: bool) -> None:
    """Refuse, before deploying, what the cluster cannot place (Serve would wait for it forever):
    on a local cluster the CPUs; on any cluster the GPUs the reranker replicas ask for."""
    ray = settings.scale_out
    cpus = ray.ray_replica_cpus * (ray.ray_search_replicas[0] + ray.ray_reranker_replicas[0])
    if local and cpus > resources.get("CPU", 0):
        raise RuntimeError(
            f"{ray.ray_search_replicas[0]} search + {ray.ray_reranker_replicas[0]} reranker replicas of"
            f" {ray.ray_replica_cpus:g} CPUs need {cpus:g} CPUs; this machine's Ray cluster has"
            f" {resources.get('CPU', 0):g}: lower --replica-cpus or the replicas, or join a cluster (--address)"
        )
    if gpus and gpus * ray.ray_reranker_replicas[0] > resources.get("GPU", 0):
        raise RuntimeError(
            f"{ray.ray_reranker_replicas[0]} reranker replicas want a GPU each; the cluster has"
            f" {resources.get('GPU', 0):g}: lower --reranker-replicas"
        )


def run_on_ray(settings: Settings, writable: bool = True, stop: threading.Event | None = None) -> None:
    """Start (or join) a Ray cluster, deploy, and serve until Ctrl-C, SIGTERM or ``stop``."""
    read_manifest(settings.engine.index_dir)  # a missing index fails here, not in every replica
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
