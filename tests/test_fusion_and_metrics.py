import warnings

import pytest

from engine.fusion.rrf import blend_reranking, reciprocal_rank_fusion
from offline.evaluation import evaluate_run, in_list_ndcg, read_trec_run, sample_queries, write_trec_run


def test_rrf_matches_hand_computation():
    fused = reciprocal_rank_fusion({"bm25": ["a", "b", "c"], "dense": ["c", "a", "d"]}, k=60)
    # a: 1/61 + 1/62, c: 1/63 + 1/61, b: 1/62, d: 1/63
    assert [d for d, _ in fused] == ["a", "c", "b", "d"]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62)
    assert fused[1][1] == pytest.approx(1 / 63 + 1 / 61)


def test_rrf_weights_and_deterministic_ties():
    fused = reciprocal_rank_fusion({"bm25": ["a", "b"], "dense": ["b", "a"]}, k=1, weights={"bm25": 2.0})
    assert [d for d, _ in fused] == ["a", "b"]  # a: 2/2 + 1/3, b: 2/3 + 1/2
    tied = reciprocal_rank_fusion({"x": ["q", "p"], "y": ["p", "q"]}, k=60)
    assert [d for d, _ in tied] == ["p", "q"]  # equal scores and best ranks: by id


def test_blend_reranking_between_the_two_orders():
    head = [("a", 3.0), ("b", 2.0), ("c", 1.0)]  # first stage: a > b > c, evenly spaced
    scores = [0.1, 0.9, 0.5]  # reranker: b > c > a
    assert blend_reranking(head, scores, 1.0) == [("b", 0.9), ("c", 0.5), ("a", 0.1)]
    assert [d for d, _ in blend_reranking(head, scores, 0.0)] == ["a", "b", "c"]
    # z-scores: first stage a +1.22, b 0, c -1.22; reranker a -1.22, b +1.22, c 0
    assert [d for d, _ in blend_reranking(head, scores, 0.3)] == ["a", "b", "c"]
    assert [d for d, _ in blend_reranking(head, scores, 0.6)] == ["b", "a", "c"]
    assert [d for d, _ in blend_reranking(head, scores, 0.9)] == ["b", "c", "a"]
    assert blend_reranking([("a", 1.0)], [0.2], 0.5) == [("a", 0.0)]  # one document: nothing to standardise
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns on the mean of nothing
        assert blend_reranking([], [], 0.5) == []  # a retriever that found nothing


def test_in_list_ndcg_hand_computed():
    import math

    assert in_list_ndcg([2, 1, 0, 0, 0]) == pytest.approx(1.0)
    assert in_list_ndcg([0, 0, 0, 0, 0]) == 0.0
    # grades [0, 2, 1]: DCG = 2/log2(3) + 1/log2(4); ideal [2, 1, 0]: 2/log2(2) + 1/log2(3)
    expected = (2 / math.log2(3) + 1 / 2) / (2 + 1 / math.log2(3))
    assert in_list_ndcg([0, 2, 1]) == pytest.approx(expected)
    assert in_list_ndcg([1]) == 1.0 and in_list_ndcg([]) == 0.0


def test_standard_metrics_hand_computed():
    import math

    qrels = {"q": {"a": 2, "b": 1, "z": 1}}
    report = evaluate_run(qrels, {"q": ["b", "x", "a"]})
    dcg = 1 / math.log2(2) + 2 / math.log2(4)
    ideal = 2 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    assert report["nDCG@5"] == pytest.approx(dcg / ideal, abs=1e-4)
    assert report["Recall@100"] == pytest.approx(2 / 3, abs=1e-4)
    assert report["MRR@10"] == pytest.approx(1.0)
    assert report["in-list NDCG@5"] == pytest.approx(in_list_ndcg([1, 0, 2]))


def test_mrr_is_cut_at_10():
    run = {"q": [f"n{i}" for i in range(10)] + ["a"]}
    assert evaluate_run({"q": {"a": 1}}, run)["MRR@10"] == 0.0


def test_sampling_is_the_evaluators():
    import random

    queries = {f"q{i}": f"text {i}" for i in range(50)}
    random.seed(7)
    expected = random.sample(list(queries.items()), 5)
    assert list(sample_queries(queries, 5, 7).items()) == expected
    assert sample_queries(queries, None, 7) == queries


def test_paired_test_measures_gain_and_noise():
    import math

    from offline.evaluation import paired_test

    qrels = {f"q{i}": {"a": 1} | ({"b": 1} if i % 2 else {}) for i in range(6)}
    first = {q: ["a", "b", "x"] for q in qrels}
    second = {q: ["x", "a", "b"] for q in qrels}
    mixed = {q: first[q] if i % 2 else second[q] for i, q in enumerate(qrels)}
    assert paired_test(qrels, first, first) == {"gain": 0.0, "p_value": 1.0, "queries": 6}
    one = 1 - 1 / math.log2(3)  # one relevant document moved from rank 2 to rank 1
    two = 1 - (1 / math.log2(3) + 1 / 2) / (1 + 1 / math.log2(3))
    result = paired_test(qrels, first, second)
    assert result["gain"] == pytest.approx((one + two) / 2, abs=1e-4) and result["p_value"] < 1e-4
    assert paired_test(qrels, mixed, second)["p_value"] > 0.05  # half the queries gain: not conclusive
    missing = paired_test(qrels, first, {"q0": first["q0"]})  # queries the baseline lacks count 0 for it
    assert missing["gain"] == pytest.approx(5 / 6) and missing["queries"] == 6


def test_a_trec_run_reads_back_as_written_and_scores_the_same(tmp_path):
    run = {"q1": [f"d{i}" for i in (3, 1, 2, 12, 4, 5, 6, 7, 8, 9, 10, 11)], "q2": ["d2"]}  # ranks past 9
    qrels = {"q1": {"d1": 2, "d2": 1}, "q2": {"d2": 1}}
    write_trec_run(tmp_path / "run.bm25.trec", run, "bm25")
    back = read_trec_run(tmp_path / "run.bm25.trec")
    assert back == run
    assert evaluate_run(qrels, back) == evaluate_run(qrels, run)
