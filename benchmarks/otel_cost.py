"""What OpenTelemetry costs a request: `serve --read-only` three times side by side, timing the
same REST searches (NFCorpus dev queries) and /health, one keep-alive connection to each:

- ``off``: ``OTEL_SDK_DISABLED=true``, no tracer provider (no spans, no ``traceparent`` answered);
- ``on``: the default, spans made (server, search, stages) but exported nowhere;
- ``export``: ``--otlp-endpoint`` to a local OTLP/HTTP receiver (this process) that counts the
  spans it is sent (the SDK's batch thread sends them; ``OTEL_BSP_SCHEDULE_DELAY`` 5 s).

    python -m benchmarks.otel_cost --requests 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.latency import percentiles
from offline.records import machine
from offline.server_process import ROOT, free_port, serve_args, start_server, stop_server

MODES = {"off": ({"OTEL_SDK_DISABLED": "true"}, False), "on": ({}, False), "export": ({}, True)}


class SpanCounter:
    """An OTLP/HTTP receiver on 127.0.0.1 that decodes each export and counts its spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = self.exports = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["content-length"])))
                counter.exports += 1
                counter.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _once(client: httpx.Client, url: str, body: dict | None) -> float:
    started = time.perf_counter()
    reply = client.post(url, json=body) if body else client.get(url)
    reply.raise_for_status()
    return time.perf_counter() - started


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def measure(index_dir: Path, queries: list[str], requests: int, work: Path, receiver: SpanCounter) -> dict:
    """The three servers run side by side and each request goes to all three in turn (the order
    rotating), so that what else the machine does weighs on every mode alike."""
    searches = [{"query": queries[i % len(queries)], "top_k": 10} for i in range(requests)]
    report: dict = {"machine": machine(), "requests": requests, "distinct_queries": len(queries), "runs": {}}
    servers, bases, clients = {}, {}, {}
    try:
        for mode, (env, export) in MODES.items():
            port = free_port()
            bases[mode] = f"http://127.0.0.1:{port}"
            extra = ["--read-only", "--trace-db", str(work / f"{mode}.sqlite")]
            extra += ["--otlp-endpoint", receiver.url] if export else []
            with _environ(env):
                servers[mode] = start_server(
                    serve_args(index_dir, port, *extra), f"{bases[mode]}/health", work / f"{mode}.log"
                )
            clients[mode] = httpx.Client(timeout=60)
        modes = list(MODES)
        for mode in modes:
            for body in searches[:20]:  # warm up
                _once(clients[mode], bases[mode] + "/search", body)
            answered = "traceparent" in clients[mode].get(bases[mode] + "/health").headers
            report["runs"][mode] = {"traceparent_answered": answered}
        for route, bodies in (("/search", searches), ("/health", [None] * requests)):
            samples = {mode: [] for mode in modes}
            for i, body in enumerate(bodies):
                for mode in modes[i % 3 :] + modes[: i % 3]:
                    samples[mode].append(_once(clients[mode], bases[mode] + route, body))
            for mode in modes:
                report["runs"][mode][route] = percentiles(samples[mode])
    finally:
        for mode, server in servers.items():
            clients[mode].close()
            stop_server(server)  # queued spans are sent on the way out
    # a search is 7 spans (request, search, bm25, encode, dense, memory, fusion); /health 1, and
    # two more answered the start's health poll and the traceparent check
    report["runs"]["export"]["spans_exported"] = receiver.spans
    report["runs"]["export"]["spans_expected"] = 7 * (requests + 20) + requests + 2
    for mode in ("on", "export"):
        for route in ("/search", "/health"):
            for stat in ("p50", "mean"):
                extra_ms = report["runs"][mode][route][stat] - report["runs"]["off"][route][stat]
                report["runs"][mode][f"{route} extra_ms_{stat}"] = round(extra_ms, 3)
    return report


def span_cost(receiver: SpanCounter, rounds: int = 2000) -> dict:
    """Microseconds to make a search's 7 spans in this process, with the SDK and no exporter, and
    with the batch processor exporting (masked) to the receiver: the CPU a request spends on them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanKind

    from agents.traces import Masker
    from serving.telemetry import MaskingExporter, _otlp

    exporting = TracerProvider()
    exporting.add_span_processor(BatchSpanProcessor(MaskingExporter(_otlp(receiver.url), Masker())))
    costs = {}
    for name, provider in (("no_export", TracerProvider()), ("export", exporting)):
        tracer = provider.get_tracer("bench")
        started = time.perf_counter()
        for _ in range(rounds):
            attributes = {"http.request.method": "POST", "url.path": "/search", "door": "rest"}
            with tracer.start_as_current_span("POST /search", kind=SpanKind.SERVER, attributes=attributes):
                with tracer.start_as_current_span("search", attributes={"door": "rest", "search.top_k": 10}):
                    for stage in ("bm25", "encode", "dense", "memory", "fusion"):
                        tracer.start_span(stage, attributes={"search.stage": stage, "search.top_k": 10}).end()
        costs[name] = round((time.perf_counter() - started) / rounds * 1e6, 1)
        provider.shutdown()
    return {"us_per_search_7_spans": costs, "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-2core/otel-cost.json"))
    args = p.parse_args()
    queries = list(load_dataset(BuildSettings().data_dir).split_queries("dev").values())[:50]
    receiver = SpanCounter()
    with tempfile.TemporaryDirectory() as work:
        report = measure(args.index_dir, queries, args.requests, Path(work), receiver)
    report["in_process"] = span_cost(receiver)
    report["command"] = f"python -m benchmarks.otel_cost --requests {args.requests}"
    git = ["git", "-C", str(ROOT)]
    report["git_commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    report["git_uncommitted_changes"] = bool(changed.stdout.strip())
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {m: {k: v for k, v in r.items() if "extra" in k} for m, r in report["runs"].items()}
    print(json.dumps({**summary, "in_process": report["in_process"]}, indent=2))


if __name__ == "__main__":
    main()
