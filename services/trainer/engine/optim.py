"""The engine's optimizer: AdamW over the trainable parameters, and the one optimizer step every trainer path takes
(set the hyperparameters, clip or measure the gradient norm, step, clear the gradients)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class AdamW:
    """AdamW hyperparameters of one step. grad_clip_norm 0: no clipping (the norm is still measured)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def make_optimizer(params: list[nn.Parameter], settings: AdamW) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=settings.learning_rate, betas=(settings.beta1, settings.beta2),
                             eps=settings.eps, weight_decay=settings.weight_decay)


def optimizer_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, settings: AdamW) -> torch.Tensor:
    """Apply the accumulated gradients with these settings and clear them; returns the gradient norm before any
    clipping (a 0-dim tensor: no device sync here)."""
    for group in optimizer.param_groups:
        group.update(lr=settings.learning_rate, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                     weight_decay=settings.weight_decay)
    if settings.grad_clip_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip_norm)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
