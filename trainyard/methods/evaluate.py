"""Evaluation jobs: score a checkpoint (or the base model) on a held-out set with an uploaded evaluator; settings
declared once (see trainyard.methods.spec).

The worker's recipe (services/worker/recipes/evaluate.py) samples samples_per_row completions per row with the
rollout engine and scores each with the account's evaluator in its sandbox. Metrics: eval/reward_mean (over every
scored completion), eval/pass@1 and eval/pass@k (the unbiased estimator over rows, a completion passing when its
reward >= pass_threshold), eval/errors (completions the evaluator could not score); per-row results are kept
(docs/evaluation.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.methods.spec import setting


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate, with what, and how completions are sampled."""

    evaluator: str = setting(
        "", label="Evaluator", help="The evaluator to score completions with: its name, or name@version")
    checkpoint_id: str = setting(
        "", label="Checkpoint", flag="--checkpoint",
        help="The checkpoint to evaluate (one of the base model's); empty: the base model itself")
    samples_per_row: int = setting(
        4, label="Samples per row (k)", flag="--k", aliases=("--samples-per-row",), ge=1, le=64, unit="completions",
        help="Completions sampled per row: pass@k is over these")
    temperature: float = setting(1.0, label="Temperature", ge=0, le=2, help="Sampling temperature (0: greedy)")
    max_tokens: int = setting(128, label="Max tokens", ge=1, le=8192, unit="tokens",
                              help="Tokens sampled per completion at most")
    pass_threshold: float = setting(
        1.0, label="Pass threshold", help="A completion passes when its reward is at least this")
    max_rows: int | None = setting(
        None, label="Max rows", ge=1, le=1_000_000, unit="rows", help="Rows evaluated at most (the first ones); "
                                                                      "unset: every row")
    sampling_seed: int = setting(0, label="Sampling seed", proto="seed", advanced=True,
                                 help="Seed of the sampling: the same seed samples the same completions")
