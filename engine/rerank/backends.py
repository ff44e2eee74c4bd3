"""The two ways a :class:`~engine.rerank.plan.RerankPlan` runs a cross-encoder's logits: ONNX
Runtime, or torch (fp16 on CUDA, compiled where the plan says; bf16 or the [CLS]-only last layer on
a CPU). Each takes token rows already made (:mod:`engine.rerank.pair_tokens`) and scores them in
length-sorted batches, so that a batch pads to its longest pair, not to the longest of the query."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np

from engine.rerank.cuda_passes import CudaPasses
from engine.rerank.onnx import OnnxCrossEncoder
from engine.rerank.plan import RerankPlan
from engine.rerank.token_rows import TokenRows

log = logging.getLogger(__name__)


class OnnxBackend:
    """ONNX Runtime's session over the model's trace (int8 where the plan says)."""

    def __init__(self, onnx: OnnxCrossEncoder, plan: RerankPlan, batch_size: int, pad_id: int) -> None:
        self.onnx, self.device, self.batch_size, self.pad_id = onnx, plan.device, batch_size, pad_id
        self.compile_state = "off"
        self.passes_state = "off"

    def launch(self, rows: TokenRows, lengths: list[int]) -> Callable[[], np.ndarray]:
        logits = self.logits(rows, lengths)
        return lambda: logits

    def logits(self, rows: TokenRows, lengths: list[int]) -> np.ndarray:
        logits = np.empty(len(rows), dtype=np.float32)
        for batch in batches(lengths, self.batch_size):
            logits[batch] = self.onnx.run(rows.take(np.asarray(batch)).features(self.pad_id))
        return logits


class TorchBackend:
    """The torch model as the plan prepares it. On CUDA a gathered batch is one pass, pinned and
    replayed from CUDA graphs (:mod:`engine.rerank.cuda_passes`), started by :meth:`launch` so that
    the caller prepares the next batch meanwhile; elsewhere, or compiled, length-sorted passes of
    ``batch_size``. A GPU out-of-memory error never fails a request: the one-pass path gives way to
    those passes, the batch is halved until it fits (and stays that size), and at batch size 1 the
    model moves to the CPU for good. A compiled pass that fails (no compiler, a Triton error), at
    warm-up or later, leaves the model eager for good, said once in the log and in
    ``compile_state``. ``model``: the transformers model; ``max_tokens``: the largest batch the
    caller gathers, in tokens."""

    def __init__(
        self, model, plan: RerankPlan, batch_size: int, max_length: int, pad_id: int, max_tokens: int = 0
    ) -> None:
        import torch

        from engine.rerank.compiled import CompiledPasses
        from engine.rerank.first_token import FirstTokenLogits

        self.model = model
        self.device, self.batch_size, self.pad_id = plan.device, batch_size, pad_id
        model.to(plan.device)
        if plan.precision == "bf16":  # eager attention: PyTorch's SDPA is the slower kernel in bf16 on a CPU
            model.set_attn_implementation("eager")
            model.to(torch.bfloat16)
        elif plan.precision == "fp16":
            model.half()
        self.first_token = FirstTokenLogits.of(model) if plan.first_token else None
        if self.first_token is not None and plan.precision == "bf16":
            self.first_token.head_in_fp32()
        self.compiled: CompiledPasses | None = None
        self.compile_state = "off"  # off, compiled, or eager and why
        if plan.compile:
            try:
                self.compiled = CompiledPasses(model, pad_id, batch_size, max_length)
                self.compiled.warm()  # every bucket now: no query waits for a compilation
                self.compile_state = "compiled"
            except Exception as exc:
                self._eager_from_now(exc)
        self.passes: CudaPasses | None = None
        self.passes_state = "off"  # what the one-pass path runs: graphs and their buckets, eager and why, off
        if plan.device == "cuda" and self.compiled is None:
            self.passes = CudaPasses(model, pad_id, max_length, max(max_tokens, batch_size * max_length), plan.graphs)
            self.passes_state = self.passes.state

    def launch(self, rows: TokenRows, lengths: list[int]) -> Callable[[], np.ndarray]:
        """``rows``' logits started: on CUDA's one-pass path queued at once (the GPU runs while the
        caller goes on), else computed now; the callable returned gives them."""
        import torch

        if self.passes is not None:
            try:
                return self.passes.launch(rows).result
            except torch.cuda.OutOfMemoryError:
                self._passes_off("out of GPU memory")
        logits = self.logits(rows, lengths)
        return lambda: logits

    def logits(self, rows: TokenRows, lengths: list[int]) -> np.ndarray:
        import torch

        if self.passes is not None:
            try:
                return self.passes(rows)
            except torch.cuda.OutOfMemoryError:
                self._passes_off("out of GPU memory")
        while True:
            try:
                return self._logits(rows, lengths)
            except torch.cuda.OutOfMemoryError:
                if self.compiled is not None:  # eager from now on: its compiled buckets were for the larger batches
                    self.compiled, self.compile_state = None, "eager: out of GPU memory"
                torch.cuda.empty_cache()
                if self.batch_size > 1:
                    self.batch_size //= 2
                    log.warning("GPU out of memory: reranking in batches of %d from now on", self.batch_size)
                    continue
                log.warning("GPU out of memory at batch size 1: reranking on the CPU from now on")
                self.model.to("cpu").float()
                self.device = "cpu"

    def _logits(self, rows: TokenRows, lengths: list[int]) -> np.ndarray:
        import torch

        device = next(self.model.parameters()).device
        logits = np.empty(len(rows), dtype=np.float32)
        with torch.inference_mode():
            for part in batches(lengths, self.batch_size):
                features = rows.take(np.asarray(part)).features(self.pad_id)
                if self.compiled is not None:
                    try:
                        logits[part] = self.compiled(features)
                        continue
                    except torch.cuda.OutOfMemoryError:
                        raise
                    except Exception as exc:
                        self._eager_from_now(exc)
                inputs = {name: torch.from_numpy(array).to(device) for name, array in features.items()}
                out = self.first_token(**inputs) if self.first_token is not None else self.model(**inputs).logits
                logits[part] = out[:, 0].float().cpu().numpy()
        return logits

    def _passes_off(self, why: str) -> None:
        import torch

        log.warning("the reranker's one-pass CUDA path stopped (%s): passes of %d from now on", why, self.batch_size)
        self.passes, self.passes_state = None, f"off: {why}"
        torch.cuda.empty_cache()

    def _eager_from_now(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        log.warning("the compiled reranker failed (%s); it runs eager from now on", reason)
        self.compiled = None
        self.compile_state = f"eager: compiling failed ({reason})"


def batches(lengths: list[int], size: int) -> Iterator[list[int]]:
    """Positions in batches of ``size``, shortest first (padding costs less)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for start in range(0, len(order), size):
        yield order[start : start + size]
