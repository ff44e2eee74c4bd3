"""Cross-encoder reranking with sentence-transformers' ``CrossEncoder``."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.models import resolve_model


log = logging.getLogger(__name__)


class RerankerError(RuntimeError):
    """The reranker folder or id cannot be loaded."""


class Reranker:
    """Scores (query, document) pairs jointly; fp16 on CUDA, length-sorted batches."""

    def __init__(self, name: str, device: str, max_length: int = 256, batch_size: int = 32) -> None:
        from sentence_transformers import CrossEncoder

        source = resolve_model(name)
        if Path(name).exists() and not (Path(name) / "config.json").is_file():
            raise RerankerError(f"{name}: not a model folder (no config.json)")
        try:
            self.model = CrossEncoder(source, device=device, max_length=max_length, num_labels=1)
        except Exception as exc:  # the libraries raise many kinds; the user needs the name and cause
            raise RerankerError(f"cannot load reranker {name!r}: {exc}") from exc
        if device == "cuda":
            self.model.half()
        self.name = name
        self.device = device
        self.batch_size = batch_size

    def score(self, query: str, passages: list[str]) -> list[float]:
        """One relevance score per passage, in the order given."""
        return self.score_pairs([(query, p) for p in passages])

    def score_pairs(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores for (query, passage) pairs; the model sorts them by length into batches.

        A GPU out-of-memory error never fails the request: the batch is halved until it fits,
        and at batch size 1 the model moves to the CPU for good.
        """
        import torch

        if not pairs:
            return []
        batch = self.batch_size
        while True:
            try:
                scores = self.model.predict(pairs, batch_size=batch, show_progress_bar=False, convert_to_numpy=True)
                return [float(s) for s in scores]
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                if batch > 1:
                    batch //= 2
                    continue
                log.warning("GPU out of memory at batch size 1: reranking on the CPU from now on")
                self.model.to("cpu").float()
                self.device = "cpu"
