"""The engine's optimizer: AdamW over the trainable parameters, and the one optimizer step every trainer path takes
(measure the gradient norm, refuse a non-finite one, set the hyperparameters, clip, step, clear the gradients)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


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


class NonFiniteGradient(ValueError):
    """The accumulated gradients' norm is NaN or infinite (e.g. a loss overflowed): nothing was applied, the
    gradients were cleared, and the weights and the optimizer state are as they were."""

    def __init__(self, norm: float):
        super().__init__(f"the gradient norm is {norm}: the step was not applied and the gradients were cleared")
        self.norm = norm


def optimizer_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, settings: AdamW, *,
                   split_over: dict | None = None, sum_over=None, uncounted: frozenset[int] = frozenset()
                   ) -> torch.Tensor:
    """Apply the accumulated gradients with these settings and clear them; returns the gradient norm before any
    clipping (a 0-dim tensor). A NaN or infinite norm would turn every weight it reaches into NaN (clipping
    included, which scales by max_norm / norm): then nothing is applied, the gradients are cleared and
    NonFiniteGradient raised, the weights and the optimizer's state and hyperparameters untouched.
    split_over, sum_over: see total_norm (with sum_over every rank of the group calls it, whatever gradients it
    has). uncounted: ids of parameters left out of the norm (still clipped and stepped): a second copy of a weight
    the norm already counts (a pipeline's tied lm_head, pipeline.py)."""
    grads = [p.grad for p in params if p.grad is not None and id(p) not in uncounted]
    norm = total_norm(grads, split_over, sum_over) if grads or sum_over is not None else torch.zeros(())
    if not torch.isfinite(norm):  # syncs: once per optimizer step, so that inf/NaN is never applied
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradient(float(norm))
    for group in optimizer.param_groups:
        group.update(lr=settings.learning_rate, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                     weight_decay=settings.weight_decay)
    if settings.grad_clip_norm > 0:  # clip_grad_norm_'s own two halves, the norm measured once; by mesh, as a
        for group in _by_mesh([p for p in params if p.grad is not None], lambda p: p.grad).values():  # DTensor op
            torch.nn.utils.clip_grads_with_norm_(group, settings.grad_clip_norm, norm)  # takes one mesh
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _by_mesh(items: list, tensor_of=lambda t: t) -> dict:
    """items grouped by their tensor's DeviceMesh (None: plain tensors), in their order (the same on every rank)."""
    groups: dict = {}
    for item in items:
        t = tensor_of(item)
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(item)
    return groups


def total_norm(grads: list[torch.Tensor], split_over: dict | None = None, sum_over=None) -> torch.Tensor:
    """The L2 norm of all the gradients together (0-dim, a plain tensor). Sharded gradients (DTensors: FSDP's, or
    experts sharded over another mesh) count whole: each mesh's group of them is normed as a DTensor (partial sums
    of squares) and made whole with full_tensor() (an all-reduce over that mesh), so every rank gets the same, global
    norm, the one the unsharded gradients have. split_over {mesh: process group}: a mesh whose gradients are, beyond
    it, different tensors on the group's ranks (expert parallelism: each ep rank holds other experts), so their
    squares are summed over that group too. sum_over: a process group whose ranks hold different parameters
    altogether (pipeline parallelism: each pp rank its stages), over which the squares of everything are summed
    last. Plain tensors take torch's own path (the single-process engine's, unchanged)."""
    if not any(isinstance(g, DTensor) for g in grads):
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if sum_over is None:
            return norm
        square = norm.square()
        dist.all_reduce(square, group=sum_over)
        return square.sqrt()
    squares = []
    for mesh, group in _by_mesh(grads).items():
        norm = torch.nn.utils.get_total_norm(group)
        square = (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
        if split_over and mesh in split_over:
            dist.all_reduce(square, group=split_over[mesh])
        squares.append(square)
    square = torch.stack(squares).sum()
    if sum_over is not None:
        dist.all_reduce(square, group=sum_over)
    return square.sqrt()
