"""The logprobs the trainer computes for given tokens: one forward, log_softmax in float32, gather.

The rollout (services/rollout/runner.py) computes a sampled token's logprob the same way, so with deterministic=True
(kernels.batch_invariant: batch-invariant GEMMs, attention, activations) a sequence's logprobs here are bitwise the
rollout's deterministic-mode logprobs for it, whatever else either side batched it with (fp32 on CPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.batch_invariant import batch_invariant_mode


def target_logprobs(model: torch.nn.Module, tokens_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                    deterministic: bool = False) -> torch.Tensor:
    """logprobs_BT[b, t] = log p(targets[b, t] | tokens[b, :t + 1]) under the model's raw distribution."""
    with batch_invariant_mode(enabled=deterministic):
        logits_BTV = model(tokens_BT).float()
        return torch.gather(F.log_softmax(logits_BTV, dim=-1), -1, targets_BT.unsqueeze(-1)).squeeze(-1)
