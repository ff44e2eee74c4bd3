"""The query encoder on ONNX Runtime: torch's embeddings, one trace, safe under concurrent calls."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine.settings import EngineSettings

# NFCorpus dev queries (the shortest, the longest, capitals, punctuation, quotes), then text the dev
# set lacks: accents and symbols, doubled spaces, and one past the model's 256 tokens (truncated)
QUERIES = [
    "ALS",
    "Bugs & Drugs in Pork: Yersinia and Ractopamine",
    "Nuts Don't Cause Expected Weight Gain",
    "Latest in Clinical Nutrition Volume 10 Now on DVD",
    'EPA dioxin limit has National Chicken Council worried products could be declared "unfit for consumption"',
    "Is multivitamin use really associated to an increased risk of breast cancer?",
    "Café  naïve   β-carotene ≥ 5 µg/day — Ørsted's résumé",
    " ".join(["vitamin D and the risk of falls in the elderly"] * 40),
]


@pytest.fixture(scope="module")
def minilm(minilm_path):
    from engine.retrieval.encoder import load_encoder

    return load_encoder(minilm_path, "cpu")


def test_onnx_embeddings_are_torchs(minilm, minilm_path):
    from engine.retrieval.encoder import encode, load_query_encoder

    encoder = load_query_encoder(minilm, minilm_path, "cpu")
    assert encoder.runtime == "onnx" and encoder.path.is_file()
    for query in QUERIES:
        vector, expected = encoder(query), encode(minilm, [query])
        assert vector.shape == expected.shape == (1, 384) and vector.dtype == np.float32
        assert float(vector[0] @ expected[0]) > 0.999, query
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-5


def test_trace_is_made_once(minilm, minilm_path, monkeypatch):
    import engine.onnx
    from engine.onnx import OnnxQueryEncoder

    traced = OnnxQueryEncoder.made(minilm, minilm_path, "cpu").path
    made = traced.stat().st_mtime_ns

    def trace_again(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(engine.onnx, "export_onnx", trace_again)
    assert OnnxQueryEncoder.made(minilm, minilm_path, "cpu").path == traced
    assert traced.stat().st_mtime_ns == made


def test_a_checked_trace_loads_without_the_model_until_made_again(minilm, minilm_path):
    """A load after the first check opens the trace from what the check recorded: the document
    encoder (lazy) stays unloaded, the embeddings are the checked ones; a record of another file
    (the trace made again since) is checked again, which loads the model."""
    import json

    from engine.onnx import OnnxQueryEncoder
    from engine.retrieval.encoder import DocumentEncoder, load_query_encoder

    checked = load_query_encoder(minilm, minilm_path, "cpu")
    lazy = DocumentEncoder(minilm_path, "cpu")
    again = load_query_encoder(lazy, minilm_path, "cpu")
    assert again.runtime == "onnx" and again.path == checked.path and lazy._model is None
    assert all(np.array_equal(again(q), checked(q)) for q in QUERIES)
    record = checked.path.with_suffix(".checked.json")
    record.write_text(json.dumps(json.loads(record.read_text()) | {"file": "another trace"}))
    assert OnnxQueryEncoder.checked(minilm_path, "cpu") is None
    assert load_query_encoder(lazy, minilm_path, "cpu").runtime == "onnx" and lazy._model is not None
    assert OnnxQueryEncoder.checked(minilm_path, "cpu") is not None  # the new check recorded


def test_concurrent_calls_agree(minilm, minilm_path):
    from engine.onnx import OnnxQueryEncoder

    encoder = OnnxQueryEncoder.made(minilm, minilm_path, "cpu")
    alone = [encoder(q) for q in QUERIES]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(encoder, QUERIES * 8))
    assert all(np.array_equal(v, alone[i % len(QUERIES)]) for i, v in enumerate(together))


def test_torch_serves_when_onnx_cannot(minilm, minilm_path, monkeypatch, caplog):
    import engine.onnx
    from engine.retrieval.encoder import load_query_encoder

    def broken(*args, **kwargs):
        raise RuntimeError("the tracer broke")

    monkeypatch.setattr(engine.onnx, "current", lambda path, source: False)
    monkeypatch.setattr(engine.onnx, "export_onnx", broken)
    with caplog.at_level(logging.WARNING):
        assert load_query_encoder(minilm, minilm_path, "cpu", "auto").runtime == "torch"
    assert "the tracer broke" in caplog.text
    with pytest.raises(RuntimeError, match="the tracer broke"):
        load_query_encoder(minilm, minilm_path, "cpu", "onnx")
    assert load_query_encoder(minilm, minilm_path, "cpu", "torch").runtime == "torch"
    assert load_query_encoder(minilm, minilm_path, "cuda", "auto").runtime == "torch"  # the fp16 GPU model


def test_int8_encoder_is_within_the_probe_cosine_and_made_once(minilm, minilm_path, monkeypatch):
    from engine.onnx import ENCODER_INT8_FILE, ENCODER_INT8_RECIPE, TRACE_KEY, recorded
    from engine.retrieval.encoder import encode, load_query_encoder

    int8 = load_query_encoder(minilm, minilm_path, "cpu", "auto", "int8")
    assert int8.runtime == "onnx-int8" and int8.path.name == ENCODER_INT8_FILE
    assert recorded(int8.path, TRACE_KEY) == ENCODER_INT8_RECIPE
    fp32 = load_query_encoder(minilm, minilm_path, "cpu", "auto", "none")
    assert fp32.runtime == "onnx" and fp32.path != int8.path
    cosines = []
    for query in QUERIES:
        vector, expected = int8(query), encode(minilm, [query])
        assert vector.shape == (1, 384) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
        cosines.append(float(vector[0] @ expected[0]))
    assert min(cosines) > 0.999, cosines
    assert not np.array_equal(int8(QUERIES[1]), fp32(QUERIES[1]))  # the int8 weights did run

    def quantize_again(*args, **kwargs):
        raise AssertionError("quantized again")

    made = int8.path.stat().st_mtime_ns
    monkeypatch.setattr("onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer", quantize_again)
    assert load_query_encoder(minilm, minilm_path, "cpu", "onnx", "int8").path == int8.path
    assert int8.path.stat().st_mtime_ns == made
    # its recorded check holds for the trace it was made from only: another trace, checked again
    import json

    from engine.onnx import OnnxQueryEncoder

    assert OnnxQueryEncoder.checked(minilm_path, "cpu", int8=True) is not None
    record = int8.path.with_suffix(".checked.json")
    record.write_text(json.dumps(json.loads(record.read_text()) | {"trace": "an earlier trace"}))
    assert OnnxQueryEncoder.checked(minilm_path, "cpu", int8=True) is None


def test_int8_copy_follows_its_trace(minilm, minilm_path, tmp_path):
    import os
    import shutil

    from engine.onnx import ENCODER_FILE, ENCODER_INT8_FILE, OnnxQueryEncoder, quantized_encoder

    trace = tmp_path / ENCODER_FILE
    shutil.copy(OnnxQueryEncoder.made(minilm, minilm_path, "cpu").path, trace)
    int8 = quantized_encoder(trace)
    assert int8 == tmp_path / ENCODER_INT8_FILE
    made = int8.stat().st_mtime_ns
    assert quantized_encoder(trace) == int8 and int8.stat().st_mtime_ns == made  # kept
    os.utime(trace, ns=(trace.stat().st_atime_ns, made - 10**9))  # another trace, even an older one
    assert quantized_encoder(trace) == int8 and int8.stat().st_mtime_ns != made  # made again
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_int8_is_refused_where_it_cannot_run_and_dropped_on_a_gpu(minilm, minilm_path, caplog):
    from engine.retrieval.encoder import load_query_encoder

    with pytest.raises(ValueError, match="not --query-encoder-runtime torch"):
        load_query_encoder(minilm, minilm_path, "cpu", "torch", "int8")
    with caplog.at_level(logging.WARNING):  # a setting carried to a GPU machine: the GPU's encoder serves
        assert load_query_encoder(minilm, minilm_path, "cuda", "auto", "int8").runtime == "torch"
    assert "is for a CPU" in caplog.text


def test_engine_serves_the_int8_encoder_when_asked(index_dir):
    from engine.search import HybridEngine

    settings = EngineSettings(index_dir=index_dir, device="cpu", rerank=False, query_encoder_quantize="int8")
    engine = HybridEngine(settings)
    try:
        assert engine.describe()["query_encoder_runtime"] == "onnx-int8"
        assert engine.search("caffeine and the liver", top_k=3)
    finally:
        engine.close()


def test_engine_encodes_queries_on_onnx_on_a_cpu(engine):
    assert engine.describe()["query_encoder_runtime"] == "onnx"
    assert engine.dense.encode_query("caffeine and the liver").shape == (1, 384)


def test_a_reader_searches_without_loading_the_document_encoder(index_dir, minilm, minilm_path):
    """A process that takes no writes (a reader here; a follower, a Ray search replica) encodes its
    queries from the checked trace and never imports sentence-transformers, most of a start's time."""
    import subprocess
    import sys

    from engine.retrieval.encoder import load_query_encoder
    from offline.server_process import ROOT

    load_query_encoder(minilm, minilm_path, "cpu")  # the trace checked, as any earlier start did
    code = (
        "import sys; from engine.search import HybridEngine; from engine.settings import EngineSettings;"
        f" engine = HybridEngine(EngineSettings(index_dir={str(index_dir)!r}, device='cpu', rerank=False));"
        " assert engine.search('arsenic in rice', 3); sys.exit('sentence_transformers' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_writer_embeds_documents_from_the_checked_trace_as_the_model_does(index_dir, minilm, minilm_path, tmp_path):
    """A writer on a CPU, once a load has checked the trace, embeds what it is sent without
    importing sentence-transformers (nor torch): the document written is found, and the vectors of
    texts of every length (one past the model's 256 tokens), batched with padding, are the model's
    to float noise."""
    import json
    import shutil
    import subprocess
    import sys

    from engine.retrieval.encoder import encode, load_query_encoder
    from offline.server_process import ROOT

    load_query_encoder(minilm, minilm_path, "cpu")
    index = shutil.copytree(index_dir, tmp_path / "index")
    code = (
        "import json, sys; from engine.search import HybridEngine; from engine.settings import EngineSettings;"
        " from engine.retrieval.encoder import encode; from engine.documents import DocumentIn;"
        f" engine = HybridEngine(EngineSettings(index_dir={str(index)!r}, device='cpu', rerank=False), writable=True);"
        " chunks = [{'chunk_id': 'c', 'content': 'quokka marsupial diet'}];"
        " engine.live.upsert(DocumentIn(document_id='q1', chunks=chunks), wait=True);"
        " found = [h.document_id for h in engine.search('quokka marsupial diet', 1)];"
        f" vectors = encode(engine.dense.encoder, {QUERIES!r}, 3).tolist();"
        " print(json.dumps([found, vectors, [m for m in ('sentence_transformers', 'torch') if m in sys.modules]]))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found, vectors, imported = json.loads(run.stdout.splitlines()[-1])
    assert found == ["q1"] and imported == []
    assert np.abs(np.asarray(vectors) - encode(minilm, QUERIES, 3)).max() < 1e-5


def test_auto_device_is_the_cpu_without_torch_where_no_gpu_driver_shows():
    """``--device auto`` asks torch whether it sees a GPU only where a GPU driver shows: elsewhere the
    answer is the CPU, without the seconds of importing torch (every process that searches asks)."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from engine.retrieval.encoder import _GPU_DRIVERS
    from offline.server_process import ROOT

    code = (
        "import sys; from engine.retrieval.encoder import pick_device;"
        " print(pick_device('auto'), 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    device, imported = run.stdout.split()
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert imported == str(any(Path(p).exists() for p in _GPU_DRIVERS))
