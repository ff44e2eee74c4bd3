"""The CUDA path; skipped on machines without a GPU (CI has none)."""

import pytest

from tests.helpers import retrieved

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def test_fp16_reranker_on_cuda_ranks_like_the_cpu(reranker_dir, beir_dir):
    from engine.rerank.cross_encoder import Reranker
    from offline.dataset import load_dataset

    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    cpu = Reranker(reranker_dir, "cpu", quantize="none").score("caffeine and the liver", docs)
    gpu = Reranker(reranker_dir, "cuda").score("caffeine and the liver", docs)
    order = lambda scores: sorted(range(len(scores)), key=lambda i: -scores[i])[:10]  # noqa: E731
    assert order(gpu)[:5] == order(cpu)[:5]


def test_the_compiled_reranker_scores_as_eager_fp16_without_compiling_at_request_time(reranker_dir, beir_dir):
    """Warmed over its buckets at load: the first request finds every shape compiled."""
    import time

    from engine.rerank.cross_encoder import Reranker
    from offline.dataset import load_dataset

    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    eager = Reranker(reranker_dir, "cuda", max_length=256, batch_size=32).score("caffeine and the liver", docs)
    compiled = Reranker(reranker_dir, "cuda", max_length=256, batch_size=32, compile_model=True)
    assert compiled.backend.compiled is not None and compiled.compile_state == "compiled"
    started = time.perf_counter()
    scores = compiled.score("caffeine and the liver", docs)
    assert time.perf_counter() - started < 1.0  # a compilation takes seconds
    assert scores == pytest.approx(eager, abs=2e-3)


def test_one_pass_replayed_from_cuda_graphs_scores_as_the_split_passes(reranker_dir, beir_dir):
    """The served CUDA path (one pass a batch, pinned, graphs) against the 128-row passes it replaced."""
    from engine.rerank.cross_encoder import Reranker
    from offline.dataset import load_dataset

    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()] * 3
    graphs = Reranker(reranker_dir, "cuda", max_length=128)
    assert graphs.backend.passes_state.startswith("graphs: "), graphs.backend.passes_state
    split = Reranker(reranker_dir, "cuda", max_length=128)
    split.backend.passes = None
    assert graphs.score("caffeine and the liver", docs) == pytest.approx(
        split.score("caffeine and the liver", docs), abs=2e-3
    )


def test_a_compile_that_fails_leaves_the_reranker_eager_and_says_why(reranker_dir, beir_dir, tmp_path):
    """No C compiler for Triton's launcher (as in an image without one), fresh caches so nothing
    compiled earlier is reused: the reranker loads, scores as eager, and its state names the cause."""
    import os
    import subprocess
    import sys

    script = f"""
from engine.rerank.cross_encoder import Reranker
r = Reranker({str(reranker_dir)!r}, "cuda", max_length=128, batch_size=8, compile_model=True)
assert r.backend.compiled is None and r.compile_state.startswith("eager: compiling failed"), r.compile_state
assert len(r.score("caffeine and the liver", ["coffee", "liver enzymes"])) == 2
print(r.compile_state)
"""
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false", "PATH": str(tmp_path)}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_engine_auto_picks_cuda(index_dir, reranker_dir):
    from engine.search import HybridEngine
    from engine.settings import EngineSettings

    engine = HybridEngine(EngineSettings(index_dir=index_dir, reranker=reranker_dir))
    assert engine.device == "cuda" and engine.reranker.device == "cuda"
    assert len(engine.search("soy and prostate", 5)) == 5


def test_dense_search_runs_on_the_gpu_and_finds_what_the_cpu_finds(index_dir):
    from engine.search import HybridEngine
    from engine.settings import EngineSettings

    gpu = HybridEngine(EngineSettings(index_dir=index_dir, rerank=False, device="cuda"))
    cpu = HybridEngine(EngineSettings(index_dir=index_dir, rerank=False, device="cpu"))
    assert gpu.dense.backend in ("faiss-gpu", "torch-cuda")
    query = "caffeine and the liver"
    top = [[d for d, _ in retrieved(e.dense, e.dense.encode_query(query), 5)] for e in (gpu, cpu)]
    assert top[0][:3] == top[1][:3]  # fp16 may swap near-ties further down


def test_onnx_runtime_cuda_provider_ranks_like_torch(reranker_dir, beir_dir):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed")
    from engine.rerank.cross_encoder import Reranker
    from offline.dataset import load_dataset

    docs = [d.contents for d in load_dataset(beir_dir).corpus.values()]
    torch_scores = Reranker(reranker_dir, "cuda", runtime="torch").score("caffeine and the liver", docs)
    onnx = Reranker(reranker_dir, "cuda", runtime="onnx")
    assert "CUDAExecutionProvider" in onnx.backend.onnx.session.get_providers()
    onnx_scores = onnx.score("caffeine and the liver", docs)
    order = lambda scores: sorted(range(len(scores)), key=lambda i: -scores[i])[:5]  # noqa: E731
    assert order(onnx_scores) == order(torch_scores)


def test_out_of_memory_halves_the_batch_and_never_fails_the_request(reranker_dir, beir_dir, caplog):
    """A GPU that cannot hold a batch never fails the request: the scores still come, ranked as the CPU
    ranks them. The allocator is capped at what the weights take, so a batch of 32 overflows."""
    from engine.rerank.cross_encoder import Reranker
    from offline.dataset import load_dataset

    docs = [d.contents * 8 for d in load_dataset(beir_dir).corpus.values()]
    cpu = Reranker(reranker_dir, "cpu", max_length=256, runtime="torch").score("caffeine and the liver", docs)
    gpu = Reranker(reranker_dir, "cuda", max_length=256, batch_size=32, cuda_graphs=False)  # graphs hold their memory
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_allocated() / total)
    try:
        scores = gpu.score("caffeine and the liver", docs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert len(scores) == len(docs) and gpu.batch_size < 32
    assert gpu.backend.passes_state == "off: out of GPU memory"  # the one pass gave way to halved passes
    assert "GPU out of memory" in caplog.text
    order = lambda s: sorted(range(len(s)), key=lambda i: -s[i])[:5]  # noqa: E731
    assert order(scores) == order(cpu)
