"""RMSNorm reference.

The statistics are computed in float32 and the result is cast back before the weight multiply, exactly as Hugging
Face's LlamaRMSNorm/Qwen3RMSNorm do, so bf16 checkpoints give the same numbers on our path and on theirs.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), normalising over the last dimension."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)
