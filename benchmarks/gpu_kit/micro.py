"""The reranker's passes on the GPU, before anything is carried: the image's torch and transformers
alone, random-weight MiniLM cross-encoders (the served shape: 384 wide, 12 heads; 6 layers or the
3-layer student), random pair rows shaped like NFCorpus's (most fill the window).

For rows {100, 753, 1024} x window {256, 128, 96} x layers {6, 3}, pairs a second of:

- ``split``: the path served until 2026-11-28, each batch in 128-row passes padded in Python,
  three pageable int64 arrays copied, transformers' forward (a host sync in its mask check);
- ``one_pass``: :class:`~engine.rerank.cuda_passes.CudaPasses` eager: one pass, pinned, the mask
  and token types made on the GPU;
- ``graphs``: the same replayed from its CUDA graph;
- ``graphs_pipelined``: batches started back to back, each collected while the next runs (what
  the served batcher does under load).

Each with its agreement with ``split`` (max |logit difference|, fp16), and one torch.profiler
summary of a 100-row pass at 96 tokens, 6 layers, for ``split`` and ``graphs``: the GPU's kernel time
against the wall time, and the host syncs. ``--small`` runs it tiny on a CPU, to prove it runs."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

FULL = {"rows": (100, 753, 1024), "windows": (256, 128, 96), "layers": (6, 3), "reps": 15}
SMALL = {"rows": (5, 19), "windows": (32,), "layers": (1,), "reps": 2}  # a CPU's rehearsal: the code runs
WARM = 3


def _model(layers: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=384, num_attention_heads=12, intermediate_size=1536, num_hidden_layers=layers, num_labels=1
    )
    return BertForSequenceClassification(config).eval()


def _rows(n: int, window: int, seed: int = 0):
    """Pair rows as NFCorpus gives them: 9 in 10 fill the window (abstracts run ~400 tokens)."""
    from engine.rerank.pair_tokens import PairRow
    from engine.rerank.token_rows import TokenRows

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = window if rng.random() < 0.9 else int(rng.integers(window // 3, window))
        query = int(rng.integers(6, 24))
        ids = rng.integers(1000, 30000, length).astype(np.int64)
        ids[0], ids[query - 1], ids[-1] = 101, 102, 102
        rows.append(PairRow(ids, (np.arange(length) >= query).astype(np.int64)))
    return TokenRows.of(rows)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(run, reps: int) -> float:
    for _ in range(WARM):
        run()
    _sync()
    took = []
    for _ in range(reps):
        began = time.perf_counter()
        run()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def _pipelined(passes, rows, batches: int = 12) -> float:
    """Seconds a batch when ``batches`` are started back to back, each collected after the next starts."""
    _sync()
    began = time.perf_counter()
    waiting = passes.launch(rows)
    for _ in range(batches - 1):
        following = passes.launch(rows)
        waiting.result()
        waiting = following
    waiting.result()
    return (time.perf_counter() - began) / batches


def _profile(run) -> dict:
    """One pass under torch.profiler: the GPU's kernel time, the wall time, and the host's syncs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    _sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        run()
        _sync()
        wall = time.perf_counter() - began
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or e.key in ("aten::item", "aten::is_nonzero")}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch"))
    return {
        "wall_ms": round(wall * 1000, 2),
        "kernel_ms": round(kernel_us / 1000, 2),
        "gpu_busy": round(kernel_us / 1e6 / wall, 3),
        "host_syncs": syncs,
        "launches": launches,
        "top": [
            {"op": e.key[:60], "device_ms": round(e.self_device_time_total / 1000, 3), "count": e.count}
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        ],
    }


def micro(out: Path, small: bool = False) -> int:
    """Each configuration's line into ``out`` (JSON) as it ends; ``small``: a CPU's rehearsal."""
    import torch
    import transformers

    from engine.rerank.backends import TorchBackend
    from engine.rerank.cuda_passes import CudaPasses
    from engine.rerank.plan import RerankPlan

    scale = SMALL if small else FULL
    cuda = torch.cuda.is_available()
    report: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "reps": scale["reps"],
        "results": [],
    }
    device, precision = ("cuda", "fp16") if cuda else ("cpu", "fp32")
    plan = RerankPlan(device=device, backend="torch", precision=precision, compile=False, first_token=False)
    most = max(scale["rows"])
    for layers in scale["layers"]:
        for window in scale["windows"]:
            model = _model(layers)
            split = TorchBackend(model, plan, 128, window, 0, most * window)
            split.passes = None  # the path served until now: 128-row passes
            eager = CudaPasses(model, 0, window, most * window, graphs=False)
            began = time.perf_counter()
            graphs = CudaPasses(model, 0, window, most * window, graphs=True)
            capture_s = time.perf_counter() - began
            for n in scale["rows"]:
                rows = _rows(n, window)
                lengths = rows.lengths.tolist()
                reference = split.logits(rows, lengths)
                entry = {"layers": layers, "window": window, "rows": n, "graph_state": graphs.state}
                entry["capture_s"] = round(capture_s, 2)
                for name, run in (
                    ("split", lambda rows=rows, lengths=lengths: split.logits(rows, lengths)),
                    ("one_pass", lambda rows=rows: eager(rows)),
                    ("graphs", lambda rows=rows: graphs(rows)),
                ):
                    seconds = _timed(run, scale["reps"])
                    entry[name] = {"ms": round(seconds * 1000, 3), "pairs_per_s": round(n / seconds)}
                    if name != "split":
                        entry[name]["max_abs_diff"] = float(np.abs(run() - reference).max())
                seconds = _pipelined(graphs, rows)
                entry["graphs_pipelined"] = {"ms": round(seconds * 1000, 3), "pairs_per_s": round(n / seconds)}
                tflop = 2 * n * _params(model) * window / 1e12
                entry["tflops_graphs_pipelined"] = round(tflop / seconds, 1)
                if n == scale["rows"][0] and layers == scale["layers"][0] and window == scale["windows"][-1]:
                    entry["profile"] = {
                        "split": _profile(lambda rows=rows, lengths=lengths: split.logits(rows, lengths)),
                        "graphs": _profile(lambda rows=rows: graphs(rows)),
                    }
                report["results"].append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k != "profile"}), flush=True)
                out.write_text(json.dumps(report, indent=1) + "\n")  # each line kept as it ends
            del split, eager, graphs, model
            if cuda:
                torch.cuda.empty_cache()
    return 0


def _params(model) -> int:
    """Weights a token passes through (the embeddings excluded): FLOPs a token ~ 2 x this."""
    return sum(p.numel() for name, p in model.named_parameters() if "embeddings" not in name)
