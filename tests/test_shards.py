"""``build --shards``: documents partitioned by a hash of their id into whole shard indexes, searched in
one process as one index (real Lucene, FAISS and SQLite), with every stage's rankings the unsharded
index's."""

from __future__ import annotations

import numpy as np
import pytest

from engine.documents import Filters
from engine.settings import EngineSettings
from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE, IndexDirError, read_manifest, shard_dir, shard_of
from index_build.settings import BuildSettings

SHARDS = 3
QUERIES = ["arsenic in rice", "soy and breast cancer", "broccoli sulforaphane", "red meat", "report", "the of"]


@pytest.fixture(scope="module")
def sharded_dir(beir_dir, tmp_path_factory):
    from index_build.builder import build_index

    target = tmp_path_factory.mktemp("sharded") / "tiny"
    build_index(
        EngineSettings(index_dir=target, device="cpu"), BuildSettings(data_dir=beir_dir, shards=SHARDS), progress=False
    )
    return target


@pytest.fixture(scope="module")
def engines(index_dir, sharded_dir, tmp_path_factory):
    """The unsharded engine, and the sharded index with the unsharded one's learned fusion: what the
    shards retrieve compared alone (a fusion trained on the shards' scores, equal to float rounding,
    is LightGBM's own answer to them: docs/ray.md)."""
    import shutil

    from engine.search import HybridEngine
    from engine.store.index_dir import FUSION_DIR

    copy = tmp_path_factory.mktemp("sharded-copy") / "tiny"
    shutil.copytree(sharded_dir, copy)
    shutil.rmtree(copy / FUSION_DIR)
    shutil.copytree(index_dir / FUSION_DIR, copy / FUSION_DIR)
    whole = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False))
    sharded = HybridEngine(EngineSettings(index_dir=copy, device="cpu", rerank=False))
    yield whole, sharded
    whole.close()
    sharded.close()


def test_each_document_is_in_the_shard_its_id_names_with_its_rows_in_the_whole(index_dir, sharded_dir):
    manifest = read_manifest(sharded_dir)
    assert manifest.shards == SHARDS and manifest.memory["queries"] > 0
    assert (sharded_dir / "fusion" / "model.txt").is_file()  # trained on the shards' merged candidates
    whole = DocStore(index_dir / DOCS_FILE).unit_map()
    seen = {}
    for i in range(SHARDS):
        store = DocStore(shard_dir(sharded_dir, i) / DOCS_FILE)
        units = store.unit_map()
        assert len(units)
        for row, unit in units.pairs():
            assert shard_of(store.chunks([unit])[unit].document_id, SHARDS) == i
            seen[unit] = row
    assert seen == dict((unit, row) for row, unit in whole.pairs())  # one index's rows, each chunk once


def test_every_stage_ranks_as_the_unsharded_index(engines):
    whole, sharded = engines
    for query in QUERIES:
        want, got = whole.stages(query, 10), sharded.stages(query, 10)
        assert [d for d, _ in got.bm25] == [d for d, _ in want.bm25], query
        assert [s for _, s in got.bm25] == pytest.approx([s for _, s in want.bm25], rel=1e-5)
        assert got.dense == want.dense, query  # exact: the same vectors, ties by the same rows
        assert got.memory == want.memory
        assert [d for d, _ in got.final] == [d for d, _ in want.final], query
        assert [h.doc_id for h in sharded.search(query, 5)] == [h.doc_id for h in whole.search(query, 5)]


def test_filters_and_documents_are_answered_across_the_shards(engines):
    whole, sharded = engines
    ids = [f"D-{topic}-{i}" for topic in ("arsenic", "soy") for i in range(4)]
    assert len({shard_of(d, SHARDS) for d in ids}) > 1  # the filter's documents are on several shards
    only = Filters(document_ids=ids)
    want, got = whole.stages("rice soy cancer", 8, filters=only), sharded.stages("rice soy cancer", 8, filters=only)
    assert [d for d, _ in got.final] == [d for d, _ in want.final]
    assert {d.split("#")[0] for d, _ in got.final} <= set(ids)
    for doc_id in ids:
        assert sharded.store.document(doc_id) == whole.store.document(doc_id)
    assert sharded.store.document("D-nowhere") is None
    assert len(sharded.dense.units) == len(whole.dense.units)
    sims = sharded.dense.similarity(whole.dense.encode_query("soy"), [d for d, _ in want.final])
    assert np.allclose(sims, whole.dense.similarity(whole.dense.encode_query("soy"), [d for d, _ in want.final]))


def test_a_sharded_index_is_not_written_in_one_process(sharded_dir):
    from engine.search import HybridEngine

    with pytest.raises(IndexDirError, match="shards is read in one process"):
        HybridEngine(EngineSettings(index_dir=sharded_dir, device="cpu", rerank=False), writable=True)


def test_a_missing_shard_is_named(sharded_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(sharded_dir, copy)
    shutil.rmtree(shard_dir(copy, 1))
    with pytest.raises(IndexDirError, match="shards/1"):
        read_manifest(copy)


def test_too_many_shards_for_the_corpus_is_refused(beir_dir, tmp_path):
    from index_build.builder import build_index

    with pytest.raises(ValueError, match="leave a shard empty"):
        build_index(
            EngineSettings(index_dir=tmp_path / "x", device="cpu"),
            BuildSettings(data_dir=beir_dir, shards=64),
            progress=False,
        )
