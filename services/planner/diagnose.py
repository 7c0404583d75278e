"""What a run's metrics say, in words: overfitting, divergence, no learning. Shown next to a job (the dashboard's
Jobs page, the CLI) and used by the Training Agent to rule out sweep variants.

Rules (each stated in the message it produces):
- overfitting: the held-out loss ended at least 2% above its lowest value while the training loss kept falling
  (by at least 10%) after that point;
- divergence: a non-finite loss, or a final training loss above 1.5 x the first;
- no learning: after at least 20 steps the training loss (mean of the last 10% of steps) is within 3% of the first
  steps' (mean of the first 10%).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

OVERFIT_RISE = 0.02
DIVERGE_FACTOR = 1.5
NO_LEARNING_MIN_STEPS = 20
NO_LEARNING_DROP = 0.03


class Point(Protocol):  # trainyard.v1.scheduler_pb2.MetricPoint
    step: int
    values: dict


@dataclass
class Diagnosis:
    problems: list[str] = field(default_factory=list)  # short names: "overfitting", "diverging", "not learning"
    messages: list[str] = field(default_factory=list)  # one sentence each, with the numbers
    final_train_loss: float | None = None
    final_eval_loss: float | None = None
    best_eval_loss: float | None = None
    best_eval_step: int | None = None


def diagnose(points: Iterable[Point], train_key: str = "train/loss", eval_key: str = "eval/loss") -> Diagnosis:
    points = list(points)
    train = [(p.step, p.values[train_key]) for p in points if train_key in p.values]
    evals = [(p.step, p.values[eval_key]) for p in points if eval_key in p.values]
    d = Diagnosis()
    if train:
        d.final_train_loss = train[-1][1]
    if evals:
        d.final_eval_loss = evals[-1][1]
        d.best_eval_step, d.best_eval_loss = min(evals, key=lambda e: e[1])
    bad = [(s, v) for s, v in train + evals if not math.isfinite(v)]
    if bad:
        d.problems.append("diverging")
        d.messages.append(f"the loss is {bad[0][1]} at step {bad[0][0]}: lower the learning rate")
        return d
    if len(train) >= 2 and train[-1][1] > DIVERGE_FACTOR * train[0][1]:
        d.problems.append("diverging")
        d.messages.append(f"the training loss rose from {train[0][1]:.4f} to {train[-1][1]:.4f}: lower the "
                          "learning rate")
    if evals and len(evals) >= 2 and d.best_eval_loss is not None and d.best_eval_loss > 0:
        rise = d.final_eval_loss / d.best_eval_loss - 1
        since = [v for s, v in train if s >= d.best_eval_step]
        train_fell = len(since) >= 2 and since[-1] < 0.9 * since[0]
        if rise >= OVERFIT_RISE and train_fell:
            d.problems.append("overfitting")
            d.messages.append(
                f"the held-out loss rose {rise:.0%} from its best, {d.best_eval_loss:.4f} at step {d.best_eval_step}, "
                f"to {d.final_eval_loss:.4f} while the training loss fell to {train[-1][1]:.4f}: deploy the "
                f"checkpoint nearest step {d.best_eval_step}, or train fewer steps / on more rows")
    if len(train) >= NO_LEARNING_MIN_STEPS:
        k = max(1, len(train) // 10)
        first = sum(v for _, v in train[:k]) / k
        last = sum(v for _, v in train[-k:]) / k
        if first > 0 and last > (1 - NO_LEARNING_DROP) * first:
            d.problems.append("not learning")
            d.messages.append(f"the training loss barely moved ({first:.4f} -> {last:.4f} over {len(train)} steps): "
                              "raise the learning rate or train longer")
    return d
