"""One pass a gathered batch on CUDA: fed from pinned buffers, replayed from CUDA graphs, its scores
left on the GPU until one sync a batch, so that the host prepares the next batch meanwhile.

The path it replaces split each gathered batch into 128-row passes, padded each in Python, copied
three int64 arrays from pageable memory and met a host sync inside the forward (transformers' mask
check), so the GPU idled between small launches (docs/gpu.md). Here a batch is:

- padded once, vectorised, into a pinned slot from :class:`~engine.rerank.token_rows.TokenRows`:
  the token ids (int32) and two numbers a row, its length and its query's length; the attention
  mask and token type ids are made on the GPU from those;
- copied, run and its logits copied back by work queued on one stream, without a host sync: the
  caller gets a :class:`Pending` at once and syncs only when it wants the scores. Two slots
  alternate, so a batch is padded while the one before it runs;
- run by the CUDA graph captured at start for its bucket (rows x width, the smallest that holds it;
  padding rows attend to their first token, and their logits are dropped), or eager where graphs
  are off or their capture failed, which is said in :attr:`CudaPasses.state` and never fails a
  request. A batch larger than the largest bucket runs as several passes.

The forward is :class:`~engine.rerank.first_token.FirstTokenLogits` (the last layer for ``[CLS]``
alone, with its own additive mask) where the architecture allows, else the model's own. On a CPU
the same passes run without pinning, streams or graphs: how the tests hold them to the split path.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from contextlib import nullcontext

import numpy as np

from engine.rerank.token_rows import TokenRows

log = logging.getLogger(__name__)
WIDTH_STEP = 32  # widths are padded up to a multiple of this (and never past the window)
ROW_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
SLOTS = 2  # pinned buffers in turn: one batch padded while the last one runs


def widths(max_length: int) -> list[int]:
    """The widths a pass is padded up to: multiples of :data:`WIDTH_STEP`, and the window."""
    return sorted({w for w in range(WIDTH_STEP, max_length, WIDTH_STEP)} | {max_length})


def row_buckets(width: int, max_tokens: int) -> list[int]:
    """The pass sizes at ``width``: :data:`ROW_BUCKETS` up to the batch's token budget (at least 8)."""
    cap = max(max_tokens // width, ROW_BUCKETS[0])
    return [n for n in ROW_BUCKETS if n <= cap] or [ROW_BUCKETS[0]]


class Pending:
    """A batch's logits on their way back: :meth:`result` waits for the GPU (one sync) the first time."""

    def __init__(self, n: int) -> None:
        self.logits = np.empty(n, dtype=np.float32)
        self._passes: list[_Slot] = []

    def result(self) -> np.ndarray:
        for slot in self._passes:
            slot.collect(self)
        self._passes = []
        return self.logits


class _Slot:
    """Pinned host buffers for one pass in flight, and the pass whose logits are still in them."""

    def __init__(self, torch, cells: int, rows: int, cuda: bool) -> None:
        self.ids = torch.empty(cells, dtype=torch.int32, pin_memory=cuda)
        self.meta = torch.empty(2 * rows, dtype=torch.int32, pin_memory=cuda)  # lengths, then query lengths
        self.logits = torch.empty(rows, dtype=torch.float32, pin_memory=cuda)
        self.ids_np, self.meta_np, self.logits_np = self.ids.numpy(), self.meta.numpy(), self.logits.numpy()
        self.done = torch.cuda.Event() if cuda else None  # None: a CPU's copies are done when made
        self.lock = threading.Lock()
        self.owner: tuple[Pending, np.ndarray] | None = None  # whose logits, and their positions

    def collect(self, pending: Pending | None = None) -> None:
        """Copy the logits held here to their batch (only ``pending``'s, when given)."""
        with self.lock:
            if self.owner is None or (pending is not None and self.owner[0] is not pending):
                return
            if self.done is not None:
                self.done.synchronize()
            owner, where = self.owner
            owner.logits[where] = self.logits_np[: len(where)]
            self.owner = None


class _Graph:
    """A captured pass at one bucket: its static inputs and output on the GPU."""

    def __init__(self, torch, device, rows: int, width: int) -> None:
        self.ids = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.meta = torch.ones((2, rows), dtype=torch.int32, device=device)
        self.graph = None
        self.logits = None


class CudaPasses:
    """``model``'s logits for pair rows on CUDA, one pass a batch (see the module's doc).
    ``max_tokens``: the largest batch the caller gathers, in tokens (the largest bucket holds it).
    ``graphs``: capture a CUDA graph per bucket now (seconds and count in :attr:`state`)."""

    def __init__(self, model, pad_id: int, max_length: int, max_tokens: int, graphs: bool = True) -> None:
        import torch

        from engine.rerank.first_token import FirstTokenLogits

        self.torch, self.model = torch, model
        self.device = next(model.parameters()).device
        self.first_token = FirstTokenLogits.of(model)
        self.pad_id, self.max_length = pad_id, max_length
        self.widths = widths(max_length)
        self.rows = {w: row_buckets(w, max_tokens) for w in self.widths}
        largest_rows = max(r[-1] for r in self.rows.values())
        largest_cells = max(r[-1] * w for w, r in self.rows.items())
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.slots = [_Slot(torch, largest_cells, largest_rows, cuda) for _ in range(SLOTS)]
        self._turn = 0
        self._launching = threading.Lock()  # one pass's copy, replay and copy back queued together
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.state = "eager"
        if graphs and cuda:
            self._capture()

    def __call__(self, rows: TokenRows) -> np.ndarray:
        return self.launch(rows).result()

    def launch(self, rows: TokenRows) -> Pending:
        """Queue ``rows``' passes on the GPU and return at once; the logits come with ``result()``."""
        pending = Pending(len(rows))
        if not len(rows):
            return pending
        width = self._width(rows)
        most = self.rows[width][-1]
        if len(rows) <= most:
            self._launch(rows, np.arange(len(rows)), pending)
            return pending
        order = np.argsort(rows.lengths, kind="stable")  # passes of like lengths pad less
        for start in range(0, len(rows), most):
            part = order[start : start + most]
            self._launch(rows.take(part), part, pending)
        return pending

    def _width(self, rows: TokenRows) -> int:
        return self.widths[bisect.bisect_left(self.widths, int(rows.lengths.max()))]

    def _launch(self, rows: TokenRows, where: np.ndarray, pending: Pending) -> None:
        torch = self.torch
        n, width = len(rows), self._width(rows)
        buckets = self.rows[width]
        size = buckets[bisect.bisect_left(buckets, n)]
        with self._launching:
            slot = self.slots[self._turn]
            self._turn = (self._turn + 1) % SLOTS
            slot.collect()  # the last pass here hands its logits over before this one's replace them
            rows.padded(slot.ids_np[: size * width].reshape(size, width), self.pad_id)
            meta = slot.meta_np[: 2 * size].reshape(2, size)
            meta[:, n:] = 1  # a padding row: its first token alone
            meta[0, :n], meta[1, :n] = rows.lengths, rows.query_lengths
            host_ids, host_meta = slot.ids[: size * width].view(size, width), slot.meta[: 2 * size].view(2, size)
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                graph = self.graphs.get((size, width))
                if graph is not None:
                    graph.ids.copy_(host_ids, non_blocking=True)
                    graph.meta.copy_(host_meta, non_blocking=True)
                    graph.graph.replay()
                    logits = graph.logits
                else:
                    ids_gpu = host_ids.to(self.device, non_blocking=True)
                    logits = self._forward(ids_gpu, host_meta.to(self.device, non_blocking=True))
                slot.logits[:size].copy_(logits, non_blocking=True)
                if slot.done is not None:
                    slot.done.record(self.stream)
            with slot.lock:
                slot.owner = (pending, where)
            pending._passes.append(slot)

    def _forward(self, ids, meta):
        """Logits (fp32, one a row) of padded ids with each row's length and query length in ``meta``:
        the mask and token types made here, on the GPU, with no host sync."""
        torch = self.torch
        positions = torch.arange(ids.shape[1], device=ids.device)
        mask = positions < meta[0, :, None]
        types = (positions >= meta[1, :, None]) & mask
        ids, types = ids.long(), types.long()
        with torch.inference_mode():
            if self.first_token is not None:
                out = self.first_token(input_ids=ids, attention_mask=mask, token_type_ids=types)
            else:
                out = self.model(input_ids=ids, attention_mask=mask.long(), token_type_ids=types).logits
        return out[:, 0].float()

    def _capture(self) -> None:
        """A graph for every bucket, largest first (it sizes the memory pool the others share);
        any failure leaves the passes eager, with the reason in :attr:`state`."""
        torch = self.torch
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for width in sorted(self.widths, reverse=True):
                for rows in sorted(self.rows[width], reverse=True):
                    graph = _Graph(torch, self.device, rows, width)
                    torch.cuda.synchronize(self.device)  # its inputs made on the default stream
                    with torch.cuda.stream(self.stream):
                        self._forward(graph.ids, graph.meta)  # warm-up: kernels chosen, workspaces made
                    self.stream.synchronize()
                    graph.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph.graph, pool=pool, stream=self.stream):
                        graph.logits = self._forward(graph.ids, graph.meta)
                    self.graphs[(rows, width)] = graph
        except Exception as exc:  # out of memory, an op capture does not allow: eager, and why
            self.graphs.clear()
            torch.cuda.synchronize(self.device)
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            log.warning("capturing the reranker's CUDA graphs failed (%s); it runs eager", reason)
            self.state = f"eager: graph capture failed ({reason})"
            return
        seconds = time.perf_counter() - started
        self.state = f"graphs: {len(self.graphs)} buckets captured in {seconds:.1f} s"
        log.info("reranker: %s", self.state)
