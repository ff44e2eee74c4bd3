"""A build in parts: vectors made elsewhere (--vectors), BM25 indexed a part a process, a build
killed and run again that resumes, and the dense index chosen by size or named by a FAISS
index_factory string, taking live writes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.settings import EngineSettings
from engine.store.index_dir import read_manifest
from index_build.builder import build_index
from index_build.settings import BuildSettings
from index_build.vectors import VectorsError
from tests.helpers import retrieved

ROOT = Path(__file__).resolve().parents[1]


def _vectors(index_dir: Path) -> np.ndarray:
    """The encoded build's vectors, by store row."""
    import faiss

    index = faiss.read_index(str(index_dir / "dense.faiss"))
    base = faiss.downcast_index(index.index)
    rows = faiss.vector_to_array(index.id_map)
    vectors = np.zeros((base.ntotal, base.d), dtype=np.float32)
    vectors[rows] = base.reconstruct_n(0, base.ntotal)
    return vectors


def _build(tmp_path: Path, beir_dir: Path, name: str, **build) -> Path:
    target = tmp_path / name
    settings = EngineSettings(index_dir=target, device="cpu", fusion="rrf")
    build_index(settings, BuildSettings(data_dir=beir_dir, adapt="none", **build), progress=False)
    return target


def _top(index_dir: Path, query: str = "caffeine and the liver") -> list[str]:
    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False, fusion="rrf"))
    try:
        return [d for d, _ in retrieved(engine.dense, engine.dense.encode_query(query), 8)]
    finally:
        engine.close()


def test_vectors_given_as_npy_or_parquet_build_the_index_encoding_would(index_dir, beir_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = _vectors(index_dir)
    np.save(tmp_path / "v.npy", vectors * 3.0)  # any length: rows are normalised
    given = _build(tmp_path, beir_dir, "npy", vectors=tmp_path / "v.npy")
    ids = [json.loads(line)["_id"] for line in (beir_dir / "corpus.jsonl").read_text().splitlines()]
    order = np.random.default_rng(1).permutation(len(ids))  # any order: rows are matched by _id
    table = pa.table({"_id": [ids[i] for i in order], "vector": [vectors[i].tolist() for i in order]})
    pq.write_table(table, tmp_path / "v.parquet", row_group_size=7)
    from_parquet = _build(tmp_path, beir_dir, "parquet", vectors=tmp_path / "v.parquet")
    assert _top(given) == _top(from_parquet) == _top(index_dir)
    manifest = read_manifest(given)
    assert manifest.settings["vectors"]["file"] == str((tmp_path / "v.npy").resolve())
    assert manifest.encoder == read_manifest(index_dir).encoder  # queries are still encoded by the model


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((31, 384), np.float32) + 1, "31 rows for 32 chunks"),
        (np.ones((32, 768), np.float32), "768-dimensional, but the query encoder makes 384"),
        (np.vstack([np.ones((31, 384)), np.full((1, 384), np.nan)]).astype(np.float32), "row 31 is not finite"),
        (np.ones((32, 384), np.int64), "int64 values"),
    ],
)
def test_vectors_that_do_not_fit_are_refused_naming_what(beir_dir, tmp_path, array, message):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(VectorsError, match=message):
        _build(tmp_path, beir_dir, "bad", vectors=tmp_path / "bad.npy")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("ids", "message"),
    [(["nope"], "'nope' is not a record of the corpus"), (["D-coffee-0", "D-coffee-0"], "'D-coffee-0' appears twice")],
)
def test_a_parquet_file_with_a_foreign_or_repeated_id_is_refused(beir_dir, tmp_path, ids, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"_id": ids, "vector": [[0.1] * 384] * len(ids)}), tmp_path / "v.parquet")
    with pytest.raises(VectorsError, match=message):
        _build(tmp_path, beir_dir, "bad", vectors=tmp_path / "v.parquet")
    assert not (tmp_path / ".bad.building").exists()  # refused before any work: nothing kept to resume


BUILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from engine.settings import EngineSettings
from index_build.builder import build_index
from index_build.settings import BuildSettings
build_index(EngineSettings(index_dir={target!r}, device="cpu", fusion="rrf"),
            BuildSettings(data_dir={data!r}, adapt="none", part_chunks=4), progress=True)
"""


def test_a_killed_build_resumes_where_it_stopped_and_builds_the_same_index(index_dir, beir_dir, tmp_path, caplog):
    """A build killed (SIGKILL, in a process of its own) after two of its eight parts' vectors, then
    run again (in the test's process: an interpreter, torch and a JVM fewer to start)."""
    import logging

    target = tmp_path / "resumed"
    work = tmp_path / ".resumed.building"
    script = BUILD.format(target=str(target), data=str(beir_dir))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and first.poll() is None:
        state = work / "build.json"
        if state.is_file() and len(json.loads(state.read_text() or "{}").get("vectors", [])) >= 2:
            break
        time.sleep(0.01)
    assert first.poll() is None, "the build ended before it could be killed"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    done = json.loads((work / "build.json").read_text())["vectors"]
    assert 2 <= len(done) < 8 and not target.exists()
    caplog.set_level(logging.INFO)
    build_index(
        EngineSettings(index_dir=target, device="cpu", fusion="rrf"),
        BuildSettings(data_dir=beir_dir, adapt="none", part_chunks=4),
        progress=True,
    )
    logged = caplog.text
    assert "resuming" in logged
    assert "encoding 4 texts: started" in logged  # the parts left were encoded
    assert logged.count("encoding 4 texts: started") == 8 - len(done)  # and only those
    assert "BM25 index" not in logged  # finished before the kill: kept
    assert not work.exists()
    assert np.allclose(_vectors(target), _vectors(index_dir), atol=1e-6)
    assert _top(target) == _top(index_dir)


class _Stopping(list):
    """Documents whose reading stops (a crash) at the part starting at document ``stop``."""

    stop: int | None = None

    def __getitem__(self, at):
        if isinstance(at, slice) and at.start == self.stop:
            raise RuntimeError("stopped")
        return super().__getitem__(at)


def test_bm25_in_parts_on_two_processes_scores_as_one_writer_and_resumes_by_part(beir_dir, tmp_path):
    from engine.retrieval.lucene import LuceneIndex
    from index_build.bm25_build import build_bm25, index_documents
    from index_build.corpus import open_corpus
    from index_build.parts import BuildFolder, plan_parts

    corpus = open_corpus(beir_dir, 200, 40, False)
    docs = _Stopping(corpus.documents)
    parts = plan_parts(corpus.chunk_counts(), 4)
    assert len(parts) == 8
    index_documents(tmp_path / "one", docs)
    docs.stop = parts[5].docs.start
    with BuildFolder.open(tmp_path / "parts", {"k": 1}) as work, pytest.raises(RuntimeError, match="stopped"):
        build_bm25(tmp_path / "parts", docs, parts, work, 2, False)
    docs.stop = None
    with BuildFolder.open(tmp_path / "parts", {"k": 1}) as work:
        first = [p for p in work.state["done"] if p.startswith("bm25-part-")]
        assert 2 <= len(first) <= 5  # parts finished before the crash are kept...
        build_bm25(tmp_path / "parts", docs, parts, work, 2, False)
        assert work.state["done"][: len(first)] == first and len(work.state["done"]) == 8  # ...and not redone
    assert len(list((tmp_path / "parts").glob("*.si"))) == 1  # the parts' segments merged into one
    one, merged = LuceneIndex(tmp_path / "one"), LuceneIndex(tmp_path / "parts")
    try:
        assert merged.documents == one.documents == sum(corpus.chunk_counts())
        for query in ("caffeine and the liver", "vitamin D bone density", "coffee"):
            assert retrieved(merged, query, 50) == retrieved(one, query, 50) and retrieved(one, query, 50), query
    finally:
        one.close(), merged.close()


def test_the_dense_index_by_name_or_factory_string_takes_live_writes(beir_dir, tmp_path):
    from engine.documents import DocumentIn
    from engine.search import HybridEngine

    target = _build(tmp_path, beir_dir, "ivf", dense_index="IVF4,Flat")
    manifest = read_manifest(target)
    dense = manifest.settings["dense"]
    assert manifest.dense_index == "IVF4,Flat" and dense["nlist"] == 4
    assert 1 <= dense["nprobe"] <= 4 and dense["recall_at_32"] >= 0.95  # k: the corpus's size
    engine = HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank=False, fusion="rrf"), writable=True)
    try:
        engine.live.upsert(
            DocumentIn.model_validate(
                {"document_id": "new-1", "chunks": [{"chunk_id": "c1", "content": "zanzibar clove harvest yields"}]}
            )
        )
        engine.live.refresh()
        vector = engine.dense.encode_query("zanzibar clove harvest")
        assert retrieved(engine.dense, vector, 1)[0][0] == "new-1#c1"  # in the inverted file, found by the probes
        assert "new-1" in {h.document_id for h in engine.search("zanzibar clove harvest", 3)}
        # a filter's rows outside the probed lists are found all the same
        from engine.retrieval.protocol import Rows

        engine.dense.segments.ivf.nprobe = 1
        allowed = [row for row, unit in engine.dense.units.pairs() if not unit.startswith("D-coffee")][:9]
        within = retrieved(engine.dense, vector, 20, rows=Rows(np.asarray(allowed)))
        assert sorted(engine.dense.units.get(u) for u, _ in within) == sorted(allowed)
        gone = engine.search("caffeine and the liver", 1)[0].document_id
        engine.live.delete(gone, wait=True)
        assert all(h.document_id != gone for h in engine.search("caffeine and the liver", 20))
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("IVFbanana", "not an index FAISS can make"),
        ("IVF64,Flat", "32 chunks, fewer than its 64 lists"),
        ("PQ48", "32 chunks, fewer than the 256 codes each part of a vector is trained to"),
    ],
)
def test_a_dense_index_that_cannot_be_made_is_refused_before_any_work(beir_dir, tmp_path, kind, message):
    with pytest.raises(ValueError, match=message):
        _build(tmp_path, beir_dir, "odd", dense_index=kind)
    assert not (tmp_path / "odd").exists() and not (tmp_path / ".odd.building").exists()


def test_an_index_presents_itself_as_built_or_by_its_folder(beir_dir, tmp_path):
    from engine.store.index_dir import default_presentation

    named = _build(tmp_path, beir_dir, "named", index_name="Clinic notes", index_description="a clinic's visit notes")
    assert read_manifest(named).presented() == ("Clinic notes", "a clinic's visit notes")
    assert default_presentation("nfcorpus") == ("NFCorpus", "NFCorpus medical abstracts")  # the benchmark's wording
    assert default_presentation("my-docs") == ("my-docs", "the documents of my-docs")
