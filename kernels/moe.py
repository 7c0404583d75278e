"""Mixture-of-experts ops: token permutation by expert and grouped expert GEMMs (pure torch).

Shapes: N tokens, K experts per token (top-k), M = N * K routed rows, E experts, D input features, F output features.

A MoE layer routes each token to K experts. `permute` copies every (token, expert) assignment into one row of a
[M, D] matrix grouped by expert (expert 0's rows first, then expert 1's, ...; inside an expert the assignments keep
their flat order n * K + k), `grouped_mm` multiplies each expert's contiguous block of rows by that expert's weight,
and `unpermute` puts the rows back in assignment order and sums each token's K rows weighted by its gate weights.

grouped_mm backends:
- "loop": the reference, a Python loop over experts with one plain matmul (F.linear for layout "EFD") each. Needs
  the per-expert counts on the host, so it syncs once per call (`.tolist()`).
- "grouped": `torch._grouped_mm` with int32 offsets, no host sync. On this torch build (2.13, CPU) it runs forward
  and backward for float32, bfloat16 and float16 and gives the loop's numbers bitwise in our tests; it rejects
  float64, and its backward fails on a non-contiguous incoming gradient (e.g. the expanded gradient of `.sum()`), so
  the output goes through `_ContiguousGrad`. On CUDA, torch documents it for bfloat16 on compute capability >= 8.0
  (not exercised here: no GPU in CI).
- "auto": "grouped" where `grouped_mm_supported` says it runs, else "loop". An explicit "grouped" on an unsupported
  dtype/device raises instead of silently running the loop. TRAINYARD_GROUPED_MM_BACKEND forces one process-wide
  (kernels/backends.py), like every op.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backends import env_var, requested_backend

GROUPED_MM_BACKENDS = ("auto", "loop", "grouped")
WEIGHT_LAYOUTS = ("EDF", "EFD")
_GROUPED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUPED_CUDA_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class PermState:
    """What `unpermute` needs to undo `permute`.

    order_M: int64, permuted row m holds flat assignment order_M[m] (= n * K + k); inverse_M: its inverse
    permutation; counts_E: int64 rows per expert (zeros for experts that received no token)."""

    order_M: torch.Tensor
    inverse_M: torch.Tensor
    counts_E: torch.Tensor
    num_tokens: int
    top_k: int


def permute(
    tokens_ND: torch.Tensor, expert_ids_NK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, PermState]:
    """Rows of tokens_ND repeated once per assignment and grouped by expert id (stable), plus the state to undo it.

    expert_ids_NK may be any integer dtype (router replay stores uint8/int16)."""
    N, K = expert_ids_NK.shape
    assert tokens_ND.shape[0] == N, (tokens_ND.shape, expert_ids_NK.shape)
    flat_ids_M = expert_ids_NK.reshape(-1).to(torch.int64)
    order_M = torch.sort(flat_ids_M, stable=True).indices
    inverse_M = torch.empty_like(order_M)
    inverse_M[order_M] = torch.arange(order_M.numel(), device=order_M.device)
    # scatter_add rather than bincount: CUDA's bincount reads min/max back to the host (two syncs per MoE layer).
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids_M.device).scatter_add_(
        0, flat_ids_M, torch.ones_like(flat_ids_M))
    permuted_MD = tokens_ND[order_M // K]
    return permuted_MD, PermState(order_M, inverse_M, counts_E, N, K)


def unpermute(expert_out_MD: torch.Tensor, weights_NK: torch.Tensor, state: PermState) -> torch.Tensor:
    """out[n] = sum_k weights[n, k] * expert_out[row of assignment (n, k)], as [N, D] in expert_out's dtype.

    The product is taken in the promoted dtype of the two inputs (bf16 activations times float32 gate weights
    multiply in float32) and the K rows are summed with one reduction, as transformers' grouped_mm experts do; with
    unit weights and K = 1 this is a bitwise identity."""
    weighted_MD = expert_out_MD * weights_NK.reshape(-1)[state.order_M, None]
    D = expert_out_MD.shape[-1]
    out_ND = weighted_MD[state.inverse_M].view(state.num_tokens, state.top_k, D).sum(dim=1)
    return out_ND.to(expert_out_MD.dtype)


def grouped_mm_supported(x_MD: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the "grouped" backend (torch._grouped_mm) runs for these operands on this build and device.

    torch._grouped_mm also needs every non-unit stride of both operands to be a multiple of 16 bytes ("strides
    should be multiple of 16 bytes"), e.g. a LoRA rank of 2 in float32 or of 4 in bfloat16 as the inner dimension."""
    if not hasattr(torch, "_grouped_mm") or x_MD.dtype != w.dtype or x_MD.device != w.device:
        return False
    if not all(s == 1 or s * t.element_size() % 16 == 0 for t in (x_MD, w) for s in t.stride()):
        return False
    if w.device.type == "cpu":
        return w.dtype in _GROUPED_CPU_DTYPES
    if w.device.type == "cuda":
        return w.dtype in _GROUPED_CUDA_DTYPES and torch.cuda.get_device_capability(w.device) >= (8, 0)
    return False


def grouped_mm(
    x_MD: torch.Tensor, w: torch.Tensor, counts_E: torch.Tensor, *, layout: str = "EDF", backend: str = "auto"
) -> torch.Tensor:
    """Per-expert matmul over contiguous row blocks: rows counts_E[:e].sum() .. + counts_E[e] of x_MD times expert e.

    layout "EDF": w is [E, D, F] and a block computes x @ w[e]; layout "EFD": w is [E, F, D] (nn.Linear / Hugging
    Face storage) and a block computes x @ w[e].T. Returns [M, F]; counts_E must sum to M."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"grouped_mm layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    backend = requested_backend("grouped_mm", backend, tuple(b for b in GROUPED_MM_BACKENDS if b != "auto"))
    assert w.dim() == 3 and counts_E.shape == (w.shape[0],), (w.shape, counts_E.shape)
    if x_MD.shape[0] == 0:
        # No rows (an expert-parallel rank whose experts received no token): an empty product rather than none, so
        # the weight gets a zero gradient as on every other rank (torch._grouped_mm's backward rejects M = 0).
        return F.linear(x_MD, w[0]) if layout == "EFD" else x_MD @ w[0]
    if backend == "auto":
        backend = "grouped" if grouped_mm_supported(x_MD, w) else "loop"
    if backend == "grouped":
        if not grouped_mm_supported(x_MD, w):
            raise ValueError(
                f"grouped_mm backend 'grouped' (torch._grouped_mm) does not support {x_MD.dtype} x {w.dtype} on "
                f"{w.device.type}; use backend='auto' or 'loop' (or unset {env_var('grouped_mm')})"
            )
        w_EDF = w if layout == "EDF" else w.transpose(-2, -1)
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x_MD, w_EDF, offs=offsets_E))
    return _loop_mm(x_MD, w, counts_E, layout)


def _loop_mm(x_MD: torch.Tensor, w: torch.Tensor, counts_E: torch.Tensor, layout: str) -> torch.Tensor:
    outs, start = [], 0
    for e, count in enumerate(counts_E.tolist()):  # .tolist() syncs
        if count == 0:
            continue
        block = x_MD[start : start + count]
        outs.append(F.linear(block, w[e]) if layout == "EFD" else block @ w[e])
        start += count
    return torch.cat(outs)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's CPU backward rejects stride-0
    gradients ("Invalid strides/sizes")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
