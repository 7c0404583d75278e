"""The dense family's layers (Llama 3, Qwen2, Qwen3): models.common's grouped-query attention (Qwen3: with q/k
RMSNorm) and SwiGLU MLP in every layer; plain or llama3-scaled RoPE over the whole head_dim."""

import torch

from kernels import rope_inv_freq
from models.common.blocks import MLP, Attention, DecoderLayer


def decoder_layer(args, layer_idx: int) -> DecoderLayer:
    return DecoderLayer(Attention(args, layer_idx), MLP(args), args.hidden_size, args.rms_norm_eps)


def rope(args) -> tuple[torch.Tensor, float]:
    """Also Qwen3-MoE's. These rope types only rescale frequencies, so the attention factor is 1."""
    return rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), 1.0
