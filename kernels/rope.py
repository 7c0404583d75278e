"""Rotary position embeddings (RoPE), HF-compatible, including YaRN.

Shapes: B batch, T tokens, H heads, K kv heads, D head_dim (the rotated size), F = D // 2 frequencies.

The inverse frequencies are always computed in float32 from the config (never stored as a module buffer, so casting
a model to bf16 cannot round them), and cos/sin are built in float32 then cast to the activation dtype, matching
transformers' LlamaRotaryEmbedding. Only the rope types whose numerics we test are accepted; anything else raises
instead of silently running plain RoPE on a model trained with a different scheme.

Two entry points, because YaRN changes more than the frequencies:
- `rope_inv_freq` serves the types that only rescale frequencies (SUPPORTED_ROPE_TYPES: default, llama3).
- `rope_frequencies` also returns the attention factor that YaRN multiplies into cos/sin (transformers'
  `attention_scaling`); pass it to `rope_cos_sin`. A caller of `rope_inv_freq` would drop that factor, so
  `rope_inv_freq` refuses yarn rather than return half of its definition.
"""

import math

import torch

from kernels.rope_config import ROPE_TYPES_WITH_ATTENTION_FACTOR, SUPPORTED_ROPE_TYPES, rope_type_of, yarn_mscale


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [F] in float32 for `rope_theta` and an HF `rope_scaling` dict (None = plain RoPE)."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        hint = " (yarn also scales cos/sin: use rope_frequencies, which returns its attention factor)"
        raise ValueError(
            f"Unsupported rope_scaling type {rope_type!r}; supported types are {', '.join(SUPPORTED_ROPE_TYPES)}"
            + (hint if rope_type == "yarn" else "")
        )
    inv_freq_F, _ = rope_frequencies(head_dim, rope_theta, rope_scaling)
    return inv_freq_F


def rope_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [F] in float32, attention factor for cos/sin), as transformers' ROPE_INIT_FUNCTIONS
    return them, for the types in ROPE_TYPES_WITH_ATTENTION_FACTOR."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in ROPE_TYPES_WITH_ATTENTION_FACTOR:
        raise ValueError(
            f"Unsupported rope_scaling type {rope_type!r}; supported types are "
            f"{', '.join(ROPE_TYPES_WITH_ATTENTION_FACTOR)}"
        )
    if rope_type == "yarn":
        return _yarn(head_dim, rope_theta, rope_scaling)
    exponents_F = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq_F = 1.0 / (rope_theta**exponents_F)
    if rope_type == "llama3":
        inv_freq_F = _llama3_scale(inv_freq_F, rope_scaling)
    return inv_freq_F, 1.0


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


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """The factor transformers multiplies into cos/sin (`attention_scaling`): YaRN's explicit attention_factor, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor); 1.0 for the
    other types. Needs no tensors, so a model can read it while being built on the meta device."""
    if rope_type_of(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return rope_scaling["attention_factor"]
    factor = rope_scaling["factor"]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def _yarn(head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies that rotate more than beta_fast times over the original context keep
    their value, those below beta_slow are divided by `factor`, a linear ramp blends the band in between.

    Same arithmetic, in the same order and precision, as transformers' _compute_yarn_parameters."""
    try:
        factor = scaling["factor"]
        original_max_position_embeddings = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"rope_scaling of type 'yarn' is missing the field {e.args[0]!r}") from None
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):  # a config.json value: ValueError
        raise ValueError(f"rope_scaling of type 'yarn' needs a numeric 'factor', got {factor!r}")  # noqa: TRY004
    attention_factor = rope_attention_factor(scaling)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    dim = head_dim

    def correction_dim(num_rotations: float) -> float:
        """The dimension whose frequency turns `num_rotations` times over the original context."""
        return (dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp_F = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs_F = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation_F = 1.0 / pos_freqs_F
    inv_freq_interpolation_F = 1.0 / (factor * pos_freqs_F)
    extrapolation_factor_F = 1 - ramp_F
    inv_freq_F = (
        inv_freq_interpolation_F * (1 - extrapolation_factor_F) + inv_freq_extrapolation_F * extrapolation_factor_F
    )
    return inv_freq_F, attention_factor


def rope_cos_sin(
    positions_BT: torch.Tensor, inv_freq_F: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] for integer positions, computed in float32 (times `attention_factor`, YaRN's magnitude
    correction) and cast to `dtype`."""
    inv_freq_F = inv_freq_F.to(device=positions_BT.device, dtype=torch.float32)
    freqs_BTF = positions_BT[..., None].to(torch.float32) * inv_freq_F
    emb_BTD = torch.cat((freqs_BTF, freqs_BTF), dim=-1)
    cos_BTD, sin_BTD = emb_BTD.cos(), emb_BTD.sin()
    if attention_factor != 1.0:
        cos_BTD, sin_BTD = cos_BTD * attention_factor, sin_BTD * attention_factor
    return cos_BTD.to(dtype), sin_BTD.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_transposed(y: torch.Tensor) -> torch.Tensor:
    """The adjoint of _rotate_half: (y1, y2) -> (y2, -y1)."""
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


class _HalfRotary(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin, with its backward written out: g * cos + rotate_half^T(g * sin). Autograd's
    own would route the gradient through the halves' slices (zero-filled full-size buffers and copies per slice);
    this computes the same sums, so the gradients are the same bits."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return g * cos + _rotate_half_transposed(g * sin), None, None


def apply_rotary(
    q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B,H,T,D] and k [B,K,T,D] with the half-split (GPT-NeoX / HF) layout."""
    cos_B1TD = cos_BTD.unsqueeze(1)
    sin_B1TD = sin_BTD.unsqueeze(1)
    return _HalfRotary.apply(q_BHTD, cos_B1TD, sin_B1TD), _HalfRotary.apply(k_BKTD, cos_B1TD, sin_B1TD)


def apply_rotary_interleaved(
    q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the interleaved pairs (x0, x1), (x2, x3), ... of q and k (DeepSeek's checkpoint layout, HF's
    rope_interleave=True), each pair by one frequency.

    The result comes out de-interleaved (all rotated first elements, then all second ones), exactly as transformers'
    apply_rotary_pos_emb_interleave writes it; q and k share the permutation, so q.k is unchanged by it, and cached
    keys must stay in this layout."""
    cos_B1TF = cos_BTD[..., : cos_BTD.shape[-1] // 2].unsqueeze(1)
    sin_B1TF = sin_BTD[..., : sin_BTD.shape[-1] // 2].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos_B1TF - x2 * sin_B1TF, x2 * cos_B1TF + x1 * sin_B1TF], dim=-1)

    return rotate(q_BHTD), rotate(k_BKTD)
