"""The RL loop's arithmetic, each piece a plain function the tests check against a naive reference.

Shapes: n = a sample's completion tokens. q = the rollout's sampled logprobs of them, p = the trainer's (the policy
at the version being trained), ref = the base model's.

- group advantages: (r - mean(r)) / (std(r) + 1e-6) over a prompt's group (GRPO and the others), r - mean(r) for
  dr_grpo (Dr. GRPO drops the std); std is the population std.
- dynamic sampling (DAPO): a group whose rewards are all equal carries no signal and is dropped.
- staleness of a sample = the trainer's version - the OLDEST version that produced any of its tokens; a sample with
  staleness > max_staleness is dropped (and counted).
- truncated importance sampling (TIS), for the gap between the rollout's numerics (or an older version) and the
  trainer's: token level w_t = min(exp(p_t - q_t), cap); sequence level w = min(exp(sum_t (p_t - q_t)), cap) for
  every token of the sample. The weights are constants (no gradient).
- k3 KL estimate of KL(a || b) from tokens sampled from a: x = log b - log a, k3 = exp(x) - x - 1 (>= 0, unbiased).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], loss: str) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    if loss == "dr_grpo":
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + STD_EPS) for r in rewards]


def constant(rewards: Sequence[float]) -> bool:
    """All rewards equal: the group carries no signal (dynamic sampling drops it)."""
    return max(rewards) == min(rewards)


def staleness(trainer_version: int, token_versions: Sequence[int]) -> int:
    return trainer_version - min(token_versions)


def tis_weights(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """[n] truncated importance weights of one sample (module docstring); ones when mode is 'off'."""
    if mode == "off":
        return torch.ones_like(rollout_lp)
    log_ratio = (trainer_lp - rollout_lp).double()
    if mode == "token":
        return log_ratio.exp().clamp(max=cap).to(rollout_lp.dtype)
    if mode == "sequence":
        return log_ratio.sum().exp().clamp(max=cap).expand_as(rollout_lp).to(rollout_lp.dtype).clone()
    raise ValueError(f"tis must be off, token or sequence, got {mode!r}")


def k3(sampled_from_lp: torch.Tensor, other_lp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampled_from || other) (module docstring)."""
    x = (other_lp - sampled_from_lp).double()
    return x.exp() - x - 1
