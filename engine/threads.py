"""Thread pools of a process that answers queries, set before torch loads."""

from __future__ import annotations

import os


def for_queries() -> None:
    """OpenMP workers sleep when idle instead of spinning (``OMP_WAIT_POLICY=PASSIVE``), unless the
    user set the variable; it only takes effect before torch is first imported.

    A query ran torch in one short burst (the query encoder; now ONNX Runtime on a CPU unless
    ``query_encoder_runtime`` says torch), then the tokenizer's and ONNX Runtime's thread pools;
    torch's spinning OpenMP workers held the cores those pools wanted. With them asleep the
    tokenizer, the model and the rerank stage ran faster on 2 cores, and the encoder's own forward
    pass as fast. Training keeps OpenMP's default: its back-to-back torch operations ran slower
    with sleeping workers. The figures: docs/experiments.md, "2026-11-24 · CPU reranking: the trace,
    the tokenizer and smoothed int8" (OpenMP workers spinning).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def share() -> int | None:
    """Threads a pool of this process should take: the first value of ``OMP_NUM_THREADS`` where it
    is set (``serve --workers`` sets each process's share of the cores, as torch and OpenMP read
    it), else None (the library's own default)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # OpenMP's form: "4" or "4,2"
    return int(value) if value.isdigit() and int(value) > 0 else None
