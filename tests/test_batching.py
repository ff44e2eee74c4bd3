from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine.rerank.batching import RerankBatcher, score_rows
from engine.rerank.cross_encoder import Reranker
from engine.rerank.pair_assembly import PassageTokens
from offline.dataset import load_dataset


def test_concurrent_queries_share_batches_and_get_their_own_scores(reranker_dir, beir_dir):
    reranker = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    jobs = [
        (f"question {i} about {['soy', 'coffee', 'rice', 'meat'][i % 4]}", docs[i : i + 3 + i % 4]) for i in range(12)
    ]
    alone = [reranker.score(q, p) for q, p in jobs]
    batcher = RerankBatcher(reranker, max_wait_s=0.2, max_tokens=1 << 20)

    def from_ids(job: tuple[str, list[str]]) -> list[float]:  # the pairs made from the passages' ids
        query, passages = job
        ids = [PassageTokens(t, len(p)) for t, p in zip(reranker.text_tokens(passages), passages, strict=True)]
        return batcher.score(query, passages, ids)

    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            together = list(pool.map(lambda job: batcher.score(*job), jobs))
            made = list(pool.map(from_ids, jobs))
        assert batcher.batches < 2 * len(jobs)  # requests were merged
        for mine, ours, reference in zip(together, made, alone, strict=True):
            assert mine == pytest.approx(reference, abs=1e-4) and ours == pytest.approx(reference, abs=1e-4)
        sent = [(p.rows.wire(), np.array(p.lengths)) for p in (reranker.prepare(q, passages) for q, passages in jobs)]
        for mine, reference in zip(score_rows(reranker, sent), alone, strict=True):  # a Ray replica's call
            assert mine == pytest.approx(reference, abs=1e-4)
        assert batcher.score("nothing", []) == []
        assert batcher.device == "cpu"  # the wrapped reranker's attributes show through
    finally:
        batcher.close()


def test_a_lone_request_does_not_wait_for_company(reranker_dir, beir_dir):
    """With nobody else in ``score``, the batch is scored at once, not after ``max_wait_s``."""
    import time

    reranker = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()][:4]
    batcher = RerankBatcher(reranker, max_wait_s=60, max_tokens=1 << 20)
    try:
        started = time.perf_counter()
        for _ in range(3):
            assert batcher.score("soy and prostate cancer", docs) == pytest.approx(
                reranker.score("soy and prostate cancer", docs), abs=1e-4
            )
        assert time.perf_counter() - started < 30 and batcher.batches == 3
    finally:
        batcher.close()


def test_a_batch_keeps_to_its_token_budget_and_each_caller_gets_its_own_scores(reranker_dir, beir_dir):
    """A budget of one query's tokens: every batch holds one query, however many wait, and a request
    that would overflow a batch opens the next one rather than being lost or merged."""
    reranker = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    jobs = [(f"question {i} about soy", docs[i : i + 4]) for i in range(8)]
    alone = [reranker.score(q, p) for q, p in jobs]
    budget = max(reranker.prepare(q, p).rows.tokens for q, p in jobs)
    batcher = RerankBatcher(reranker, max_wait_s=0.5, max_tokens=budget)
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            together = list(pool.map(lambda job: batcher.score(*job), jobs))
        assert batcher.batches == len(jobs)
        for mine, reference in zip(together, alone, strict=True):
            assert mine == pytest.approx(reference, abs=1e-4)
    finally:
        batcher.close()


def test_a_pass_padded_up_to_its_compiled_bucket_scores_as_the_pass_itself(reranker_dir, beir_dir):
    """What the compiled CUDA path feeds the model (engine.rerank.compiled), checked on the CPU in
    eager torch: more rows and columns of padding change no real row's logit."""
    import torch

    from engine.rerank.compiled import buckets, pad_to_bucket

    reranker = Reranker(reranker_dir, "cpu", max_length=96, runtime="torch")
    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()][:5]
    features = reranker.prepare("soy and prostate cancer", docs).rows.features(reranker.tokenize.pad_id)
    rows, widths = buckets(32, 96)
    assert rows == [8, 32] and widths == [64, 96]
    grown = pad_to_bucket(features, rows, widths, reranker.tokenize.pad_id)
    assert grown["input_ids"].shape == (8, 64 if features["input_ids"].shape[1] <= 64 else 96)
    model = reranker.model.transformers_model

    def logits(arrays: dict) -> list[float]:
        with torch.inference_mode():
            return model(**{k: torch.from_numpy(v) for k, v in arrays.items()}).logits[:, 0].tolist()

    assert logits(grown)[:5] == pytest.approx(logits(features), abs=1e-4)
