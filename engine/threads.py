"""Thread pools of a process that answers queries, set before torch loads."""

from __future__ import annotations

import os


def for_queries() -> None:
    """OpenMP workers sleep when idle instead of spinning (``OMP_WAIT_POLICY=PASSIVE``), unless the
    user set the variable; it only takes effect before torch is first imported.

    A query ran torch in one short burst (the query encoder; now ONNX Runtime on a CPU unless
    ``query_encoder_runtime`` says torch), then the tokenizer's and ONNX Runtime's thread pools;
    torch's spinning OpenMP workers held the cores those pools wanted. With
    them asleep, 40 dev queries x 3 runs on 2 cores, 3-layer student in int8: tokenizing 20 pairs
    6.4 -> 3.8 ms, the model 92 -> 90 ms, the rerank stage 100 -> 96 ms; the encoder's own forward
    pass is as fast. Training keeps OpenMP's default: its back-to-back torch operations ran 3-6%
    slower with sleeping workers.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
