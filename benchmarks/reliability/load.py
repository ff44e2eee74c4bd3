"""Load on the three doors with locust (headless, bounded by time, loopback only): goodput, fast
refusals and the admitted requests' latency at each number of concurrent users."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

DOORS = {"rest": ("RestUser", "mcp"), "mcp": ("McpUser", "mcp"), "a2a": ("A2aUser", "a2a")}
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def run_level(door: str, users: int, urls: dict[str, str], seconds: int, queries: Path, work: Path) -> dict:
    """One locust run: ``users`` closed-loop users on ``door`` for ``seconds``."""
    user_class, port = DOORS[door]
    prefix = work / f"{door}-{users}"
    command = [
        *(sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class),
        *("--headless", "--users", str(users), "--spawn-rate", str(users), "--run-time", f"{seconds}s"),
        *("--host", urls[port], "--csv", str(prefix), "--only-summary", "--exit-code-on-error", "0"),
        "--stop-timeout",
        "30",
    ]
    subprocess.run(
        command,
        env={**os.environ, "LOAD_QUERIES": str(queries)},
        check=True,
        capture_output=True,
        timeout=seconds + 120,
    )
    rows = {row["Name"]: row for row in csv.DictReader(open(f"{prefix}_stats.csv")) if row["Name"] != "Aggregated"}

    def count(outcome: str) -> int:
        return int(rows.get(f"{door} {outcome}", {}).get("Request Count", 0))

    def pct(outcome: str, column: str) -> float | None:
        value = rows.get(f"{door} {outcome}", {}).get(column)
        return float(value) if value not in (None, "", "N/A") and count(outcome) else None

    ok, refused, errors = count("ok"), count("overloaded"), count("error")
    return {
        "users": users,
        "requests": ok + refused + errors,
        "ok": ok,
        "overloaded": refused,
        "errors": errors,
        "offered_per_s": round((ok + refused + errors) / seconds, 2),
        "goodput_per_s": round(ok / seconds, 2),
        "ok_p50_ms": pct("ok", "50%"),
        "ok_p99_ms": pct("ok", "99%"),
        "refused_p99_ms": pct("overloaded", "99%"),
    }


def run_load(urls: dict[str, str], levels: list[int], seconds: int, queries: Path, work: Path) -> dict:
    """Every door at every level: ``{door: [level, ...]}``."""
    work.mkdir(parents=True, exist_ok=True)
    return {door: [run_level(door, users, urls, seconds, queries, work) for users in levels] for door in DOORS}


def plot(load: dict, path: Path) -> None:
    """Goodput and the admitted p99 against concurrent users, one line per door."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (door, levels) in enumerate(load.items()):
        users, color = [level["users"] for level in levels], f"C{i}"
        left.plot(users, [level["goodput_per_s"] for level in levels], marker="o", color=color, label=f"{door} goodput")
        left.plot(users, [level["offered_per_s"] for level in levels], ":", color=color, label=f"{door} offered")
        right.plot(users, [level["ok_p99_ms"] or 0 for level in levels], marker="o", color=color, label=door)
    left.set_yscale("log")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent users (closed loop)")
        axis.legend(fontsize=7)
    left.set_ylabel("requests/s")
    left.set_title("goodput vs offered load")
    right.set_ylabel("ms")
    right.set_title("p99 of admitted requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
