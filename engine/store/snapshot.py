"""Snapshots of an index directory: a consistent copy at one position of the write-ahead log,
taken while the index serves and takes writes, with the SHA-256 of every file.

What is taken how, and why:

- **Immutable files are hard-linked** (copied when the snapshot's folder is on another filesystem):
  the files of Lucene's last commit (Lucene never changes a file once written and keeps a commit's
  files until the next commit) and the dense checkpoint (a base or a delta is written aside and
  renamed, never changed in place). A link costs a directory entry whatever the file's size, and
  the index removing its name later (a merge, the next checkpoint) leaves the snapshot's.
- **What changes with writes is fixed at one position**, under the writer's lock, which writes
  wait on to be logged while searches go on: the log is copied to its end (a record boundary
  there: appends take the lock) and a read transaction is begun on the SQLite store. The store's
  pages are copied after the lock is released, from that transaction (SQLite's backup, in WAL
  mode: the writer goes on beside it), so writes wait for the log's copy (at most
  ``checkpoint_bytes``, 64 MiB), never for the store's.
- **The rest is copied** (manifest, memory, fusion, reranker, adapt, token ids): small, and
  rewritten in place by the commands that make them, which would change a linked file under a
  snapshot. Left out: the writer's lock, its announcement to followers, evaluation reports.

No store has to stand at the position, so nothing is checkpointed for a snapshot (that would
write the dense delta and commit Lucene under the lock, in proportion to the writes since the last
checkpoint): each store remembers the last record it holds, as after a crash, and the log copy
holds every record after the oldest of them (only a checkpoint empties the log, and the lock keeps
it out). Restoring replays each store from its own position to the snapshot's, as a start after
``kill -9`` does. The position is the last record the log copy or a store holds: every write
acknowledged before the snapshot was asked for is at or before it.

A snapshot is written into a hidden folder and renamed into place once its manifest
(``snapshot.json``: the position, each file's size, SHA-256 and whether it is immutable) is
fsynced, so a snapshot folder without one is torn. Restoring checks the file list and every
checksum while it places the files in a hidden folder beside the target (linking the immutable
ones), lets the caller replay the log there and renames it into place: a torn or altered snapshot
is refused, naming the file, and never leaves half an index.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

from engine.errors import INVALID_PARAMS, ServiceError
from engine.store.index_dir import (
    BM25_DIR,
    DOCS_FILE,
    LOCK_FILE,
    PUBLISHED_FILE,
    REPORTS_DIR,
    WAL_FILE,
    IndexDirError,
    latest_dense,
    read_manifest,
)
from engine.store.wal import _NO_ROOM, StorageFull, fsync_dir, read_records

SNAPSHOT_FILE = "snapshot.json"
FORMAT = 1
_CHUNK = 1 << 20
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP}  # another filesystem, or one without links
_LEFT_OUT = {LOCK_FILE, PUBLISHED_FILE, REPORTS_DIR}  # the writer's, not the index's
_TAKEN_APART = {BM25_DIR, WAL_FILE, DOCS_FILE, f"{DOCS_FILE}-wal", f"{DOCS_FILE}-shm"}  # fixed at the position


class SnapshotRefused(ServiceError, IndexDirError):
    """No snapshot can be taken of this index here (a sharded index, or another process writes it
    and must take it): 409, nothing was written."""

    status, jsonrpc_code = 409, -32008


class SnapshotDamaged(ServiceError, IndexDirError):
    """A snapshot that is torn (its taking stopped before the end) or altered since (a file missing,
    added or changed): refused before anything is restored (422)."""

    status, jsonrpc_code = 422, INVALID_PARAMS


def default_folder(index_dir: Path) -> Path:
    """Where an index's snapshots go unless told: ``<index>.snapshots`` beside it (the same
    filesystem, so immutable files are linked; not inside it, which a rebuild replaces)."""
    index_dir = Path(index_dir).resolve()
    return index_dir.with_name(f"{index_dir.name}.snapshots")


class Taking:
    """A snapshot of ``index_dir`` being taken into the folder ``into``: :meth:`fix` under the
    writer's lock (or with no writer), then :meth:`finish` without it. Used as a context manager,
    which removes the unfinished snapshot when either fails."""

    def __init__(self, index_dir: Path, into: Path) -> None:
        self.index_dir, self.into = Path(index_dir), Path(into)
        if read_manifest(self.index_dir).shards:
            raise SnapshotRefused(f"{self.index_dir}: a sharded index; snapshot each shard's folder (shards/<i>)")
        self.started = time.perf_counter()
        try:
            self.into.mkdir(parents=True, exist_ok=True)
            self.work = Path(tempfile.mkdtemp(prefix=".taking-", dir=self.into))
        except OSError as exc:
            raise IndexDirError(f"{self.into}: no snapshot can be written here ({exc.strerror or exc})") from None
        self.immutable: dict[str, bool] = {}  # path in the snapshot -> whether it never changes (linked)
        self.linked_bytes = 0
        self.stores: dict[str, int] = {}
        self.fixed_s = 0.0
        self._store: sqlite3.Connection | None = None

    def __enter__(self) -> Taking:
        return self

    def __exit__(self, kind, exc, *_: object) -> None:
        if self._store is not None:
            self._store.close()
        if kind is not None:
            shutil.rmtree(self.work, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno not in _NO_ROOM:
            raise IndexDirError(f"{self.into}: the snapshot failed ({exc}); nothing of it was kept") from None
        if isinstance(exc, OSError):
            raise StorageFull(
                f"{self.into}: no room for the snapshot ({exc.strerror}); nothing of it was kept"
            ) from None

    def fix(self, lucene_seq: int, lucene_files: Iterable[str]) -> None:
        """Fix the snapshot's position: link the files of Lucene's last commit (``lucene_files``,
        names in ``bm25/``, holding writes up to ``lucene_seq``) and of the dense checkpoint, copy
        the log, begin the store's read transaction. Call it with the index's writes held back."""
        started = time.perf_counter()
        for name in lucene_files:
            self._link(f"{BM25_DIR}/{name}")
        dense = latest_dense(self.index_dir)
        for path in (dense.base, dense.delta):
            if path is not None:
                self._link(path.name)
        log = self.index_dir / WAL_FILE
        if log.exists():
            with open(log, "rb") as src, open(self.work / WAL_FILE, "wb") as dst:
                _copy(src, dst, os.fstat(src.fileno()).st_size)  # its end is a record boundary: appends wait
            self.immutable[WAL_FILE] = False
        self._store = sqlite3.connect(self.index_dir / DOCS_FILE, isolation_level=None, check_same_thread=False)
        self._store.execute("BEGIN")
        found = self._store.execute("SELECT value FROM meta WHERE key = 'applied_seq'").fetchone()  # pins the read
        self.stores = {"lucene": lucene_seq, "dense": dense.seq, "store": found[0] if found else 0}
        self.fixed_s = time.perf_counter() - started

    def finish(self) -> dict:
        """Copy the store from its read transaction and the other files, checksum everything, write
        the manifest and place the snapshot; returns the manifest's summary."""
        target = sqlite3.connect(self.work / DOCS_FILE)
        try:
            self._store.backup(target)
        finally:
            target.close()
        self._store.execute("COMMIT")
        self.immutable[DOCS_FILE] = False
        for relative in _other_files(self.index_dir):
            (self.work / relative).parent.mkdir(parents=True, exist_ok=True)
            with open(self.index_dir / relative, "rb") as src, open(self.work / relative, "wb") as dst:
                _copy(src, dst)
            self.immutable[relative] = False
        records = read_records(self.work / WAL_FILE) if WAL_FILE in self.immutable else []
        seq = max([*self.stores.values(), *(r["seq"] for r in records)])
        files = [
            {"path": path, **_digest(self.work / path), "immutable": immutable}
            for path, immutable in sorted(self.immutable.items())
        ]
        manifest = read_manifest(self.index_dir)
        name = _free_name(self.into, f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{seq}")
        summary = {
            "format": FORMAT,
            "name": name,
            "taken_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "seq": seq,
            "stores": self.stores,
            "log_records": len(records),
            "index": {"dataset": manifest.dataset, "fingerprint": manifest.fingerprint, "encoder": manifest.encoder},
            "files": len(files),
            "bytes": sum(f["bytes"] for f in files),
            "linked_bytes": self.linked_bytes,
            "writes_held_s": round(self.fixed_s, 4),
            "seconds": round(time.perf_counter() - self.started, 3),
        }
        with open(self.work / SNAPSHOT_FILE, "w") as fh:
            json.dump({**summary, "files": files}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_tree(self.work)
        os.rename(self.work, self.into / name)
        fsync_dir(self.into)
        return {**summary, "path": str(self.into / name)}

    def _link(self, relative: str) -> None:
        """An immutable file linked into the snapshot, or copied where it cannot be linked."""
        self.immutable[relative] = True
        source, target = self.index_dir / relative, self.work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if link_or_copy(source, target):
            self.linked_bytes += target.stat().st_size


def link_or_copy(source: Path, target: Path) -> bool:
    """``target`` a hard link of ``source`` (True), or a durable copy (False) where the two are on
    different filesystems or this one has no links."""
    try:
        os.link(source, target)
        return True
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
    with open(source, "rb") as src, open(target, "wb") as dst:
        _copy(src, dst)
    return False


def read_snapshot(snapshot: Path) -> dict:
    """A snapshot's manifest, with its file list checked against the folder (not yet the bytes):
    SnapshotDamaged names what is torn or altered."""
    snapshot = Path(snapshot)
    path = snapshot / SNAPSHOT_FILE
    if not snapshot.is_dir():
        raise SnapshotDamaged(f"{snapshot}: no snapshot here (not a folder)")
    if not path.is_file():
        raise SnapshotDamaged(
            f"{snapshot}: no {SNAPSHOT_FILE}, so this is not a snapshot or one whose taking stopped before the end"
            " (torn); take another"
        )
    try:
        manifest = json.loads(path.read_text())
        listed = {f["path"]: f for f in manifest["files"]}
        fmt = manifest["format"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotDamaged(f"{path}: unreadable snapshot manifest ({exc}); the snapshot was altered") from None
    if fmt != FORMAT:
        raise SnapshotDamaged(f"{path}: snapshot format {fmt}, this version reads {FORMAT}")
    held = set(_files_in(snapshot)) - {SNAPSHOT_FILE}
    missing, extra = sorted(set(listed) - held), sorted(held - set(listed))
    if missing:
        raise SnapshotDamaged(
            f"{snapshot}: {missing[0]} is missing ({len(missing)} of the {len(listed)} files its manifest lists);"
            " the snapshot is torn or was altered, restore another"
        )
    if extra:
        raise SnapshotDamaged(f"{snapshot}: {extra[0]} is not in its manifest; the snapshot was altered")
    return manifest


def restore(snapshot: Path, index_dir: Path, settle: Callable[[Path], None] | None = None) -> dict:
    """The snapshot as a new index directory ``index_dir``: every file checked against the
    manifest's size and SHA-256 as it is placed in a hidden folder beside it (immutable files
    linked), ``settle(folder)`` run there (replaying the log into the stores), then renamed into
    place. Refuses an ``index_dir`` that holds anything, and a torn or altered snapshot, leaving
    nothing behind."""
    started = time.perf_counter()
    snapshot, index_dir = Path(snapshot), Path(index_dir)
    manifest = read_snapshot(snapshot)
    if index_dir.exists() and (not index_dir.is_dir() or any(index_dir.iterdir())):
        raise IndexDirError(f"{index_dir} already exists; restore into a new folder (nothing was changed)")
    work = index_dir.parent / f".{index_dir.name}.restoring"
    try:
        index_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)  # left by a restore that was killed
        work.mkdir()
    except OSError as exc:
        raise IndexDirError(f"{index_dir}: no index can be restored here ({exc.strerror or exc})") from None
    try:
        for entry in manifest["files"]:
            source, target = snapshot / entry["path"], work / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if entry["immutable"]:
                link_or_copy(source, target)
            else:
                with open(source, "rb") as src, open(target, "wb") as dst:
                    _copy(src, dst)
            found = _digest(target)
            if found != {"bytes": entry["bytes"], "sha256": entry["sha256"]}:
                what = "size" if found["bytes"] != entry["bytes"] else "SHA-256"
                raise SnapshotDamaged(
                    f"{source}: its {what} is not the one its manifest holds; the snapshot was altered or damaged,"
                    " restore another"
                )
        _fsync_tree(work)
        checked = time.perf_counter() - started
        if settle is not None:
            settle(work)
        if index_dir.exists():
            index_dir.rmdir()  # empty (checked above)
        os.rename(work, index_dir)
        fsync_dir(index_dir.parent)
    except OSError as exc:  # unreadable, or no room: said in one line, nothing left behind
        shutil.rmtree(work, ignore_errors=True)
        raise IndexDirError(f"{index_dir}: the restore failed ({exc}); nothing of it was kept") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return {
        "snapshot": str(snapshot),
        "index_dir": str(index_dir),
        "seq": manifest["seq"],
        "log_records": manifest["log_records"],
        "files": len(manifest["files"]),
        "bytes": manifest["bytes"],
        "checked_seconds": round(checked, 3),
        "seconds": round(time.perf_counter() - started, 3),
    }


def listing(folder: Path) -> list[dict]:
    """The snapshots in ``folder``, oldest first, as their manifests summarise them (unverified)."""
    found = []
    for path in sorted(Path(folder).glob(f"*/{SNAPSHOT_FILE}")):
        if path.parent.name.startswith("."):
            continue
        try:
            manifest = json.loads(path.read_text())
            summary = {k: v for k, v in manifest.items() if k != "files"} | {"files": len(manifest["files"])}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            summary = {"name": path.parent.name, "error": f"unreadable manifest ({exc})"}
        found.append({**summary, "path": str(path.parent)})
    return found


def _other_files(index_dir: Path) -> list[str]:
    """The index's files a snapshot copies as they are: neither fixed at the position nor the writer's."""
    dense = {p.name for p in (*index_dir.glob("dense*.faiss"), *index_dir.glob("delta-*.npz"))}
    return [p for p in _files_in(index_dir) if p.split("/")[0] not in _LEFT_OUT | _TAKEN_APART | dense]


def _files_in(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative, with /), hidden ones (work in progress) left out."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, f).relative_to(folder).as_posix() for f in files if not f.startswith(".")]
    return sorted(found)


def _free_name(folder: Path, name: str) -> str:
    taken, n = name, 1
    while (folder / taken).exists():
        n += 1
        taken = f"{name}-{n}"
    return taken


def _copy(src, dst, size: int | None = None) -> None:
    """``size`` bytes of ``src`` (all when None) into ``dst``, fsynced."""
    left = size
    while left is None or left > 0:
        block = src.read(_CHUNK if left is None else min(_CHUNK, left))
        if not block:
            break
        dst.write(block)
        if left is not None:
            left -= len(block)
    dst.flush()
    os.fsync(dst.fileno())


def _digest(path: Path) -> dict:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            sha.update(block)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def _fsync_tree(folder: Path) -> None:
    """Every folder under ``folder`` (and it) fsynced: the files' names are durable too."""
    for root, _, _ in os.walk(folder, topdown=False):
        fsync_dir(Path(root))
