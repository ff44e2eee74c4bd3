"""The cross-encoder on ONNX Runtime: the same scores as eager torch, about 1.6x faster on a CPU.

The model is traced once into ``model.onnx`` (dynamic batch and length) beside its weights, or in
the user's cache when that folder is read-only, and re-traced when the weights are newer or the
trace was made by an older recipe (``TRACE`` in the file's metadata). With
``quantize="int8"`` the trace is quantized once more into ``model-int8.onnx`` (engine/rerank/int8.py), smoothed
on pairs from ``calibration`` when the caller has text to give (the engine: its index's documents).
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from engine.rerank.int8 import SMOOTHED, quantize_int8, recipe, recorded
from engine.rerank.pair_tokens import PairTokenizer

Pairs = Sequence[tuple[str, str]]

log = logging.getLogger(__name__)
ONNX_DIR = "onnx"
ONNX_FILE = "model.onnx"
INT8_FILE = "model-int8.onnx"
# The recipe of a trace; a model traced by another one is traced again. "eager-attention": attention
# written out as plain matrix products. Traced through PyTorch's SDPA, every layer carried the
# NaN-guarding Where and IsNaN of its mask over the whole score tensor: 10% of a 3-layer model's
# time on a CPU (103 -> 93 ms for 20 pairs of 96 tokens in int8), for the same scores.
TRACE = "eager-attention"
TRACE_KEY = "hybrid_search_trace"


def onnx_path(source: str) -> Path:
    """Where the traced model of ``source`` (a folder or a hub id) lives."""
    folder = Path(source)
    if folder.is_dir() and os.access(folder, os.W_OK):
        return folder / ONNX_DIR / ONNX_FILE
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid-search" / ONNX_DIR
    return cache / hashlib.sha1(str(folder.resolve() if folder.is_dir() else source).encode()).hexdigest() / ONNX_FILE


def export_onnx(model, tokenizer, path: Path) -> None:
    """Trace a Hugging Face sequence-classification model to ONNX (atomically: temp file + rename),
    its attention written out in plain operators (``TRACE``), whatever the model serves torch with."""
    import onnx
    import torch

    example = tokenizer(["query"], ["a passage"], return_tensors="pt")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in example]
    axes = {n: {0: "batch", 1: "length"} for n in names} | {"logits": {0: "batch"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    model.eval()
    serving = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with warnings.catch_warnings():  # the tracer's notes on shapes; the tests compare the scores
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                (),
                str(partial),
                kwargs={n: example[n] for n in names},
                dynamo=False,  # the TorchScript tracer handles BERT's dynamic shapes without onnxscript
                input_names=names,
                output_names=["logits"],
                dynamic_axes=axes,
                opset_version=17,
            )
    finally:
        model.set_attn_implementation(serving)
    traced = onnx.load(str(partial))
    onnx.helper.set_model_props(traced, {TRACE_KEY: TRACE})
    onnx.save(traced, str(partial))
    partial.replace(path)
    log.info("reranker traced to ONNX: %s", path)


class OnnxCrossEncoder:
    """The model's logits (``CrossEncoder.predict`` without the activation) on ONNX Runtime."""

    def __init__(
        self,
        cross_encoder,
        source: str,
        device: str,
        max_length: int,
        quantize: str = "none",
        calibration: Callable[[], Pairs] | None = None,
    ) -> None:
        import onnxruntime as ort
        import torch

        path = onnx_path(source)
        weights = [p.stat().st_mtime for p in Path(source).glob("*.safetensors")] if Path(source).is_dir() else []
        if not path.is_file() or path.stat().st_mtime < max(weights, default=0) or recorded(path, TRACE_KEY) != TRACE:
            export_onnx(cross_encoder.transformers_model, cross_encoder.tokenizer, path)
        self.tokenize = PairTokenizer(cross_encoder.tokenizer, max_length)
        if quantize == "int8":
            traced, path = path, path.with_name(INT8_FILE)
            stale = not path.is_file() or path.stat().st_mtime < traced.stat().st_mtime
            if stale or (calibration is not None and recipe(path) != SMOOTHED):
                pairs = list(calibration()) if calibration is not None else []
                quantize_int8(traced, path, [self.tokenize(pairs[i : i + 32]) for i in range(0, len(pairs), 32)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            providers.insert(0, "CUDAExecutionProvider")
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        if device == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            log.warning("ONNX Runtime has no CUDA provider here (install onnxruntime-gpu): reranking on the CPU")
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.max_length = max_length
        self.path = path

    def run(self, features: dict[str, np.ndarray]) -> np.ndarray:
        """The logits of one padded batch."""
        return self.session.run(None, {name: features[name] for name in self.inputs})[0][:, 0]
