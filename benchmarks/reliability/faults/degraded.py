"""A reranker and an LLM server that fail: search and answers must degrade, not fail, and say so.
The reranker only reorders what fusion found and the extractive responder needs no LLM, so a
failing model costs quality, never an answer; ``/health`` and ``/metrics`` must show it, or no
one would know the quality was gone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.reliability.faults.harness import QUERIES, in_process
from benchmarks.reliability.faults.results import RerankerFailure, Skipped
from offline.server_process import free_port


def reranker_fault(index_dir: Path, work_dir: Path, reranker: str | None = None) -> RerankerFailure | Skipped:
    """:func:`reranker_failure` with ``reranker`` (default the index's own), skipped without one."""
    reranker = reranker or str(index_dir / "reranker")
    if not Path(reranker).is_dir():
        return Skipped(f"no reranker at {reranker}")
    return reranker_failure(index_dir, work_dir, reranker)


def reranker_failure(index_dir: Path, work_dir: Path, reranker: str, queries: int = 3) -> RerankerFailure:
    """In-process, behind the real REST routes: break the reranker's model (its classifier head, which
    the whole model and the ``[CLS]``-only pass both run, raises) and point answers at an LLM server
    that is not there; searches and answers must still come back (fused results, the extractive
    fallback) and ``/health`` and ``/metrics`` say so."""
    from serving.rest import SOLVER_PATH

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected fault: the cross-encoder failed")

    nobody = f"http://127.0.0.1:{free_port()}/v1"  # no LLM server listens there
    settings = {"reranker": reranker, "rerank_runtime": "torch", "llm_url": nobody}
    with in_process(index_dir, work_dir, **settings) as (client, service):
        model = service.engine.reranker.model.transformers_model.classifier
        query = {"query": QUERIES[0], "top_k": 5}
        model.forward = broken
        replies = [client.post("/search", json=query) for _ in range(queries)]
        fused = [d for d, _ in service.engine.stages(QUERIES[0], 5).fused[:5]]
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
        answer = client.post(SOLVER_PATH, json={"task_id": "t1", "task": "Does vitamin D prevent falls?"})
        llm = client.get("/health").json().get("llm_health", {})
        llm_metric = _metric(client.get("/metrics").text, "llm_failures_total")
        del model.forward  # the model works again
        client.post("/search", json=query)
        recovered = client.get("/health").json()["reranker_health"]["status"]
    return RerankerFailure(
        queries=queries,
        answered=sum(r.status_code == 200 and len(r.json()["results"]) == 5 for r in replies),
        served_fused_order=all([h["doc_id"] for h in r.json()["results"]] == fused for r in replies),
        health=health["reranker_health"],
        health_shows=health["reranker_health"]["status"] == "failing" and health["status"] == "degraded",
        metrics_show=_metric(metrics, "reranker_failures_total") == health["reranker_health"]["failures"] > 0,
        recovers=recovered == "ok",
        llm_answered=answer.status_code == 200,
        llm_health_shows=llm.get("status") == "failing" and llm.get("failures", 0) >= 1,
        llm_metrics_show=llm_metric == llm.get("failures"),
    )


def _metric(text: str, name: str) -> float | None:
    """A sample's value in Prometheus' text format (None when absent)."""
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(found[0]) if found else None
