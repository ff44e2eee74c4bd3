"""Every result file goes through :func:`write_result`, so a committed figure says what made it.

The ``provenance`` block names the command line, the commit of the checkout it ran in (and the
files that differed from it), the settings, the UTC time and the machine. VMs that describe
themselves alike differ widely in speed (docs/benchmarks.md#provenance), so the machine carries a
float32 matmul's GFLOP/s: compare a timing only with timings taken at a similar GFLOP/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

RESULTS_DIR = "benchmarks/results"
ENV_PREFIX = "HYBRID_SEARCH_"  # settings given as variables change a run as much as its flags


def write_result(path: Path, result: dict, settings: dict | None = None, *, update: bool = False) -> Path:
    """Write ``result`` as JSON at ``path`` with its ``provenance``; returns ``path``.

    ``update``: for benchmarks whose parts run on request, keys of the file already at ``path``
    that ``result`` lacks are kept, and ``provenance["kept"]`` holds, per kept key, the provenance
    of the run that made it (null where that file had none).
    """
    block = _provenance(settings)
    if update and path.is_file():
        earlier = json.loads(path.read_text())
        before = earlier.pop("provenance", None) or {}
        kept_before = before.pop("kept", {})
        kept = {key: kept_before.get(key, before or None) for key in earlier if key not in result}
        result = {key: earlier[key] for key in kept} | result
        if kept:
            block["kept"] = kept
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result | {"provenance": block}, indent=2, default=_plain) + "\n")
    return path


def machine() -> dict:
    """What a figure was measured on; ``gflops`` is the best rate of a 1024 x 1024 float32 matmul
    over ~0.2 s on every core."""
    from threadpoolctl import threadpool_limits

    info = {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    with threadpool_limits(os.cpu_count(), user_api="blas"):  # the engine sets BLAS to one thread
        info["gflops"] = _gflops()
    return info


def _provenance(settings: dict | None) -> dict:
    commit, changed = _git()
    return {
        "command": _command(),
        "commit": commit,
        "dirty": None if changed is None else bool(changed),
        "changed": changed,
        "settings": settings,
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def _command() -> str:
    """The command as typed, after the engine's variables (values of ``*KEY*`` ones hidden): under
    ``python -m pkg.mod`` argv[0] is the module's file, so the module's name comes from ``__main__``."""
    env = [
        f"{name}={'***' if 'KEY' in name else shlex.quote(value)}"
        for name, value in sorted(os.environ.items())
        if name.startswith(ENV_PREFIX)
    ]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        head = f"python -m {spec.name.removesuffix('.__main__')}"
    elif sys.argv[0].endswith(".py") or sys.argv[0] == "-c":
        head = f"python {sys.argv[0]}"
    else:  # a console script such as hybrid-search
        head = Path(sys.argv[0]).name
    return " ".join([*env, head, *map(shlex.quote, sys.argv[1:])])


def _git() -> tuple[str | None, list[str] | None]:
    """HEAD of the checkout in the working directory and up to 20 paths that differ from it,
    untracked ones included; results are left out (a run writes them). ``(None, None)`` without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", ":/", f":(top,exclude){RESULTS_DIR}"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head.stdout.strip(), [line[3:] for line in status.stdout.splitlines()][:20]


def _cpu_model() -> str | None:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), None)


def _gflops(n: int = 1024, seconds: float = 0.2) -> float:
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return round(2 * n**3 / best / 1e9, 1)


def _plain(value: object) -> object:
    """JSON for what the encoder refuses: numpy values and arrays, dataclasses, sets; paths and the
    rest as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)
