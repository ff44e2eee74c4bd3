import json

import pytest

from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.negatives import mine_candidates
from index_build.train_reranker import CARD_FILE, TrainOptions, train
from offline.dataset import load_dataset
from tests.helpers import short_training

pytestmark = pytest.mark.slow  # each test trains a cross-encoder


def test_mined_negatives_are_never_judged_and_positives_always_are(engine, beir_dir):
    dataset = load_dataset(beir_dir)
    qrels = dataset.qrels("train")
    queries = dataset.split_queries("train")
    mined = mine_candidates(engine, queries, qrels, depth=10, progress=False)
    assert set(mined.negatives) == set(mined.positives) == set(queries)
    for qid, negatives in mined.negatives.items():
        assert negatives and not set(negatives) & set(qrels[qid])
        assert mined.positives[qid] and all(qrels[qid][d] == g > 0 for d, g in mined.positives[qid].items())
        assert len(negatives) + len(mined.positives[qid]) <= 10 and len(negatives) == len(set(negatives))


@pytest.mark.parametrize(("loss", "memory_context"), [("listwise", 5), ("pairwise", 0), ("pointwise", 5)])
def test_tiny_training_run_saves_a_model_that_serves(index_dir, beir_dir, minilm_path, tmp_path, loss, memory_context):
    settings, options = short_training(
        index_dir,
        beir_dir,
        tmp_path,
        base=minilm_path,
        max_steps=10,
        lr=1e-4,
        eval_every=5,
        loss=loss,
        memory_context=memory_context,
    )
    card = train(settings, options, load_dataset(beir_dir), progress=False)
    assert card["train_split"] == "train" and card["steps"] == 10 and card["loss"].startswith(loss)
    assert card["loss_last"] < card["loss_first"]
    assert card["best_step"] in (5, 10) and len(card["history"]) == 2
    saved = json.loads((settings.index_dir / "reranker" / CARD_FILE).read_text())
    assert saved["base_model"] == minilm_path and saved["dev_reranked"]["queries"] == 8
    assert saved["eval_rerank"] == {"depth": 8, "blend": settings.rerank_blend, "quantize": "auto", "max_length": 64}
    assert saved["cpu_quantize"] == "none"  # a model trained from scratch, not a CPU student
    engine = HybridEngine(settings.model_copy(update={"max_length": None}))  # picks the trained model up by itself
    assert engine.reranker is not None and engine.reranker.name.endswith("reranker")
    assert engine.reranker.max_length == card["max_length"] == 64  # the length it was trained with
    assert engine.reranker.memory_context == card["memory_context"] == memory_context  # and the input it read
    hits = engine.search("caffeine liver", 3)
    assert len(hits) == 3 and all(h.rerank_score is not None for h in hits)


def test_missing_train_split_is_a_clear_error(index_dir, beir_dir, minilm_path):
    from offline.dataset import DatasetError

    settings = EngineSettings(index_dir=index_dir, device="cpu")
    with pytest.raises(DatasetError, match="no judgments for split 'nope'"):
        train(
            settings, TrainOptions(base=minilm_path, split="nope", max_steps=1), load_dataset(beir_dir), progress=False
        )


def test_only_a_fresh_scoring_head_learns_faster(minilm_path, reranker_dir):
    from transformers import AutoModelForSequenceClassification

    from index_build.train_reranker import HEAD_LR_FACTOR, _param_groups

    fresh = AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=1)  # a bi-encoder base
    body, head = _param_groups(fresh, 1e-4)
    assert head["lr"] == 1e-4 * HEAD_LR_FACTOR and body["lr"] == 1e-4
    assert {id(p) for p in head["params"]} == {
        id(p) for p in [*fresh.classifier.parameters(), *fresh.bert.pooler.parameters()]
    }
    trained = AutoModelForSequenceClassification.from_pretrained(reranker_dir)  # already a cross-encoder
    body, head = _param_groups(trained, 1e-4)
    assert not head["params"] and len(body["params"]) == len(list(trained.parameters()))
