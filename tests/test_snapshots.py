"""Snapshots (engine/store/snapshot.py): taken while a live index writes, restored into a new index
that answers as the index did at the snapshot's write; torn or altered ones refused by name."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from benchmarks.snapshots import opened, replayed_copy, top10
from cli.main import main
from engine.documents import DocumentIn
from engine.settings import EngineSettings
from engine.store.index_dir import WAL_FILE
from engine.store.snapshot import SNAPSHOT_FILE, restore
from engine.store.wal import read_records
from offline.server_process import free_port, serve_args, start_server, stop_server, worker_client, workers_up
from tests.helpers import TOPICS, writable_engine

CPU = EngineSettings(device="cpu", rerank=False)
QUERIES = {f"q-{topic}": words for topic, words in TOPICS.items()} | {"q-new": "snapshot marker kiwifruit"}


def _document(i: int) -> DocumentIn:
    words = list(TOPICS.values())[i % len(TOPICS)]
    return DocumentIn(
        document_id=f"new-{i}",
        document_name=f"New {i}",
        chunks=[{"chunk_id": "a", "content": f"{words} snapshot marker kiwifruit{i}"}],
    )


def _restore(snapshot: str | Path, target: Path, capsys) -> tuple[int, str]:
    code = main(["snapshot", "restore", str(snapshot), "--index-dir", str(target), "--device", "cpu"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out + out.err


def test_a_snapshot_taken_while_writing_restores_every_acknowledged_write_and_the_same_top_10(
    index_dir, tmp_path, capsys
):
    engine = writable_engine(index_dir, tmp_path)
    live = engine.live
    acks: list[dict] = []
    failures: list[BaseException] = []
    logged: list[dict] = []  # every record the writer's log held, for the reference
    stop = threading.Event()

    def write() -> None:
        try:
            for i in range(1000):
                if stop.is_set():
                    return
                acks.append(live.upsert(_document(i)))
                if i == 3:  # the log emptied once: a dense delta and a Lucene commit to link
                    logged.extend(read_records(live.index_dir / WAL_FILE))
                    live.checkpoint()
        except BaseException as exc:  # noqa: BLE001 - a failed write fails the test
            failures.append(exc)

    def search() -> None:
        while not stop.is_set():
            try:
                engine.search("vitamin D bone density", 10)
            except BaseException as exc:  # noqa: BLE001 - any failed search fails the test
                failures.append(exc)

    threads = [threading.Thread(target=write), threading.Thread(target=search)]
    for thread in threads:
        thread.start()

    def wait_for(count: int) -> None:
        while len(acks) < count:
            assert threads[0].is_alive(), failures
            stop.wait(0.05)

    try:
        wait_for(8)
        assert main(["snapshot", "create", "--index-dir", str(live.index_dir)]) == 2  # the writer takes its own
        assert "another process writes this index" in capsys.readouterr().err
        taken = live.snapshot(tmp_path / "snaps")
        wait_for(len(acks) + 3)  # and writes go on after it
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    logged.extend(read_records(live.index_dir / WAL_FILE))
    engine.close()
    assert not failures
    seq = taken["seq"]
    assert [r["seq"] for r in logged] == list(range(1, len(acks) + 1))
    assert taken["stores"]["lucene"] < seq and taken["log_records"] > 0  # restoring replays the log
    assert taken["linked_bytes"] > 0 and Path(taken["path"]).name == taken["name"]

    code, said = _restore(taken["path"], tmp_path / "restored", capsys)
    assert code == 0, said
    assert f"write {seq}" in said and not list(tmp_path.glob(".restored*"))
    restored = opened(tmp_path / "restored", CPU)  # read-only: the restore replayed the log
    try:
        for ack in acks:
            held = restored.store.document(ack["document_id"]) is not None
            assert held == (ack["seq"] <= seq), (ack, seq)
        got = top10(restored, QUERIES)
    finally:
        restored.close()
    # the index at that write made without the snapshot: the original and the writer's own log up to it
    reference = opened(replayed_copy(index_dir, logged, seq, tmp_path / "reference", CPU), CPU)
    try:
        assert got == top10(reference, QUERIES)
    finally:
        reference.close()


def test_a_torn_or_altered_snapshot_is_refused_by_name_and_leaves_nothing(index_dir, tmp_path, capsys):
    copy = tmp_path / "index"
    shutil.copytree(index_dir, copy)
    # on another filesystem where there is one (tmpfs): no links, copies
    shm = Path("/dev/shm")
    into = shm / f"snap-test-{tmp_path.name}" if shm.is_dir() else tmp_path / "snaps"
    try:
        assert main(["snapshot", "create", "--index-dir", str(copy), "--to", str(into)]) == 0
        said = capsys.readouterr().out
        (snapshot,) = [p for p in into.iterdir()]
        assert str(snapshot) in said and ("0.0 MB linked" in said or not shm.is_dir())
        good = tmp_path / "good"
        shutil.copytree(snapshot, good)
    finally:
        shutil.rmtree(into, ignore_errors=True)
    assert main(["snapshot", "create", "--index-dir", str(copy), "--to", str(tmp_path / "linked")]) == 0
    assert "0.0 MB linked" not in capsys.readouterr().out  # beside the index: linked

    def case(name: str, change) -> str:
        bad = tmp_path / name
        shutil.copytree(good, bad)  # copies: the index's own files are never touched
        change(bad)
        target = tmp_path / f"restored-{name}"
        code, said = _restore(bad, target, capsys)
        assert code == 2, said
        assert not target.exists() and not list(tmp_path.glob(f".restored-{name}*"))
        return said

    def flip(folder: Path) -> None:
        with open(folder / "docs.sqlite", "r+b") as fh:
            fh.seek(5000)
            byte = fh.read(1)
            fh.seek(5000)
            fh.write(bytes([byte[0] ^ 1]))

    assert "docs.sqlite: its SHA-256 is not the one its manifest holds" in case("byte", flip)
    said = case("missing", lambda f: next((f / "bm25").glob("segments_*")).unlink())
    assert "bm25/segments_" in said and "is missing" in said and "torn or was altered" in said
    assert "is not in its manifest" in case("extra", lambda f: (f / "memory" / "more.bin").write_bytes(b"x"))
    assert "torn" in case("torn", lambda f: (f / SNAPSHOT_FILE).unlink())
    assert "unreadable snapshot manifest" in case("garbled", lambda f: (f / SNAPSHOT_FILE).write_text("{"))

    restored = restore(good, tmp_path / "restored")  # and the untouched one restores
    assert restored["files"] == len(list(p for p in good.rglob("*") if p.is_file())) - 1
    code, said = _restore(good, tmp_path / "restored", capsys)
    assert code == 2 and "already exists" in said


@pytest.mark.slow  # a server of two workers of its own
def test_post_snapshots_reaches_the_writer_of_workers_and_get_lists_them(index_dir, tmp_path, capsys):
    """Through the follower of ``serve --workers 2``: the writer (worker 0) takes it, after the write
    acknowledged before it; a new index restored from it holds that write."""
    served = tmp_path / "served"
    shutil.copytree(index_dir, served)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--workers", "2", "--snapshots-dir", str(tmp_path / "snaps"), "--no-rerank", "--warmup-searches", "0"]
    proc = start_server(serve_args(served, port, *extra), f"{url}/health", tmp_path / "serve.log")
    try:
        workers_up(url)  # the writer too: until its channel is up, a follower refuses writes (503)
        follower, _ = worker_client(url, "follower", timeout_s=120)
        try:
            ack = follower.post("/documents", json=_document(1).model_dump(mode="json")).json()
            taken = follower.post("/snapshots")
            assert taken.status_code == 201, taken.text
            taken = taken.json()
            listed = follower.get("/snapshots").json()
            paths = follower.get("/openapi.json").json()["paths"]
        finally:
            follower.close()
        assert taken["seq"] >= ack["seq"] and taken["files"] > 5 and taken["bytes"] > 0 and taken["seconds"] >= 0
        assert [s["name"] for s in listed["snapshots"]] == [taken["name"]]
        assert {"get", "post"} <= set(paths["/snapshots"])
    finally:
        assert stop_server(proc) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
    code, said = _restore(taken["path"], tmp_path / "restored", capsys)
    assert code == 0, said
    from engine.store.docstore import DocStore

    assert DocStore(tmp_path / "restored" / "docs.sqlite").document("new-1") is not None
