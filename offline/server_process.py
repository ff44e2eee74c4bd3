"""``hybrid-search serve`` as a child process: what the reliability benchmarks and the tests run."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "cli.main"]


class ServerExited(RuntimeError):
    """The server stopped before it answered its health check (``returncode`` says how)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


# Ports for the servers started here: under the kernel's ephemeral range, which every outgoing
# connection draws from (Ray opens hundreds as it starts, and one took the port a Ray Serve proxy was
# about to bind: "Failed to bind to address"), and above Ray's worker ports (10002-19999).
LISTEN_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port free now, outside the ranges other processes take ports from by themselves."""
    for port in random.sample(LISTEN_PORTS, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {LISTEN_PORTS.start}-{LISTEN_PORTS.stop - 1}")


def serve_args(index: Path, mcp_port: int, *extra: str, a2a_port: int | None = None) -> list[str]:
    """``hybrid-search serve`` of ``index`` on the CPU and loopback ports (no A2A side without a port)."""
    a2a = ["--a2a-port", str(a2a_port)] if a2a_port else ["--no-a2a"]
    return ["serve", "--index-dir", str(index), "--mcp-port", str(mcp_port), *a2a, "--device", "cpu", *extra]


def start_server(
    args: list[str],
    health_url: str,
    log: Path,
    preexec_fn: Callable[[], None] | None = None,
    checkout: Path = ROOT,
    cli: list[str] = CLI,
    timeout_s: float = 180,
) -> subprocess.Popen:
    """Start the CLI with ``args`` (output to ``log``) and return once ``health_url`` answers 200
    (within ``timeout_s``); ``preexec_fn`` runs in the child before it starts (resource limits,
    signal dispositions). ``checkout`` and ``cli``: another checkout's code and entry point (a
    baseline commit's)."""
    # the checkout first, then what the caller's path held (the GPU kit's installed wheels)
    path = os.pathsep.join([str(checkout), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cli + args, cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec_fn
        )
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"server exited early:\n{log.read_text()[-3000:]}", proc.returncode)
        try:
            if httpx.get(health_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not come up:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM and the exit code (uvicorn drains open requests, the index is checkpointed)."""
    proc.terminate()
    return proc.wait(timeout=30)


def wait_until_up(url: str, seconds: float = 30) -> None:
    """Poll ``url`` until it answers 200 (the A2A side comes up beside the health route)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {seconds:g} s")


# ---------------------------------------------------------------- ``serve --workers N``: which worker answers


def worker_client(url: str, role: str, seconds: float = 60, timeout_s: float = 20) -> tuple[httpx.Client, dict]:
    """A client whose kept-alive connection reaches the worker of ``role`` ("writer", "follower"),
    and that worker's ``/health``: each new connection may reach any worker, and ``/health`` names
    the one that answered, so the connection's next requests reach it too."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        client = httpx.Client(base_url=url, timeout=timeout_s)
        try:
            health = client.get("/health").json()
            if health["worker"]["role"] == role:
                return client, health
        except httpx.HTTPError:
            time.sleep(0.2)
        client.close()
    raise RuntimeError(f"no {role} answered at {url} within {seconds:g} s")


def workers_up(url: str, seconds: float = 90, roles: tuple[str, ...] = ("writer", "follower")) -> dict[str, int]:
    """The pid of each role, once each answers over a new connection."""
    pids = {}
    for role in roles:
        client, health = worker_client(url, role, seconds)
        client.close()
        pids[role] = health["worker"]["pid"]
    return pids


def all_workers_up(url: str, seconds: float = 120) -> int:
    """Once every worker of ``serve --workers N`` answers (each new connection reaches one the kernel
    picks, and ``/health`` names it), their count. A load begun before that puts every kept-alive
    connection on the first workers up (a GPU run of 2026-11-28 sent all 1,296 queries to one)."""
    deadline, pids = time.time() + seconds, set()
    while time.time() < deadline:
        try:
            with httpx.Client(base_url=url, timeout=10) as client:
                health = client.get("/health").json()
            pids.add(health["worker"]["pid"])
            if len(pids) >= health["workers"]:
                return len(pids)
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{len(pids)} workers answered at {url} within {seconds:g} s")


def sigkill(pid: int, seconds: float = 30, every_thread: bool = True) -> float:
    """SIGKILL ``pid`` and wait until it has let go of its sockets; the seconds that took.
    (``every_thread=False``: only until its leader is a zombie, too early, for
    :func:`benchmarks.reliability.faults.workers.kill_window` to show what that costs.)

    Gone means every thread gone: the process reaped, or only its zombie leader left. The leader
    turning zombie is not enough: a process's threads die one by one, and the last one unmaps the
    memory before it closes the files, so a worker's listening socket stays in its port's
    ``SO_REUSEPORT`` group for a while after its leader is a zombie; a new connection the kernel
    hands to that socket meanwhile is completed and then reset when the socket closes (measured:
    ``reliability-faults.json["kill_window"]``; with ``net.ipv4.tcp_migrate_req=1`` the kernel moves
    a closing socket's connections to a sibling instead)."""
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            return time.perf_counter() - started
        if fields["State"].split()[0] == "Z" and (int(fields["Threads"]) <= 1 or not every_thread):
            return time.perf_counter() - started
        time.sleep(0.01)
    raise RuntimeError(f"pid {pid} still has threads {seconds:g} s after SIGKILL")
