"""The corruption catalogue: each way an index's files break, as a row (a name and the damage it
does), and what opening a damaged copy as ``serve`` does. A damaged file must be refused at start
naming the file, in one line and without a traceback, since a server that starts on it serves wrong
rows or loses acknowledged writes; only a torn log tail, which every crash mid-append leaves, is
cut and recovered. New damage is one row here, not a new scenario."""

from __future__ import annotations

import random
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.reliability.faults.harness import copy_index, document
from benchmarks.reliability.faults.results import CorruptionOutcome, Opened
from engine.settings import EngineSettings
from engine.store.index_dir import BM25_DIR, DOCS_FILE, MANIFEST_FILE, WAL_FILE, IndexDirError, latest_dense
from offline.server_process import ServerExited, free_port, serve_args, start_server, stop_server

ERROR_PREFIX = "hybrid-search: error: "
LOGGED = [f"logged-{i}" for i in range(3)]  # the writes a crashed copy holds in its log, oldest first


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _overwrite_page(path: Path) -> Path:
    """Garbage over the store's second page (a b-tree page: the damage a bad sector does)."""
    with open(path, "r+b") as fh:
        fh.seek(4096)
        fh.write(random.Random(0).randbytes(4096))
    return path


def _drop_segment_file(index: Path) -> Path:
    victim = max((index / BM25_DIR).glob("_*"), key=lambda p: p.stat().st_size)
    victim.unlink()
    return victim


def _drop_store_row(index: Path) -> Path:
    """One chunk fewer in the store than vectors in the dense index: rows would name wrong documents."""
    with sqlite3.connect(index / DOCS_FILE) as conn:
        conn.execute("DELETE FROM chunks WHERE row = (SELECT max(row) FROM chunks)")
    return index / DOCS_FILE


def _tear_log_tail(index: Path) -> Path:
    """The last record cut short, as a crash mid-append leaves it."""
    wal = index / WAL_FILE
    wal.write_bytes(wal.read_bytes()[:-10])
    return wal


def _damage_log_head(index: Path) -> Path:
    """A byte flipped inside the first record, with whole records after it."""
    wal = index / WAL_FILE
    raw = bytearray(wal.read_bytes())
    raw[20] ^= 0xFF
    wal.write_bytes(bytes(raw))
    return wal


@dataclass(frozen=True)
class Corruption:
    """One way an index breaks. ``logged``: it needs writes still in the log (an index whose server
    crashed); ``recovers``: the server must start anyway (a torn log tail is a crash's, and cut)."""

    name: str
    damage: Callable[[Path], Path]  # damages the copy it is given; returns the file it damaged
    logged: bool = False
    recovers: bool = False


CORRUPTIONS = [
    Corruption("dense index truncated", lambda index: _truncate(latest_dense(index).base)),
    Corruption("manifest damaged", lambda index: _truncate(index / MANIFEST_FILE)),
    Corruption("Lucene segment file missing", _drop_segment_file),
    Corruption("document store page overwritten", lambda index: _overwrite_page(index / DOCS_FILE)),
    Corruption("document store truncated", lambda index: _truncate(index / DOCS_FILE)),
    Corruption("document store disagrees with dense index", _drop_store_row),
    Corruption("log damaged before whole records", _damage_log_head, logged=True),
    Corruption("log tail torn", _tear_log_tail, logged=True, recovers=True),
]


def crashed_copy(index_dir: Path, target: Path) -> Path:
    """``target``: ``index_dir`` as a server leaves it when killed right after acknowledging the
    ``LOGGED`` writes (in the log, applied to no store)."""
    from engine.documents import DocumentIn
    from engine.search import HybridEngine

    source = copy_index(index_dir, target.with_name(target.name + "-writer"))
    settings = EngineSettings(index_dir=source, device="cpu", rerank=False, refresh_interval_s=3600)  # no refresh
    engine = HybridEngine(settings, writable=True)
    try:
        for doc_id in LOGGED:
            engine.live.upsert(DocumentIn.model_validate(document(doc_id, f"{doc_id} kumquat marmalade")))
        copy_index(source, target)  # the snapshot a kill -9 leaves: nothing applied, nothing checkpointed
    finally:
        engine.close()
        shutil.rmtree(source)
    return target


def corruption_outcome(
    case: Corruption, index_dir: Path, work_dir: Path, crashed: Path | None = None, via_cli: bool = False
) -> CorruptionOutcome:
    """Damage a copy of ``index_dir`` (of ``crashed``, from :func:`crashed_copy`, when the case needs
    a log) and open it as ``serve`` does: in-process, or (``via_cli``) with the real CLI, adding its
    exit code and whether it printed a traceback."""
    index = copy_index(crashed if case.logged else index_dir, work_dir / case.name.replace(" ", "-"))
    damaged = str(case.damage(index).relative_to(index))
    opened = _serve_outcome(index, work_dir / f"{index.name}.log") if via_cli else _engine_outcome(index)
    shutil.rmtree(index)  # copies of a large index add up; the server's log stays
    names_file = damaged in (opened.message or "")
    if case.recovers:
        as_expected = not opened.refused and opened.logged_present == len(LOGGED) - 1
    else:
        as_expected = opened.refused and names_file and not opened.traceback
    return CorruptionOutcome(case.name, damaged, opened, names_file, as_expected)


def every_corruption(index_dir: Path, work_dir: Path) -> list[CorruptionOutcome]:
    """The whole catalogue, each case opened with the real CLI."""
    crashed = crashed_copy(index_dir, work_dir / "crashed")
    return [corruption_outcome(case, index_dir, work_dir, crashed, via_cli=True) for case in CORRUPTIONS]


def _engine_outcome(index: Path) -> Opened:
    from engine.search import HybridEngine

    try:
        engine = HybridEngine(EngineSettings(index_dir=index, device="cpu", rerank=False), writable=True)
    except IndexDirError as exc:
        return Opened(refused=True, message=str(exc))
    try:
        return Opened(refused=False, logged_present=sum(engine.live.document(d) is not None for d in LOGGED))
    finally:
        engine.close()


def _serve_outcome(index: Path, log: Path) -> Opened:
    port = free_port()
    try:
        proc = start_server(serve_args(index, port), f"http://127.0.0.1:{port}/health", log)
    except ServerExited as exc:
        text = log.read_text()
        errors = [line.removeprefix(ERROR_PREFIX) for line in text.splitlines() if line.startswith(ERROR_PREFIX)]
        message = errors[-1] if errors else text[-500:]
        return Opened(refused=True, message=message, exit_code=exc.returncode, traceback="Traceback" in text)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            present = sum(client.get(f"/documents/{d}").status_code == 200 for d in LOGGED)
    finally:
        exit_code = stop_server(proc)
    return Opened(refused=False, logged_present=present, exit_code=exit_code, traceback="Traceback" in log.read_text())
