"""The one-pass reranker path (engine/rerank/cuda_passes.py) gives the split path's logits: padding
made in one vectorised step, the mask and token types remade from two numbers a row, the last layer
for [CLS] alone, batches larger than a bucket split, several batches in flight. On a CPU (no pinning,
streams or graphs), with a random BERT cross-encoder: the GPU tests run the same on CUDA."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.rerank.backends import TorchBackend  # noqa: E402
from engine.rerank.cuda_passes import CudaPasses, row_buckets, widths  # noqa: E402
from engine.rerank.pair_tokens import PairRow  # noqa: E402
from engine.rerank.plan import RerankPlan  # noqa: E402
from engine.rerank.token_rows import TokenRows  # noqa: E402

WINDOW = 48


@pytest.fixture(scope="module")
def model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(3)
    config = BertConfig(
        vocab_size=500, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=3, num_labels=1
    )
    return BertForSequenceClassification(config).eval()


def _rows(n: int, seed: int) -> TokenRows:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(5, WINDOW + 1))
        query = int(rng.integers(2, length))
        ids = rng.integers(5, 500, length).astype(np.int64)
        rows.append(PairRow(ids, (np.arange(length) >= query).astype(np.int64)))
    return TokenRows.of(rows)


def _split(model, rows: TokenRows) -> np.ndarray:
    plan = RerankPlan(device="cpu", backend="torch", precision="fp32", compile=False, first_token=False)
    backend = TorchBackend(model, plan, 8, WINDOW, 0)
    assert backend.passes is None  # a CPU keeps the split path
    return backend.logits(rows, rows.lengths.tolist())


def test_one_pass_gives_the_split_paths_logits(model):
    rows = _rows(37, seed=1)
    passes = CudaPasses(model, 0, WINDOW, max_tokens=64 * WINDOW)
    assert passes.state == "eager" and not passes.graphs  # no graphs on a CPU
    np.testing.assert_allclose(passes(rows), _split(model, rows), atol=1e-4)


def test_a_batch_past_the_largest_bucket_runs_as_several_passes_in_its_order(model):
    rows = _rows(70, seed=2)
    passes = CudaPasses(model, 0, WINDOW, max_tokens=8 * WINDOW)  # buckets of at most 8 rows at the window
    assert max(passes.rows[WINDOW]) == 8
    np.testing.assert_allclose(passes(rows), _split(model, rows), atol=1e-4)


def test_batches_started_before_the_last_is_collected_each_get_their_own(model):
    batches = [_rows(n, seed=10 + n) for n in (3, 20, 9, 14)]
    passes = CudaPasses(model, 0, WINDOW, max_tokens=8 * WINDOW)
    pending = [passes.launch(rows) for rows in batches]  # more passes than slots: the oldest are handed over
    for rows, started in zip(batches, pending, strict=True):
        np.testing.assert_allclose(started.result(), _split(model, rows), atol=1e-4)


def test_buckets_hold_the_window_and_the_token_budget():
    assert widths(128) == [32, 64, 96, 128] and widths(100) == [32, 64, 96, 100]
    assert row_buckets(128, 1024 * 128)[-1] == 1024 and row_buckets(512, 100)[-1] == 8
