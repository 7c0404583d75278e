"""Rotary position embeddings (RoPE), HF-compatible.

Shapes: B batch, T tokens, H heads, D head_dim (the rotated size), F = D // 2 frequencies.

The inverse frequencies are always computed in float32 from the config (never stored as a module buffer, so casting
a model to bf16 cannot round them), and cos/sin are built in float32 then cast to the activation dtype, matching
transformers' LlamaRotaryEmbedding. Only the rope types whose numerics we test are accepted; anything else raises
instead of silently running plain RoPE on a model trained with a different scheme.
"""

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [F] in float32 for `rope_theta` and an HF `rope_scaling` dict (None = plain RoPE)."""
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope_scaling type {rope_type!r}; supported types are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents_F = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq_F = 1.0 / (rope_theta**exponents_F)
    if rope_type == "llama3":
        inv_freq_F = _llama3_scale(inv_freq_F, rope_scaling)
    return inv_freq_F


def _llama3_scale(inv_freq_F: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent interpolation: long wavelengths divided by `factor`, short ones kept, smooth
    blend in between (same formula as transformers' _compute_llama3_parameters)."""
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"rope_scaling of type 'llama3' is missing the field {e.args[0]!r}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen_F = 2 * math.pi / inv_freq_F
    scaled_F = torch.where(wavelen_F > low_freq_wavelen, inv_freq_F / factor, inv_freq_F)
    smooth_F = (old_context_len / wavelen_F - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_F = (1 - smooth_F) * scaled_F / factor + smooth_F * scaled_F
    is_medium_F = ~(wavelen_F < high_freq_wavelen) * ~(wavelen_F > low_freq_wavelen)
    return torch.where(is_medium_F, smoothed_F, scaled_F)


def rope_cos_sin(
    positions_BT: torch.Tensor, inv_freq_F: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] for integer positions, computed in float32 and cast to `dtype`."""
    inv_freq_F = inv_freq_F.to(device=positions_BT.device, dtype=torch.float32)
    freqs_BTF = positions_BT[..., None].to(torch.float32) * inv_freq_F
    emb_BTD = torch.cat((freqs_BTF, freqs_BTF), dim=-1)
    return emb_BTD.cos().to(dtype), emb_BTD.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B,H,T,D] and k [B,K,T,D] with the half-split (GPT-NeoX / HF) layout."""
    cos_B1TD = cos_BTD.unsqueeze(1)
    sin_B1TD = sin_BTD.unsqueeze(1)
    q_out = (q_BHTD * cos_B1TD) + (_rotate_half(q_BHTD) * sin_B1TD)
    k_out = (k_BKTD * cos_B1TD) + (_rotate_half(k_BKTD) * sin_B1TD)
    return q_out, k_out
