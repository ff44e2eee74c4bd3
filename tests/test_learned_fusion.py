"""The learned fusion: trained by `build`, loaded by the engine, the same features on both sides."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from engine.fusion.learned import CARD_FILE, MODEL_FILE, FusionModelError, feature_names
from engine.search import HybridEngine
from engine.settings import EngineSettings
from engine.store.index_dir import FUSION_DIR
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run


def test_build_trains_a_fusion_with_a_card(index_dir):
    card = json.loads((index_dir / FUSION_DIR / CARD_FILE).read_text())
    assert card["train_split"] == "train" and card["train_queries"] == 8
    assert card["features"] == list(feature_names(["bm25", "dense", "memory"]))
    assert card["first_stage"]["rrf_k"] == EngineSettings().rrf_k
    assert card["dev_rrf"]["queries"] == card["dev_learned"]["queries"] == 8


def test_learned_fusion_reorders_the_rrf_candidates(engine):
    assert engine.fusion is not None and engine.describe()["fusion"].startswith("learned (LambdaMART")
    result = engine.stages("calcium and bone density", top_k=10)
    assert sorted(d for d, _ in result.fused) == sorted(d for d, _ in result.rrf)
    scores = [s for _, s in result.fused]
    assert scores == sorted(scores, reverse=True)
    assert [h.doc_id for h in engine.search("calcium and bone density", 5)] == [d for d, _ in result.fused[:5]]


def test_served_features_are_the_trained_ones(engine, beir_dir):
    """Fitted on the training queries (each left out of the memory, as at training), the model must
    rank them at least as well as RRF; features that drift between training and serving would not."""
    dataset = load_dataset(beir_dir)
    train = dataset.qrels("train")
    runs = {"rrf": {}, "learned": {}}
    for qid in train:
        result = engine.stages(dataset.queries[qid], exclude=qid)
        runs["rrf"][qid] = [d for d, _ in result.rrf]
        runs["learned"][qid] = [d for d, _ in result.fused]
    rrf, learned = (evaluate_run(train, runs[name])["nDCG@10"] for name in ("rrf", "learned"))
    assert learned > rrf


def test_fusion_rrf_serves_plain_rrf(index_dir):
    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False, fusion="rrf"))
    result = engine.stages("coffee and the liver", top_k=5)
    assert engine.fusion is None and result.fused == result.rrf and engine.describe()["fusion"] == "rrf"


def test_broken_fusion_model_is_reported_or_refused(index_dir, tmp_path, caplog):
    copy = tmp_path / "index"
    shutil.copytree(index_dir, copy)
    (copy / FUSION_DIR / MODEL_FILE).write_text("not a model\n")
    with pytest.raises(FusionModelError, match="not a LightGBM model"):
        HybridEngine(EngineSettings(index_dir=copy, device="cpu", rerank=False, fusion="learned"))
    with caplog.at_level(logging.WARNING):
        engine = HybridEngine(EngineSettings(index_dir=copy, device="cpu", rerank=False))
    assert engine.fusion is None and "serving RRF" in caplog.text
    shutil.rmtree(copy / FUSION_DIR)
    with pytest.raises(FusionModelError, match="train-fusion"):
        HybridEngine(EngineSettings(index_dir=copy, device="cpu", rerank=False, fusion="learned"))


def test_train_fusion_command_retrains_in_place(index_dir, beir_dir, tmp_path, capsys):
    from cli.main import main

    copy = tmp_path / "index"
    shutil.copytree(index_dir, copy)
    shutil.rmtree(copy / FUSION_DIR)
    assert main(["train-fusion", "--index-dir", str(copy), "--data", str(beir_dir), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((copy / FUSION_DIR / CARD_FILE).read_text())
    assert (copy / FUSION_DIR / MODEL_FILE).read_text() == (index_dir / FUSION_DIR / MODEL_FILE).read_text()
    assert not [p for p in copy.iterdir() if p.name.startswith(".")]  # no work folder left behind
