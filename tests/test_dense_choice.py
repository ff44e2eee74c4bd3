"""The dense index ``auto`` chooses, by the corpus's shape as well as its size (index_build/dense_index.py):
IVF kept where its vectors cluster, a refined scan (past its size, or short of the recall, an HNSW
graph) where IVF would probe more than an eighth of its lists, the recall measured on query probes
and the reason in the manifest; and an HNSW index that takes live writes (removed rows skipped, the
graph built again when merged; a scan's writes: tests/test_dense_segments.py). Real FAISS
throughout; synthetic vectors for the choice, the tiny BEIR index for the build and the writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.settings import EngineSettings
from engine.store.index_dir import read_manifest
from index_build import dense_index
from index_build.builder import build_index
from index_build.settings import BuildSettings
from tests.helpers import retrieved

N, DIM, CENTRES = 4096, 16, 128


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def small_auto(monkeypatch):
    """``auto`` tries IVF from 1,000 vectors (200,000 in use), so that a few thousand make the choice."""
    import faiss

    monkeypatch.setattr(dense_index, "IVF_FROM", 1_000)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # on shared cores OpenMP's spinning threads cost more than they give
    yield
    faiss.omp_set_num_threads(threads)


def _clustered(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tight clusters (copies of a few texts, as NFCorpus's distractors are) and queries near them."""
    centres = _unit(rng.normal(size=(CENTRES, DIM)))
    vectors = _unit(centres[rng.integers(0, CENTRES, n)] + rng.normal(0, 0.05, (n, DIM)))
    return vectors, _unit(centres[rng.integers(0, CENTRES, 100)] + rng.normal(0, 0.08, (100, DIM)))


def _mixed(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Each vector the mean of four random clustered ones plus noise (passages mixing four abstracts'
    sentences, as in the issue's 300k corpus); queries alike."""
    clustered, _ = _clustered(rng, N)

    def mix(n: int) -> np.ndarray:
        return _unit(clustered[rng.integers(0, N, (n, 4))].mean(axis=1) + rng.normal(0, 0.05, (n, DIM)))

    return mix(N), mix(100)


def test_a_clustered_corpus_keeps_ivf_with_nprobe_tuned_on_the_queries_given(small_auto):
    vectors, queries = _clustered(np.random.default_rng(0), N)
    asked = []

    def probes() -> np.ndarray:
        asked.append(1)
        return queries

    index, info = dense_index.build_dense(vectors, "auto", queries=probes, probes="100 test queries")
    assert asked == [1]  # encoded once, and the recall is theirs
    assert info["factory"].startswith("IVF") and info["choice"]["chosen"] == info["factory"]
    assert info["nprobe"] <= info["nlist"] // dense_index.MOST_PROBED and info["recall_at_100"] >= 0.95
    assert info["recall_queries"] == 100 and info["probes"] == "100 test queries"
    assert "100 test queries" in info["choice"]["why"] and "ivf_tried" not in info
    assert index.nprobe == info["nprobe"]


def test_a_mixed_corpus_where_ivf_needs_more_than_an_eighth_of_its_lists_gets_a_refined_scan(small_auto, caplog):
    vectors, queries = _mixed(np.random.default_rng(1))
    rows = np.arange(N, dtype=np.int64) * 3 + 7  # a shard's rows: not its positions
    with caplog.at_level("INFO", logger="index_build.dense_index"):
        index, info = dense_index.build_dense(vectors, "auto", queries=lambda: queries, rows=rows, probes="mixed")
    tried = info["ivf_tried"]
    assert tried["nprobe"] > tried["nlist"] // dense_index.MOST_PROBED
    scan = f"PQ{DIM // 2}x4fs,RFlat"
    assert info["factory"] == scan and info["choice"]["chosen"] == scan and "scan_tried" not in info
    why = info["choice"]["why"]
    assert (
        f"nprobe {tried['nprobe']:,} of {tried['nlist']:,} lists" in why and "do not hold the probes' neighbours" in why
    )
    assert f"({scan}, k_factor {info['k_factor']})" in why and why in caplog.text  # the build's log says it too
    assert info["recall_at_100"] >= 0.95 and info["probes"] == "mixed"
    assert 1 <= info["k_factor"] <= dense_index.MOST_REFINED
    assert dense_index._kind(index).k_factor == info["k_factor"]  # written with the index
    _, found = index.search(queries[:5], 3)
    assert np.isin(found, rows).all()  # by the rows given


@pytest.mark.parametrize("short", ["size", "recall"])
def test_a_mixed_corpus_past_a_scans_size_or_short_of_its_recall_gets_a_graph(small_auto, monkeypatch, short):
    vectors, queries = _mixed(np.random.default_rng(1))
    if short == "size":
        monkeypatch.setattr(dense_index, "SCAN_UNTIL", N - 1)
    else:
        monkeypatch.setattr(dense_index, "MOST_REFINED", 1)  # no re-scoring past the top 100: short of 0.95
    index, info = dense_index.build_dense(vectors, "auto", queries=lambda: queries, probes="mixed")
    assert info["ivf_tried"]["nprobe"] > info["ivf_tried"]["nlist"] // dense_index.MOST_PROBED
    assert info["factory"] == "HNSW32" and info["choice"]["chosen"] == "HNSW32"
    why = info["choice"]["why"]
    assert "do not hold the probes' neighbours" in why and "so a graph (HNSW32: " in why
    if short == "size":
        assert f"{N:,} chunks, more than a scan's {N - 1:,}" in why and "scan_tried" not in info
    else:
        tried = info["scan_tried"]
        assert tried["k_factor"] == 1 and tried["recall_at_100"] < 0.95
        assert f"reaches only recall@100 {tried['recall_at_100']:.3f} at k_factor 1" in why
    assert info["ef_search"] >= 128 and info["recall_at_100"] >= 0.95
    assert dense_index._kind(index).hnsw.efSearch == info["ef_search"]  # written with the index


def _crowded(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Copies crowding a few texts (tight clusters, as the million distractors crowd 514 abstracts)
    and 100 originals alone between them; each probe a query near an original, which it seeks (a
    training query's judged document)."""
    copies, _ = _clustered(rng, N)
    originals = _unit(rng.normal(size=(100, DIM)))
    queries = _unit(originals + rng.normal(0, 0.3, originals.shape))
    return np.vstack([copies, originals]), queries, [np.array([N + i]) for i in range(100)]


def test_ivf_that_misses_the_answers_sought_is_left_though_its_recall_over_all_neighbours_is_met(small_auto):
    vectors, queries, sought = _crowded(np.random.default_rng(3))
    _, blind = dense_index.build_dense(vectors, "auto", queries=lambda: queries)
    assert blind["factory"].startswith("IVF") and blind["nprobe"] <= blind["nlist"] // dense_index.MOST_PROBED
    index, info = dense_index.build_dense(vectors, "auto", queries=lambda: queries, sought=sought)
    tried = info["ivf_tried"]
    assert tried["recall_at_100"] >= 0.95 and tried["nprobe"] > tried["nlist"] // dense_index.MOST_PROBED
    assert tried["nprobe"] > blind["nprobe"] and tried["sought"] > 50  # the originals exact search finds
    assert f"({tried['sought_recall_at_100']:.3f} of the answers sought)" in info["choice"]["why"]
    assert info["factory"] == f"PQ{DIM // 2}x4fs,RFlat" and info["sought_recall_at_100"] >= 0.95
    _, found = index.search(queries, 100)
    assert np.mean([N + i in row for i, row in enumerate(found.tolist())]) >= 0.5  # the originals, found


def test_without_queries_the_probes_are_corpus_vectors_and_say_so(small_auto):
    vectors, _ = _clustered(np.random.default_rng(2), N)
    _, info = dense_index.build_dense(vectors, "auto")
    assert info["probes"] == "200 corpus vectors" and info["recall_queries"] == 200
    _, info = dense_index.build_dense(vectors[:500], "auto")  # below IVF_FROM: exact, no probes needed
    assert info["choice"] == {"chosen": "Flat", "why": "auto: 500 chunks, below 1,000: exact search is fast"}
    assert "probes" not in info


def _engine(index_dir: Path, writable: bool = False):
    from engine.search import HybridEngine

    settings = EngineSettings(index_dir=index_dir, device="cpu", rerank=False, fusion="rrf")
    return HybridEngine(settings, writable=writable)


def test_an_hnsw_build_probes_with_training_queries_and_takes_live_writes_rebuilding_its_graph(beir_dir, tmp_path):
    from engine.documents import DocumentIn
    from engine.retrieval.protocol import Rows

    target = tmp_path / "hnsw"
    settings = EngineSettings(index_dir=target, device="cpu", fusion="rrf")
    build_index(settings, BuildSettings(data_dir=beir_dir, adapt="none", dense_index="hnsw"), progress=False)
    dense = read_manifest(target).settings["dense"]
    assert dense["factory"] == "HNSW32" and dense["recall_at_32"] == 1.0  # 32 chunks: the graph finds them all
    assert dense["sought_recall_at_32"] == 1.0 and dense["sought"] > 0  # the train queries' judged chunks
    assert dense["probes"].startswith(f"{dense['recall_queries']} of the dataset's train")  # never dev's or test's
    assert "encoded by" in dense["probes"] and dense["choice"]["why"] == "--dense-index hnsw"
    writer = _engine(target, writable=True)  # before, refused: "cannot drop vectors"
    try:
        held = writer.dense.segments.base.ntotal
        gone = writer.search("caffeine and the liver", 1)[0].document_id
        writer.live.delete(gone)
        chunks = [{"chunk_id": "c1", "content": "zanzibar clove harvest yields"}]
        writer.live.upsert(DocumentIn.model_validate({"document_id": "new-1", "chunks": chunks}))
        writer.live.refresh()
        vector = writer.dense.encode_query("caffeine and the liver")
        live = retrieved(writer.dense, vector, 40)
        assert not any(unit.startswith(f"{gone}#") for unit, _ in live) and len(live) == held
        assert retrieved(writer.dense, writer.dense.encode_query("zanzibar clove harvest"), 1)[0][0] == "new-1#c1"
        allowed = [row for row, unit in writer.dense.units.pairs() if not unit.startswith("new-1")][:5]
        within = retrieved(writer.dense, vector, 10, rows=Rows(np.asarray(allowed)))  # a filter: scored exactly
        assert sorted(writer.dense.units.get(u) for u, _ in within) == sorted(allowed)
        merged = writer.live.checkpoint(merge=True)  # `hybrid-search compact`
        assert merged["dense_merged"] and not writer.dense.segments.removed and not writer.dense.segments.delta.ntotal
        assert writer.dense.segments.base.ntotal == held  # one removed, one added: in the graph itself
        assert [u for u, _ in retrieved(writer.dense, vector, 40)] == [u for u, _ in live]
    finally:
        writer.close()
    reader = _engine(target)
    try:
        assert [u for u, _ in retrieved(reader.dense, vector, 40)] == [u for u, _ in live]
    finally:
        reader.close()


def test_a_server_searches_an_hnsw_graph_as_wide_as_its_build_tuned_or_wider_if_asked(index_dir, tmp_path):
    import faiss

    from engine.search import HybridEngine
    from engine.store.index_dir import latest_dense

    shutil.copytree(index_dir, tmp_path / "graph")
    target = tmp_path / "graph"
    flat = faiss.read_index(str(target / "dense.faiss"))
    graph = faiss.IndexIDMap2(faiss.IndexHNSWFlat(flat.d, 8, faiss.METRIC_INNER_PRODUCT))
    rows = faiss.vector_to_array(flat.id_map)
    graph.add_with_ids(flat.reconstruct_batch(rows), rows)
    faiss.downcast_index(graph.index).hnsw.efSearch = 300  # as a build tunes it
    for path in target.glob("dense*.faiss"):
        path.unlink()
    faiss.write_index(graph, str(latest_dense(target).base))
    for asked, searched in ((128, 300), (512, 512)):
        settings = EngineSettings(index_dir=target, device="cpu", rerank=False, fusion="rrf", hnsw_ef_search=asked)
        engine = HybridEngine(settings)
        try:
            assert engine.dense.segments.kind.hnsw.efSearch == searched
        finally:
            engine.close()


def test_without_training_queries_each_text_probe_seeks_its_own_chunk(tmp_path):
    from index_build.corpus import Corpus
    from index_build.one_index import _probe_texts

    documents = [
        {"document_id": f"d{d}", "chunks": [{"title": f"t{d}", "content": f"d{d} c{c} " + "w " * 20} for c in range(3)]}
        for d in range(100)
    ]
    texts, sought, probed = _probe_texts(Corpus(tmp_path, documents, "fingerprint"))
    assert len(texts) == len(sought) == 200 and "opening 12 words of 200 chunks" in probed
    for text, rows in zip(texts, sought, strict=True):
        (row,) = rows.tolist()  # chunks in order: document row // 3, its chunk row % 3
        assert text.startswith(f"t{row // 3} d{row // 3} c{row % 3} ")
