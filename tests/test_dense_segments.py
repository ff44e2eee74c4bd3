"""The dense index as a mapped base and the writes since it (engine/retrieval/segments.py), on
real FAISS indexes, flat, inverted-file and a refined scan, written live through the engine's writer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.settings import EngineSettings
from index_build.settings import BuildSettings
from tests.helpers import retrieved

QUERIES = ["caffeine and the liver", "zanzibar clove harvest", "soy isoflavones and prostate cancer", "coffee"]


def _engine(index_dir: Path, **kwargs):
    from engine.search import HybridEngine

    return HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False, fusion="rrf"), **kwargs)


def _answers(engine) -> dict[str, list[tuple[str, float]]]:
    return {
        q: [(unit, round(score, 4)) for unit, score in retrieved(engine.dense, engine.dense.encode_query(q), 12)]
        for q in QUERIES
    }


def _mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (a FAISS read with the mmap flags)."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.fixture(scope="module")
def built(index_dir, beir_dir, tmp_path_factory):
    """The tiny BEIR index with each dense index kind, built once for the module."""
    from index_build.builder import build_index

    made = {"flat": index_dir}

    def build(kind: str) -> Path:
        if kind not in made:
            made[kind] = tmp_path_factory.mktemp("dense") / "index"
            settings = EngineSettings(index_dir=made[kind], device="cpu", fusion="rrf")
            build_index(settings, BuildSettings(data_dir=beir_dir, adapt="none", dense_index=kind), progress=False)
        return made[kind]

    return build


@pytest.fixture(params=["flat", "IVF4,Flat", "scan"])
def dense_dir(request, built, tmp_path) -> Path:
    target = tmp_path / "dense"
    shutil.copytree(built(request.param), target)
    return target


def test_writes_since_the_base_cost_their_rows_and_search_as_the_merged_index(dense_dir):
    from engine.documents import DocumentIn

    base = dense_dir / "dense.faiss"
    size = base.stat().st_size
    writer = _engine(dense_dir, writable=True)
    try:
        held = writer.dense.segments.base.ntotal
        gone, replaced = (h.document_id for h in writer.search("caffeine and the liver", 2))
        writer.live.delete(gone)
        chunks = [{"chunk_id": "c1", "content": "zanzibar clove harvest yields"}]
        writer.live.upsert(DocumentIn.model_validate({"document_id": "new-1", "chunks": chunks}))
        chunks = [{"chunk_id": "c1", "content": "coffee roasting in small batches"}]
        writer.live.upsert(DocumentIn.model_validate({"document_id": replaced, "chunks": chunks}))
        writer.live.refresh()
        segments = writer.dense.segments
        assert segments.base.ntotal == held and len(segments.removed) >= 2 and segments.delta.ntotal == 2
        assert _mapped(base)  # the base stays mapped read-only: the writes are beside it
        live = _answers(writer)
        assert live["zanzibar clove harvest"][0][0] == "new-1#c1"
        assert all(not unit.startswith(f"{gone}#") for answers in live.values() for unit, _ in answers)

        written = writer.live.checkpoint()
        assert not written["dense_merged"] and 0 < written["dense_bytes"] < size / 4
        assert [p.name for p in dense_dir.glob("dense*.faiss")] == ["dense.faiss"] and base.stat().st_size == size
    finally:
        writer.close()
    reader = _engine(dense_dir)  # the base mapped again, the delta read from its file
    try:
        assert _answers(reader) == live
    finally:
        reader.close()

    writer = _engine(dense_dir, writable=True)  # `hybrid-search compact`: one base again
    try:
        merged = writer.live.checkpoint(merge=True)
        assert merged["dense_merged"] and not list(dense_dir.glob("delta-*.npz")) and not base.exists()
        assert writer.dense.segments.base.ntotal == held and not writer.dense.segments.removed
        assert _answers(writer) == live
    finally:
        writer.close()
    reader = _engine(dense_dir)
    try:
        assert _answers(reader) == live  # FAISS's own removal and addition: the same index
    finally:
        reader.close()


def test_a_writer_stopped_dead_after_replacing_and_deleting_starts_again(index_dir, tmp_path):
    """Replayed from the log, a replacement's and a deletion's old rows leave the dense view too
    (before, a replay skipped them, as no row was named yet, and the writer refused to start)."""
    import subprocess
    import sys

    from tests.test_live import _doc

    target = tmp_path / "dead"
    shutil.copytree(index_dir, target)
    reader = _engine(target)
    gone, replaced = (h.document_id for h in reader.search("caffeine and the liver", 2))
    reader.close()
    script = f"""
import os
from engine.documents import DocumentIn
from engine.search import HybridEngine
from engine.settings import EngineSettings
engine = HybridEngine(EngineSettings(index_dir={str(target)!r}, device="cpu", rerank=False), writable=True)
engine.live.delete({gone!r}, wait=True)
engine.live.upsert(DocumentIn.model_validate({_doc(replaced, "quokka marsupial diet")!r}), wait=True)
os._exit(0)  # no checkpoint: the next start replays the log
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    writer = _engine(target, writable=True)
    try:
        assert writer.live.recovery["records"] == 2
        hits = writer.search("caffeine and the liver", 20)
        assert gone not in {h.document_id for h in hits}
        top = retrieved(writer.dense, writer.dense.encode_query("quokka marsupial diet"), 1)[0][0]
        assert top.startswith(f"{replaced}#")
        assert len(writer.dense.units) == writer.bm25.documents
    finally:
        writer.close()


@pytest.mark.parametrize("dense_dir", ["IVF4,Flat"], indirect=True)  # the size that merges; flat merges alike
def test_a_merge_runs_beside_the_writes_and_keeps_every_write_since_it_began(dense_dir, monkeypatch):
    """The writes since the base merged on a thread while more are written (some removing rows the
    merge took in); placed at the next checkpoint with those as its delta: the answers of the live
    view, in the writer and in a reader."""
    from engine.documents import DocumentIn
    from engine.retrieval import merge

    monkeypatch.setattr(merge, "MERGE_MIN", 1)
    monkeypatch.setattr(merge, "MERGE_SHARE", 0.0)
    (dense_dir / ".dense-000000000099.faiss.tmp").write_bytes(b"a merge a crash cut short")

    def doc(document_id: str, text: str) -> DocumentIn:
        return DocumentIn.model_validate({"document_id": document_id, "chunks": [{"chunk_id": "c1", "content": text}]})

    writer = _engine(dense_dir, writable=True)
    try:
        assert not list(dense_dir.glob(".dense-*.tmp"))  # the crash's leftover is gone
        held = writer.dense.segments.base.ntotal
        first, second, third = (h.document_id for h in writer.search("caffeine and the liver", 3))
        writer.live.upsert(doc("early", "zanzibar clove harvest yields"))
        writer.live.delete(first)
        writer.live.refresh()
        started = writer.live.checkpoint()
        running = writer.live.merger.running
        assert not started["dense_merged"] and running is not None  # a delta now, the merge beside it
        writer.live.upsert(doc("late", "coffee roasting in small batches"))
        writer.live.delete("early")  # a row the merge took in
        writer.live.delete(second)
        writer.live.upsert(doc(third, "soy isoflavones and prostate cancer trial"))
        writer.live.refresh()
        running.join()
        live = _answers(writer)
        assert any(unit.startswith("late#") for unit, _ in live["coffee"])
        assert not any(unit.startswith(("early#", f"{first}#")) for answers in live.values() for unit, _ in answers)
        placed = writer.live.checkpoint()
        assert placed["dense_merged"] and writer.live.merger.running is None
        now = writer.dense.segments.checkpoint
        assert now.base.name == f"dense-{running.seq:012d}.faiss" and writer.dense.segments.base.ntotal == held
        assert sorted(p.name for p in dense_dir.glob("de*")) == sorted([now.base.name, now.delta.name])
        assert _answers(writer) == live
    finally:
        writer.close()
    reader = _engine(dense_dir)
    try:
        assert _answers(reader) == live
    finally:
        reader.close()


def test_a_kept_filters_rows_follow_the_writes(dense_dir):
    """A filter's rows kept across searches (a kept filter's, which a follower's store, ahead of its
    view, may hold before the view does): a flat index selects them by their bitmap, an inverted
    file scores them exactly from vectors it read once; either way a row the view takes in later is
    found from then on, as by a search given the rows anew."""
    import numpy as np

    from engine.documents import DocumentIn
    from engine.retrieval.protocol import Query, Rows, Within

    writer = _engine(dense_dir, writable=True)
    try:
        held = writer.dense.row_ids()
        rows = Rows(np.concatenate([held, np.arange(held.max() + 1, held.max() + 64)]))  # and the next rows

        def search(text: str, within: Within) -> list[str]:
            return [u for u, _ in writer.dense.retrieve(Query(text, writer.dense.encode_query(text)), 5, within)]

        kept = Within(rows=rows)
        assert search("zanzibar clove harvest", kept)[0] != "new-1#c1"
        chunks = [{"chunk_id": "c1", "content": "zanzibar clove harvest yields"}]
        writer.live.upsert(DocumentIn.model_validate({"document_id": "new-1", "chunks": chunks}))
        writer.live.refresh()
        assert search("zanzibar clove harvest", kept)[0] == "new-1#c1"
        for text in QUERIES:
            assert search(text, kept) == search(text, Within(rows=Rows(rows.ids.copy())))
    finally:
        writer.close()


@pytest.mark.parametrize("dense_dir", ["scan"], indirect=True)
def test_a_refined_scan_asks_for_more_when_removed_rows_crowd_its_top(dense_dir, monkeypatch):
    """FAISS's fast-scan codes take no selector: removed rows are dropped from what the scan
    returns, and when they fill what was asked, it asks again for twice as many."""
    import numpy as np

    from engine.retrieval import segments as module
    from engine.retrieval.protocol import Rows
    from engine.retrieval.segments import DenseSegments
    from engine.store.index_dir import latest_dense

    monkeypatch.setattr(module, "SCAN_DEPTH", 1)  # 100 in use: more than this index holds

    segments = DenseSegments(latest_dense(dense_dir))
    assert segments.refined
    rows = np.sort(segments.row_ids())
    vectors = segments.reconstruct(rows)
    vector = vectors[:1].copy()
    exact = rows[np.argsort(-(vectors @ vector[0]), kind="stable")]
    segments.remove(exact[:3].tolist())  # the three nearest: a search for one asks for two, then four
    _, found = segments.search(vector, 1)
    assert found.tolist() == [exact[3]]
    _, found = segments.search(vector, len(rows))
    assert sorted(found.tolist()) == sorted(exact[3:].tolist())
    allowed = exact[4::2]  # a filter's rows: searched by the scan (the engine's kind when a filter is wide)
    _, found = segments.search(vector, 3, within=Rows(allowed), wider=2)
    assert found.tolist() == allowed[:3].tolist()
