"""The torch reranker, compiled for a few shapes and warmed over them at start.

``torch.compile`` guards what it compiled on the shapes it saw; a shape that breaks a guard at
request time means a compilation of seconds inside a query. So every pass is padded up to a
bucket: its pairs to the next of a few batch sizes, its width to the next of a few lengths (64,
128, 256, 512, never past the window), and :meth:`CompiledPasses.warm` runs each bucket before the
server says it is ready. The model is compiled with dynamic shapes (as it was timed on the H100,
docs/gpu.md), so the buckets share one compilation where the guards allow rather than costing one
each. A pass's padding rows attend to their first token only (a row attending to nothing is not
defined), and their logits are dropped. :class:`~engine.rerank.cross_encoder.Reranker` builds one
when its plan says (``rerank_compile`` with the torch runtime, on CUDA or a CPU).

Not CUDA graphs (``mode="reduce-overhead"``, a little faster still on the H100: docs/gpu.md): a
graph is recorded for the thread that ran it, and a server's searches call the model from several
threads.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np

log = logging.getLogger(__name__)
LENGTH_BUCKETS = (64, 128, 256, 512)
ROW_BUCKETS = (8, 32)  # and the batch size itself


def buckets(batch_size: int, max_length: int) -> tuple[list[int], list[int]]:
    """The pass sizes and widths a pass is padded up to."""
    rows = sorted({n for n in ROW_BUCKETS if n < batch_size} | {batch_size})
    widths = sorted({n for n in LENGTH_BUCKETS if n < max_length} | {max_length})
    return rows, widths


def pad_to_bucket(features: dict[str, np.ndarray], rows: list[int], widths: list[int], pad_id: int) -> dict:
    """``features`` (one padded pass, from :func:`~engine.rerank.pair_tokens.pad_rows`) grown to the
    smallest bucket that holds it; the real rows come first, unchanged but for more padding."""
    n, width = features["input_ids"].shape
    to_rows, to_width = rows[bisect.bisect_left(rows, n)], widths[bisect.bisect_left(widths, width)]
    grown = {
        "input_ids": np.full((to_rows, to_width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((to_rows, to_width), dtype=np.int64),
        "token_type_ids": np.zeros((to_rows, to_width), dtype=np.int64),
    }
    for name, array in features.items():
        grown[name][:n, :width] = array
    grown["attention_mask"][n:, 0] = 1
    return grown


class CompiledPasses:
    """``model``'s logits for one pass, through its compiled copy at the pass's bucket."""

    def __init__(self, model, pad_id: int, batch_size: int, max_length: int) -> None:
        import torch

        self.rows, self.widths = buckets(batch_size, max_length)
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        shapes = len(self.rows) * len(self.widths)
        dynamo = torch._dynamo.config
        dynamo.cache_size_limit = max(dynamo.cache_size_limit, shapes + 2)  # at worst one a bucket, none evicted
        self.forward = torch.compile(model, dynamic=True)

    def __call__(self, features: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        n = features["input_ids"].shape[0]
        grown = pad_to_bucket(features, self.rows, self.widths, self.pad_id)
        inputs = {name: torch.from_numpy(array).to(self.device) for name, array in grown.items()}
        return self.forward(**inputs).logits[:n, 0].float().cpu().numpy()

    def warm(self) -> float:
        """Compile every bucket now (seconds taken), so that no query waits for a compilation;
        ``self.warmed``: each bucket's seconds and the graphs dynamo compiled for it."""
        import torch
        from torch._dynamo.utils import counters

        started = time.perf_counter()
        self.warmed: list[dict] = []
        with torch.inference_mode():
            for rows in self.rows:
                for width in self.widths:
                    graphs, began = counters["stats"]["unique_graphs"], time.perf_counter()
                    ids = np.full((rows, width), self.pad_id, dtype=np.int64)
                    self({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})
                    self.warmed.append(
                        {
                            "rows": rows,
                            "width": width,
                            "seconds": round(time.perf_counter() - began, 2),
                            "graphs": counters["stats"]["unique_graphs"] - graphs,
                        }
                    )
        seconds = time.perf_counter() - started
        log.info(
            "reranker compiled for %d batch sizes x %d lengths in %.1f s", len(self.rows), len(self.widths), seconds
        )
        return seconds
