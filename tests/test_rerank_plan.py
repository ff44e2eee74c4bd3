"""How a reranker runs is decided once, by a pure plan (engine/rerank/plan.py), and a compiled torch
model that cannot be compiled serves eager: the plan without a model, the compiled path and its
fallback on this CPU (torch.compile's CPU backend with the machine's C++ compiler, then without one)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.rerank.plan import RerankerError, plan_reranker

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("asked", "runtime", "precision", "compiled", "first_token"),
    [
        (dict(device="cuda"), "torch", "fp16", False, False),
        (dict(device="cuda", compile_model=True), "torch", "fp16", True, False),
        (dict(device="cpu", quantize="none"), "onnx", "fp32", False, False),
        (dict(device="cpu", bf16_native=True), "torch-bf16", "bf16", False, True),
        (dict(device="cpu", bf16_native=False), "onnx", "fp32", False, False),
        (dict(device="cpu", card_quantize="int8"), "onnx-int8", "int8", False, False),
        (dict(device="cpu", runtime="torch", quantize="none"), "torch", "fp32", False, True),
        (dict(device="cpu", runtime="torch", quantize="none", compile_model=True), "torch", "fp32", True, True),
        (dict(device="cuda", quantize="int8"), "onnx-int8", "int8", False, False),
    ],
)
def test_the_plan_follows_device_runtime_precision_and_card(asked, runtime, precision, compiled, first_token):
    plan = plan_reranker(**asked)
    assert (plan.runtime, plan.precision, plan.compile, plan.first_token) == (runtime, precision, compiled, first_token)
    assert plan.shown()["runtime"] == runtime


def test_settings_that_do_not_apply_are_said_not_silently_dropped():
    onnx = plan_reranker("cpu", "onnx", "none", compile_model=True)
    assert not onnx.compile and any("compiling is for the torch runtime; with onnx" in n for n in onnx.notes)
    bf16_on_gpu = plan_reranker("cuda", quantize="bf16")
    assert bf16_on_gpu.precision == "fp16" and any("bf16 is for a CPU" in n for n in bf16_on_gpu.notes)
    slow = plan_reranker("cpu", quantize="bf16", bf16_native=False)
    assert slow.precision == "bf16" and any("no native bf16" in n for n in slow.notes)


def test_impossible_combinations_are_refused():
    with pytest.raises(RerankerError, match="bf16 needs the torch runtime"):
        plan_reranker("cpu", "onnx", "bf16")
    with pytest.raises(RerankerError, match="needs the ONNX runtime"):
        plan_reranker("cpu", "torch", "int8")


def test_torch_takes_over_only_where_the_runtime_was_left_to_auto():
    auto = plan_reranker("cpu", "auto", "none")
    assert auto.torch_if_onnx_fails and not plan_reranker("cpu", "onnx", "none").torch_if_onnx_fails
    fallen = auto.on_torch("no trace")
    assert (fallen.runtime, fallen.precision, fallen.first_token) == ("torch", "fp32", True)
    assert "no trace" in fallen.notes[-1]


COMPILED = """
import numpy as np
import torch
from sentence_transformers import CrossEncoder
from engine.rerank.backends import TorchBackend
from engine.rerank.pair_tokens import PairTokenizer
from engine.rerank.plan import RerankPlan
from engine.rerank.token_rows import TokenRows

model = CrossEncoder({path!r}, device="cpu", max_length=64, num_labels=1)
tokenize = PairTokenizer(model.tokenizer, 64)
pairs = [("caffeine and the liver", "coffee drinkers had lower liver enzymes"), ("soy", "soy milk and beans")] * 3
rows = TokenRows.of(tokenize.rows(pairs))
lengths = [len(q) + len(p) for q, p in pairs]
plan = RerankPlan(device="cpu", backend="torch", precision="fp32", compile=False, first_token=False)
eager = TorchBackend(model.transformers_model, plan, 8, 64, tokenize.pad_id).logits(rows, lengths)
backend = TorchBackend(model.transformers_model, RerankPlan(**{{**plan.__dict__, "compile": True}}), 8, 64, tokenize.pad_id)
print(backend.compile_state)
assert np.allclose(backend.logits(rows, lengths), eager, atol=1e-4), "compiled or not, the same logits"
"""


@pytest.fixture(scope="module")
def one_layer_dir(reranker_dir, tmp_path_factory) -> str:
    """The seeded cross-encoder cut to its first layer: the same modules compiled (embeddings, a
    BERT layer, pooler, head), a sixth of the graph (inductor's work for 6 layers against 1: 500 s
    against 324 s at load 14 on 2 cores)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("one-layer")
    AutoModelForSequenceClassification.from_pretrained(reranker_dir, num_hidden_layers=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(reranker_dir).save_pretrained(folder)
    return str(folder)


def _compiled_run(reranker_dir: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The compiled path in a fresh interpreter with fresh compile caches (nothing reused)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env}
    script = COMPILED.format(path=reranker_dir)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_compiled_path_scores_as_eager_on_this_cpu(one_layer_dir, tmp_path):
    done = _compiled_run(one_layer_dir, tmp_path, {})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "compiled"


def test_without_a_compiler_the_model_serves_eager_and_says_why(one_layer_dir, tmp_path):
    done = _compiled_run(one_layer_dir, tmp_path, {"CXX": "/bin/false", "CC": "/bin/false"})
    assert done.returncode == 0, done.stderr[-3000:]
    state = done.stdout.strip().splitlines()[-1]
    assert state.startswith("eager: compiling failed"), state
