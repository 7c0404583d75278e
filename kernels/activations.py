"""Activations with a leaner backward: SwiGLU's gating, silu(gate) * up, keeping only its inputs.

Autograd would also keep silu(gate) ([tokens, intermediate], as large as gate itself) until backward; here backward
recomputes it (one elementwise pass) and otherwise runs the same ops autograd would: d_up = g * silu(gate),
d_gate = silu_backward(g * up, gate). Forward is plain F.silu(gate) * up, so deterministic mode's silu applies.
"""
import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(g * up, gate), g * F.silu(gate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)
