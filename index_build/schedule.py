"""The learning-rate schedule shared by the project's fine-tuning runs."""

from __future__ import annotations


def warmup_linear(optimizer, steps: int):
    """Linear warm-up over the first tenth of ``steps``, then linear decay to zero.

    The warm-up starts at 1/warmup of the rate rather than at zero (as ``transformers``'
    ``get_linear_schedule_with_warmup`` does), so a run of a few steps, as in the tests, loses none.
    """
    import torch

    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup)))
    )
