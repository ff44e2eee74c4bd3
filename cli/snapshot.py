"""``snapshot create`` and ``snapshot restore``: a consistent copy of an index at one write, and a
new index made from one (how, and why it is consistent: :mod:`engine.store.snapshot`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.flags import WHERE, add_settings
from serving.settings import Settings

CREATE = """A consistent copy of --index-dir at one write, every file checksummed (SHA-256) in the snapshot's
snapshot.json: files that never change (Lucene's commit, the dense index) hard-linked, the write-ahead log
and the document store copied at one position of the log. This command snapshots an index no process writes
(stopped, or served --read-only: it holds the writer's lock meanwhile); a server that writes the index takes
its own while it serves and writes: POST /snapshots."""
RESTORE = """A new index directory from SNAPSHOT: every file is checked against the snapshot's checksums and
file list as it is placed in a hidden folder beside --index-dir (immutable files linked), the logged
writes the snapshot holds are replayed there, and the folder is renamed into place. A torn or altered
snapshot is refused, naming the file, and leaves nothing behind; so does an --index-dir that exists."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "snapshot",
        help="take a consistent copy of an index (create), or make a new index from one (restore)",
        description="Snapshots: a consistent copy of an index at one write, taken while it serves, with"
        " checksums; restored into a new index. Over REST on a running server: POST /snapshots, GET /snapshots.",
        epilog="examples:\n"
        "  hybrid-search snapshot create --index-dir indexes/nfcorpus --to backups/\n"
        "  hybrid-search snapshot restore backups/20261128T101500Z-0 --index-dir indexes/nfcorpus-restored\n"
        "  curl -X POST http://127.0.0.1:8000/snapshots      # a running server's own, in --snapshots-dir",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    c = actions.add_parser(
        "create",
        help="snapshot an index no server writes",
        description=CREATE,
        epilog="examples:\n  hybrid-search snapshot create --index-dir indexes/nfcorpus\n"
        "  hybrid-search snapshot create --index-dir indexes/nfcorpus --to /mnt/backup/nfcorpus   # copied there",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--to",
        type=Path,
        metavar="DIR",
        help="folder to put the snapshot in, as DIR/<time>-<write> (default: --snapshots-dir's, else"
        " <index-dir>.snapshots beside the index; on the index's filesystem, immutable files are linked)",
    )
    add_settings(c, ["index_dir", "snapshots_dir"])
    c.set_defaults(run=create)

    r = actions.add_parser(
        "restore",
        help="make a new index from a snapshot, checked",
        description=RESTORE,
        epilog="example:\n  hybrid-search snapshot restore indexes/nfcorpus.snapshots/20261128T101500Z-412"
        " --index-dir indexes/nfcorpus-412",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("snapshot", type=Path, metavar="SNAPSHOT", help="a snapshot's folder (with its snapshot.json)")
    add_settings(r, WHERE, {"index_dir": "the new index's folder, which must not exist yet (no default: required)"})
    r.set_defaults(run=restore)


def create(settings: Settings, args: argparse.Namespace) -> int:
    from engine.live.writer import snapshot_unwritten
    from engine.store.snapshot import default_folder

    index_dir = Path(settings.engine.index_dir)
    into = args.to or settings.serving.snapshots_dir or default_folder(index_dir)
    taken = snapshot_unwritten(index_dir, into)
    print(
        f"snapshot {taken['path']}: write {taken['seq']} ({taken['log_records']} logged writes to replay),"
        f" {taken['files']} files, {_mb(taken['bytes'])} ({_mb(taken['linked_bytes'])} linked), in"
        f" {taken['seconds']:.2f} s"
    )
    return 0


def restore(settings: Settings, args: argparse.Namespace) -> int:
    from engine.store.snapshot import restore as restore_snapshot

    if args.index_dir is None:
        raise ValueError("snapshot restore needs --index-dir NEW: the new index's folder, which must not exist yet")

    def replay(folder: Path) -> None:
        """The logged writes the snapshot holds applied to every store and checkpointed (what a
        writer's start does): the index opens read-only too, and proves it opens."""
        from engine.search import HybridEngine
        from engine.store.index_dir import WAL_FILE

        log = folder / WAL_FILE
        if log.exists() and log.stat().st_size:
            engine = settings.engine.model_copy(update={"index_dir": folder, "rerank": False})
            HybridEngine(engine, writable=True).close()  # replays at open, checkpoints at close

    restored = restore_snapshot(args.snapshot, args.index_dir, replay)
    print(
        f"restored {restored['snapshot']} into {restored['index_dir']}: write {restored['seq']},"
        f" {restored['files']} files ({_mb(restored['bytes'])}) checked in {restored['checked_seconds']:.2f} s,"
        f" {restored['log_records']} logged writes replayed, in {restored['seconds']:.2f} s in all"
    )
    return 0


def _mb(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"
