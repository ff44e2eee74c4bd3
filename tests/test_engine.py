import json
import shutil
import sqlite3

import pytest

from engine.rerank.cross_encoder import Reranker, RerankerError
from engine.search import HybridEngine, answers
from engine.settings import EngineSettings
from engine.store.index_dir import MANIFEST_FILE, IndexDirError, read_manifest
from tests.helpers import retrieved


def test_manifest_records_the_build(index_dir, beir_dir):
    manifest = read_manifest(index_dir)
    assert manifest.documents == 32 and manifest.dimension == 384
    assert manifest.bm25 == {"k1": 0.9, "b": 0.4}
    assert {"pyserini", "faiss-cpu", "torch"} <= set(manifest.versions)
    assert manifest.dataset == str(beir_dir.resolve())
    assert not [p for p in index_dir.parent.iterdir() if p.name.startswith(".tiny.building")]


def test_bm25_ranks_the_document_with_the_rare_term_first(engine):
    hits = retrieved(engine.bm25, "markerarsenic2 rice", 5)
    assert hits[0][0] == "D-arsenic-2"
    assert hits[0][1] > hits[1][1]


def test_dense_finds_the_topic(engine):
    top = [d for d, _ in retrieved(engine.dense, engine.dense.encode_query("caffeine and the liver"), 4)]
    assert sum(d.startswith("D-coffee") for d in top) >= 3


def test_torch_flat_index_searches_like_faiss(engine, index_dir):
    import faiss
    import numpy as np

    from engine.retrieval.dense import TorchFlatIndex

    index = faiss.read_index(str(index_dir / "dense.faiss"))
    ids = faiss.vector_to_array(index.id_map)
    matmul = TorchFlatIndex(faiss.downcast_index(index.index).reconstruct_n(0, index.ntotal), ids, "cpu")
    query = engine.dense.encode_query("soy isoflavones and prostate cancer")
    (faiss_scores, faiss_rows), (torch_scores, torch_rows) = index.search(query, 10), matmul.search(query, 10)
    assert torch_rows.tolist() == faiss_rows.tolist()
    assert np.allclose(torch_scores, faiss_scores, atol=1e-5)
    assert engine.dense.backend == "faiss-cpu"


def test_judgment_memory_votes_with_training_judgments(engine, index_dir):
    from engine.store.index_dir import read_manifest

    assert read_manifest(index_dir).memory == {"split": "train", "queries": 8}
    # the tiny dataset's training query for soy is "prostate and cancer effects"; it judged
    # D-soy-0 with grade 2 and D-soy-1 with grade 1
    votes = retrieved(engine.memory, engine.dense.encode_query("prostate and cancer effects"), 10)
    assert [d for d, _ in votes[:2]] == ["D-soy-0", "D-soy-1"]
    assert votes[0][1] == pytest.approx(2 * votes[1][1])
    assert all(d.endswith(("-0", "-1")) for d, _ in votes)  # only judged documents get votes
    left_out = retrieved(
        engine.memory, engine.dense.encode_query("prostate and cancer effects"), 10, exclude="Q-train-soy"
    )
    assert "D-soy-0" not in [d for d, _ in left_out]  # only its own judgments named it
    hits = engine.search("prostate and cancer effects", 3)
    assert hits[0].found.get("memory", (None,))[0] == 1 or any(h.doc_id == "D-soy-0" for h in hits)


def test_search_gives_exactly_top_k_unique_ids_deterministically(engine):
    for k in (1, 5, 32):
        hits = engine.search("cancer risk", k)
        assert len(hits) == k and len({h.doc_id for h in hits}) == k
    assert len(engine.search("cancer risk", 100)) == 32  # corpus is smaller
    first = [(h.doc_id, h.score) for h in engine.search("soy and men", 10)]
    assert first == [(h.doc_id, h.score) for h in engine.search("soy and men", 10)]
    hits = {h.doc_id: h for h in engine.search("markersoy1 isoflavones", 3)}
    assert hits["D-soy-1"].found["bm25"][0] == 1 and hits["D-soy-1"].title == "Soy report 1"
    fused = dict(engine.stages("markersoy1 isoflavones", 3).fused)
    assert "dense" in hits["D-soy-1"].found and hits["D-soy-1"].fused_score == fused["D-soy-1"]
    with pytest.raises(ValueError, match="empty"):
        engine.search("   ", 5)


def test_the_dense_search_beside_bm25_answers_as_in_turn(engine):
    """A lone query's dense search runs on a spare thread while BM25 and the memory run; every
    retriever's hits and the fused ranking are those in turn."""
    from engine.search.spare import SpareThreads

    queries = ("caffeine and the liver", "markersoy1 isoflavones", "cancer risk", "soy and men")
    kept = engine.spare
    try:
        engine.spare = SpareThreads(1)  # its thread starts with the first call it takes
        beside = {q: engine.stages(q, 10) for q in queries}
        assert engine.spare._pool._threads  # it took the dense searches
        engine.spare.close()
        engine.spare = SpareThreads(0)
        in_turn = {q: engine.stages(q, 10) for q in queries}
    finally:
        engine.spare = kept
    for q in queries:
        assert beside[q].retrieved == in_turn[q].retrieved and beside[q].fused == in_turn[q].fused
        assert list(beside[q].retrieved) == ["bm25", "dense", "memory"]  # in the order fusion reads them
        assert list(beside[q].seconds) == list(in_turn[q].seconds)  # the stages in the order a query runs them


def test_reranker_order_is_respected(index_dir, reranker_dir):
    settings = EngineSettings(
        index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank_depth=6, rerank_blend=1.0
    )
    engine = HybridEngine(settings)
    result = engine.stages("coffee and liver enzymes", top_k=6)
    head = [d for d, _ in result.fused[:6]]
    assert sorted(d for d, _ in result.reranked) == sorted(head)
    direct = engine.reranker.score("coffee and liver enzymes", engine.rerank_passages("", head, 0))
    expected = [d for _, d in sorted(zip(direct, head, strict=True), key=lambda p: -p[0])]
    assert [d for d, _ in result.reranked] == expected
    hits = answers.hits(engine, result, 6)
    assert [h.doc_id for h in hits] == expected
    assert all(h.rerank_score == h.score for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_evaluation_reranks_every_stage_head(index_dir, reranker_dir, beir_dir):
    from offline.dataset import load_dataset
    from offline.evaluation import stage_runs

    settings = EngineSettings(
        index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank_depth=4, rerank_blend=1.0
    )
    engine = HybridEngine(settings)
    queries = load_dataset(beir_dir).split_queries("dev")
    runs = stage_runs(engine, queries, depth=10, progress=False)
    stages = ("bm25", "dense", "rrf", "learned")
    assert set(runs) == {"memory", *stages, *(f"{stage}+rerank" for stage in stages)}
    for stage in stages:
        for qid, text in queries.items():
            plain, reranked = runs[stage][qid], runs[f"{stage}+rerank"][qid]
            scores = engine.reranker.score(text, engine.rerank_passages(text, plain[:4], 0))
            assert reranked[:4] == [plain[i] for i in sorted(range(4), key=lambda i: (-scores[i], i))]
            assert reranked[4:] == plain[4:]


def test_onnx_runtime_scores_like_torch(reranker_dir, engine):
    import numpy as np

    docs = [c.contents for c in engine.store.chunks(engine.dense.units.unit_ids()).values()]
    query = "coffee and liver enzymes"
    torch_scores = Reranker(reranker_dir, "cpu", max_length=64, runtime="torch").score(query, docs)
    onnx = Reranker(reranker_dir, "cpu", max_length=64, runtime="onnx")
    assert onnx.runtime == "onnx" and onnx.backend.onnx.path.is_file()
    assert np.allclose(onnx.score(query, docs), torch_scores, atol=1e-4)


def test_blended_reranking_keeps_rerank_scores_apart(index_dir, reranker_dir):
    settings = EngineSettings(
        index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank_depth=6, rerank_blend=0.5
    )
    engine = HybridEngine(settings)
    result = engine.stages("coffee and liver enzymes", top_k=6)
    head = [d for d, _ in result.fused[:6]]
    assert set(result.rerank_scores) == set(head)
    hits = answers.hits(engine, result, 6)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert all(h.rerank_score == result.rerank_scores[h.doc_id] for h in hits)


def test_missing_default_reranker_serves_fused_results(engine, caplog):
    assert engine.reranker is None


def test_broken_reranker_folder_is_a_clear_error(index_dir, tmp_path):
    (tmp_path / "junk").mkdir()
    with pytest.raises(RerankerError, match="not a model folder"):
        Reranker(str(tmp_path / "junk"), "cpu")
    with pytest.raises(RerankerError, match="not a model folder"):
        HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=str(tmp_path / "junk")))


def test_incomplete_or_foreign_index_is_refused(index_dir, tmp_path):
    with pytest.raises(IndexDirError, match="run `hybrid-search build` first"):
        read_manifest(tmp_path / "none")
    broken = tmp_path / "broken"
    shutil.copytree(index_dir, broken)
    (broken / "dense.faiss").unlink()
    with pytest.raises(IndexDirError, match="dense.faiss is missing"):
        HybridEngine(EngineSettings(index_dir=broken, device="cpu"))
    (broken / MANIFEST_FILE).unlink()
    with pytest.raises(IndexDirError, match="build did not finish"):
        HybridEngine(EngineSettings(index_dir=broken, device="cpu"))
    odd = tmp_path / "odd"
    shutil.copytree(index_dir, odd)
    with sqlite3.connect(odd / "docs.sqlite") as conn:
        conn.execute("DELETE FROM chunks WHERE unit_id = 'D-soy-0'")
    with pytest.raises(IndexDirError, match="32 vectors for 31 documents in the store"):
        HybridEngine(EngineSettings(index_dir=odd, device="cpu"))
    old = tmp_path / "old"
    shutil.copytree(index_dir, old)
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    (old / MANIFEST_FILE).write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(IndexDirError, match="format 1, this version reads 2 to 3"):
        HybridEngine(EngineSettings(index_dir=old, device="cpu"))


def test_memory_names_the_training_queries_that_cited_a_document_nearest_first(tmp_path):
    import numpy as np

    from engine.retrieval.memory import JudgmentMemory, write_memory

    vectors = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    qrels = {"A": {"D1": 2, "D2": 0}, "B": {"D1": 1}, "C": {"D1": 1, "D3": 1}}
    write_memory(tmp_path, vectors, qrels, ["A", "B", "C"], ["soy milk", "tofu", "tempeh"])
    memory = JudgmentMemory(tmp_path)
    near_c = np.array([0.1, 0.99])
    assert memory.cited_for(near_c, "D1", 5) == "cited for: tempeh; tofu; soy milk."
    assert memory.cited_for(near_c, "D1", 2) == "cited for: tempeh; tofu."
    assert memory.cited_for(near_c, "D1", 5, exclude="C") == "cited for: tofu; soy milk."
    assert memory.cited_for(near_c, "D3", 5, exclude="C") == "cited for: none."  # only C cited it
    assert memory.cited_for(near_c, "D2", 5) == "cited for: none."  # judged, but not relevant


def test_memory_aware_reranker_reads_the_memory_context(index_dir, reranker_dir, tmp_path):
    import json
    import shutil

    from engine.rerank.cross_encoder import CARD_FILE

    shutil.copytree(reranker_dir, tmp_path / "aware")
    (tmp_path / "aware" / CARD_FILE).write_text(json.dumps({"memory_context": 3}))
    settings = EngineSettings(index_dir=index_dir, device="cpu", reranker=str(tmp_path / "aware"), rerank_depth=4)
    engine = HybridEngine(settings)
    assert engine.reranker.memory_context == 3
    query = "soy isoflavones and prostate"
    passages = engine.rerank_passages(query, ["D-soy-0", "D-coffee-3"], 3)
    # the tiny dataset's training query "prostate and cancer effects" judged D-soy-0; nothing judged D-coffee-3
    assert passages == [
        f"cited for: prostate and cancer effects. {engine.store.chunks(['D-soy-0'])['D-soy-0'].contents}",
        f"cited for: none. {engine.store.chunks(['D-coffee-3'])['D-coffee-3'].contents}",
    ]
    result = engine.stages(query, top_k=4)
    head = [d for d, _ in result.fused[:4]]
    direct = engine.reranker.score(query, engine.rerank_passages(query, head, 3))
    assert [result.rerank_scores[d] for d in head] == pytest.approx(direct)
    with pytest.raises(RerankerError, match="no judgment memory"):
        HybridEngine(settings.model_copy(update={"memory": False}))
    (tmp_path / "aware" / CARD_FILE).write_text("{not json")
    with pytest.raises(RerankerError, match="not a model card"):
        Reranker(str(tmp_path / "aware"), "cpu")
    (tmp_path / "aware" / CARD_FILE).write_text('{"cpu_quantize": "int4"}')
    with pytest.raises(RerankerError, match="cpu_quantize must be none or int8, not 'int4'"):
        Reranker(str(tmp_path / "aware"), "cpu")
