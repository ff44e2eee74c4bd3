"""``run``: on the GPU machine. Take the part this call carried, install once all parts are in /tmp,
then run the stages asked for, each a child process of the real CLI or benchmark, its log and
results under the results folder. Uses only the standard library until the install is done."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.gpu_kit.plan import BARE, KIT_DIR, MANIFEST, REHEARSED, describe, stage

HOME = Path("/tmp/gpukit")
REPO = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def receive(carried: Path, home: Path = HOME) -> tuple[dict, list[str]]:
    """Keep every carried part whose checksum the manifest confirms; return the manifest and the
    names of the parts still missing."""
    manifest = json.loads((carried / MANIFEST).read_text())
    store = home / "parts"
    store.mkdir(parents=True, exist_ok=True)
    if (store / MANIFEST).is_file() and json.loads((store / MANIFEST).read_text()) != manifest:
        shutil.rmtree(store)  # a different pack: start again
        store.mkdir(parents=True)
    (store / MANIFEST).write_text(json.dumps(manifest))
    for part in manifest["parts"]:
        src, kept = carried / part["name"], store / part["name"]
        if src.is_file() and not kept.is_file():
            if _sha(src) != part["sha256"]:
                raise SystemExit(f"{src}: checksum differs from the manifest; pack again")
            shutil.copyfile(src, kept)
    return manifest, [p["name"] for p in manifest["parts"] if not (store / p["name"]).is_file()]


def install(manifest: dict, home: Path = HOME) -> dict[str, str]:
    """Unpack the bundle and install the wheels into ``home/site`` (once); return the environment
    the stages run with."""
    root, site = home / "root", home / "site"
    done = home / "installed"
    if not done.is_file():
        started = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        bundle = home / "bundle.tar"
        with open(bundle, "wb") as out:
            for part in manifest["parts"]:
                out.write((home / "parts" / part["name"]).read_bytes())
        with tarfile.open(bundle) as tar:
            tar.extractall(root, filter="data")
        bundle.unlink()
        for packed in ("java-runtime", "index", "dataset"):
            with tarfile.open(root / f"{packed}.tar.xz") as tar:
                tar.extractall(root, filter="tar")  # the runtime's symbolic links are its own
        wheels = sorted(str(w) for w in (root / "wheels").glob("*.whl"))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run(pip + ["--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
        done.write_text(f"{time.perf_counter() - started:.1f}\n")
    return {
        **os.environ,
        "PYTHONPATH": f"{site}{os.pathsep}{REPO}",
        "JAVA_HOME": str(root / "java-runtime"),
        "HYBRID_SEARCH_ANSERINI_JAR": str(root / "anserini-lucene.jar"),
        "HYBRID_SEARCH_INDEX_DIR": str(root / "index"),
        "HYBRID_SEARCH_DATA_DIR": str(root / "dataset"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _commands(results: Path, small: bool = False) -> dict[str, list[list[str]]]:
    py = [sys.executable]
    cli = py + ["-m", "cli.main"]
    kit = py + ["-m", "benchmarks.gpu_kit"]
    sized = ["--small"] if small else []
    return {
        "micro": [kit + ["micro", "--out", str(results / "micro.json")]],
        "check": [kit + ["check", "--out", str(results / "check.json")]],
        "tests": [py + ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py", "-rA"]],
        "train": [cli + ["train-reranker"]],
        "evaluate": [cli + ["evaluate", "--split", "dev", "--output", str(results / "eval-dev")]],
        "rerank": [py + ["-m", "benchmarks.gpu_rerank", "--out", str(results / "gpu-rerank.json")]],
        "bench": [
            cli
            + ["bench", "engine", "--depths", "0,10,20,50,100,200", "--concurrency", "1,8,32,64,128"]
            + ["--num-queries", "100", "--output", str(results), "--name", "engine"]
        ],
        "http": [kit + ["http", "--out", str(results)]],
        **{name: [kit + [name, "--out", str(results), *sized]] for name in REHEARSED},
    }


def run(stages: list[str], out: Path, carried: Path = REPO / KIT_DIR) -> int:
    """One call's work: receive, run the :data:`BARE` stages asked for (the image's packages alone),
    install when complete, run the other ``stages``; results into ``out``."""
    manifest, missing = receive(carried)
    print(describe(len(manifest["parts"])), flush=True)
    results = HOME / "results"
    bare = [name for name in stages if name in BARE]
    code = 0
    if bare:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        code = run_stages(bare, env, results, lambda: _ship(results, out))
    stages = [name for name in stages if name not in BARE]
    if missing:
        print(f"have {len(manifest['parts']) - len(missing)} of {len(manifest['parts'])} parts; next: {missing[0]}")
        return code if not stages else 3
    env = install(manifest)
    return max(code, run_stages(stages, env, results, lambda: _ship(results, out)))


def rehearse(stages: list[str], index_dir: Path, data_dir: Path, out: Path) -> int:
    """The new stages here, on a CPU, small (two workers, a few clients and queries), in this
    environment rather than an installed bundle: what a GPU session will run, proved to run."""
    unknown = [name for name in stages if name not in REHEARSED]
    if unknown:
        raise SystemExit(f"rehearse runs {', '.join(REHEARSED)}, not {', '.join(unknown)}")
    env = {
        **os.environ,
        "HYBRID_SEARCH_INDEX_DIR": str(index_dir.resolve()),
        "HYBRID_SEARCH_DATA_DIR": str(data_dir.resolve()),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    code = run_stages(stages, env, out, lambda: None, small=True)
    from offline.records import write_result

    summary = json.loads((out / "stages.json").read_text())  # each stage's own file has its provenance
    write_result(out / "stages.json", {k: v for k, v in summary.items() if k != "provenance"})
    return code


def run_stages(stages: list[str], env: dict[str, str], results: Path, ship, small: bool = False) -> int:
    """Each stage a child process with ``env``, its log and results in ``results`` with
    ``stages.json`` (exit code and seconds); ``ship`` after each."""
    results.mkdir(parents=True, exist_ok=True)
    commands = _commands(results, small)
    summary_path = results / "stages.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    failed = 0

    def limit(name: str) -> int:  # a CPU's rehearsal runs small, but on a CPU
        return stage(name).timeout_s * (REHEARSAL_SLOWER if small else 1)

    for name in stages:
        stage(name)  # an unknown name fails before any work
    for name in stages:
        started = time.perf_counter()
        with open(results / f"{name}.log", "w") as log:
            codes = [_bounded(c, env, log, limit(name)) for c in commands[name]]
        seconds = time.perf_counter() - started
        summary[name] = {"exit": max(codes), "seconds": round(seconds, 1)}
        if max(codes) == TIMED_OUT:
            summary[name]["stopped"] = f"past its {limit(name)} s"
        failed += max(codes) != 0
        print(f"{name}: exit {max(codes)} in {seconds / 60:.1f} min", flush=True)
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        ship()
    return 1 if failed else 0


TIMED_OUT = 124
REHEARSAL_SLOWER = 4  # a rehearsal's time limits against the GPU's: small sizes, but 2 CPU cores


def _bounded(command: list[str], env: dict[str, str], log, timeout_s: int) -> int:
    """``command``'s exit code, or :data:`TIMED_OUT` when it ran past ``timeout_s``: then its whole
    process group (a server and its workers too) is killed, so the next stage starts clean."""
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        print(f"stopped past {timeout_s} s: {' '.join(command[-4:])}", file=log, flush=True)
        return TIMED_OUT


def _ship(results: Path, out: Path) -> None:
    """Everything measured so far as one archive (the transfer back takes at most 8 files)."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        tar.add(results, arcname="results")
