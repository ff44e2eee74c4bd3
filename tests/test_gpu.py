"""The CUDA path; skipped on machines without a GPU (CI has none)."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def test_fp16_reranker_on_cuda_ranks_like_the_cpu(minilm_path, beir_dir):
    from engine.dataset import load_dataset
    from engine.rerank import Reranker

    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    cpu = Reranker(minilm_path, "cpu").score("caffeine and the liver", docs)
    gpu = Reranker(minilm_path, "cuda").score("caffeine and the liver", docs)
    order = lambda scores: sorted(range(len(scores)), key=lambda i: -scores[i])[:10]  # noqa: E731
    assert order(gpu)[:5] == order(cpu)[:5]


def test_engine_auto_picks_cuda(index_dir, minilm_path):
    from engine.config import Settings
    from engine.pipeline import HybridEngine

    engine = HybridEngine(Settings(index_dir=index_dir, reranker=minilm_path))
    assert engine.device == "cuda" and engine.reranker.device == "cuda"
    assert len(engine.search("soy and prostate", 5)) == 5
