"""Learning-rate schedules for managed training: linear warmup, then cosine / linear decay to 0, or constant.

The schedule is a pure function of the optimizer step, so resuming needs nothing but the step. Step s (0-based) is
the (s+1)-th optimizer update:

    s <  W:  lr * (s + 1) / W                       (the first update already moves; update W-1 uses the full lr)
    s >= W:  lr * f(p),  p = (s - W) / (N - W)      (p runs over [0, 1); the value 0 at p = 1 is never applied)
             cosine: f = (1 + cos(pi p)) / 2,  linear: f = 1 - p,  constant: f = 1

with W warmup steps and N total steps.
"""
from __future__ import annotations

import math

from services.common.methods.sft import LR_SCHEDULERS


def lr_multiplier(step: int, *, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Factor applied to the peak learning rate for 0-based optimizer step `step` (see the module docstring)."""
    if kind not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {kind!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def learning_rate(step: int, *, peak_lr: float, kind: str, warmup_steps: int, total_steps: int) -> float:
    return peak_lr * lr_multiplier(step, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps)
