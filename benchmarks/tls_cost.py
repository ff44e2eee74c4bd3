"""What TLS costs a request: `serve` plain and with `--tls-cert`, the same REST search and /health,
with keep-alive (one connection for every request) and without (a new connection, so a new TLS
handshake, each time). A self-signed certificate is made with openssl for the run.

    python -m benchmarks.tls_cost --requests 200
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from offline.latency import percentiles
from offline.records import write_result
from offline.server_process import free_port, serve_args, start_server, stop_server


def _certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def _timed(url: str, verify, requests: int, keep_alive: bool, body: dict | None) -> dict:
    def one(client: httpx.Client) -> float:
        started = time.perf_counter()
        reply = client.post(url, json=body) if body else client.get(url)
        reply.raise_for_status()
        return time.perf_counter() - started

    samples = []
    if keep_alive:
        with httpx.Client(verify=verify) as client:
            one(client)
            samples = [one(client) for _ in range(requests)]
    else:
        for _ in range(requests):
            with httpx.Client(verify=verify) as client:
                samples.append(one(client))
    return percentiles(samples)


def measure(index_dir: Path, requests: int, work: Path) -> dict:
    cert, key = _certificate(work)
    verify = ssl.create_default_context(cafile=str(cert))
    search = {"query": "does vitamin D prevent falls?", "top_k": 5}
    report: dict = {"requests": requests, "runs": {}}
    os.environ["SSL_CERT_FILE"] = str(cert)  # the health poll that waits for the TLS server trusts it
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    for name, extra, scheme in (("plain", [], "http"), ("tls", tls, "https")):
        port = free_port()
        base = f"{scheme}://127.0.0.1:{port}"
        server = start_server(serve_args(index_dir, port, *extra), f"{base}/health", work / f"{name}.log")
        try:
            for keep_alive in (True, False):
                for route, body in (("/health", None), ("/search_nfcorpus", search)):
                    runs = report["runs"].setdefault(f"{route} keep-alive {'on' if keep_alive else 'off'}", {})
                    runs[name] = _timed(base + route, verify, requests, keep_alive, body)
        finally:
            stop_server(server)
    for runs in report["runs"].values():
        runs["tls_extra_ms_p50"] = round(runs["tls"]["p50"] - runs["plain"]["p50"], 3)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-2core/tls-cost.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        report = measure(args.index_dir, args.requests, Path(work))
    write_result(args.out, report, vars(args))
    print(json.dumps({k: v["tls_extra_ms_p50"] for k, v in report["runs"].items()}, indent=2))


if __name__ == "__main__":
    main()
