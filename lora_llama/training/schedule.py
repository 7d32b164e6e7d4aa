"""The learning-rate schedule and the number of steps a run takes."""

from __future__ import annotations

import math


def lr_lambda(schedule: str, warmup: int, total: int):
    """Linear warmup, then cosine / linear decay to zero, or constant."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

    return f


def total_steps(train_cfg, n_micro_batches: int | None) -> int:
    """The run's optimiser steps; n_micro_batches: an epoch's (None for a stream, which train.max_steps ends)."""
    if train_cfg.epochs is None:
        return train_cfg.max_steps
    steps = math.ceil(train_cfg.epochs * n_micro_batches / train_cfg.grad_accum)
    # a max_steps the recipe sets caps an epoch count; its default (300) and an explicit null do not
    capped = "max_steps" in train_cfg.model_fields_set and train_cfg.max_steps is not None
    return min(steps, train_cfg.max_steps) if capped else steps
