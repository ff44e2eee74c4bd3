"""The cross-encoder on ONNX Runtime: the same scores as eager torch, faster on a CPU, and int8 where
asked (:mod:`engine.rerank.int8`), smoothed on the caller's text. The figures: docs/configuration.md,
"Why these defaults"."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from engine.onnx import ONNX_FILE, TRACE, current, export_onnx, onnx_path, open_session
from engine.rerank.int8 import SMOOTHED, quantize_int8, recipe
from engine.rerank.pair_tokens import PairTokenizer

Pairs = Sequence[tuple[str, str]]
# The reranker's recipe: TRACE with the last layer run for [CLS] alone (engine/rerank/first_token.py),
# in a file of its own, so that code of another version sharing the folder keeps its own trace
FIRST_TOKEN_TRACE = f"{TRACE}+first-token"
FIRST_TOKEN_FILE = "model-first-token.onnx"


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
        import torch

        from engine.rerank.first_token import FirstTokenLogits

        model = cross_encoder.transformers_model
        head = FirstTokenLogits.of(model)  # the last layer for [CLS] alone, where the architecture allows
        trace = FIRST_TOKEN_TRACE if head is not None else TRACE
        path = onnx_path(source, FIRST_TOKEN_FILE if head is not None else ONNX_FILE)
        if not current(path, source, trace):
            example = cross_encoder.tokenizer(["query"], ["a passage"], return_tensors="pt")
            export_onnx(model, example, "logits", path, head, trace)
        self.tokenize = PairTokenizer(cross_encoder.tokenizer, max_length)
        if quantize == "int8":
            traced, path = path, path.with_name(f"{path.stem}-int8.onnx")
            stale = not path.is_file() or path.stat().st_mtime < traced.stat().st_mtime
            if stale or (calibration is not None and recipe(path) != SMOOTHED):
                pairs = list(calibration()) if calibration is not None else []
                quantize_int8(traced, path, [self.tokenize(pairs[i : i + 32]) for i in range(0, len(pairs), 32)])
        # a query's 20-100 pairs of ~100 tokens are worth both cores (docs/experiments.md)
        self.session = open_session(path, device, torch.get_num_threads())
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.max_length = max_length
        self.path = path

    def run(self, features: dict[str, np.ndarray]) -> np.ndarray:
        """The logits of one padded batch."""
        return self.session.run(None, {name: features[name] for name in self.inputs})[0][:, 0]
