"""Frozen expert weights in 4 bits: block-scaled NF4 or symmetric int4, dequantized one expert at a time.

Shapes: E experts, F output features, D input features, M routed rows (kernels/moe.py), B block size, G = D / B.

Format (docs/quant4.md has the byte-level description):
- A weight [E, F, D] in nn.Linear / Hugging Face storage order (F rows of D inputs per expert) is cut into blocks of
  B consecutive input features (B = 32 or 64, must divide D). Each block keeps one scale, its absmax rounded to
  bfloat16, and each value the index (0..15) of the nearest codebook entry to value / scale (ties to the lower
  index); values are rebuilt as codebook[index] * scale in float32, then cast to the compute dtype.
- Codebooks: "nf4" is QLoRA's NormalFloat4 (16 quantiles of a standard normal scaled to [-1, 1], 0 exact); "int4"
  is symmetric integer (index - 8) / 7 (index 0 = -8/7 is never produced, so 15 levels are used).
- packed: uint8 [E, F, D / 2]; byte j of a row holds input feature 2j in its LOW nibble and 2j + 1 in its HIGH
  nibble. scales: [E, F, G] bfloat16 bit patterns held in an int16 buffer (so `model.to(dtype)` leaves them alone).
  Bits per weight: 4 + 16 / B (4.25 at B = 64, 4.5 at B = 32), against 16 for bfloat16.

`quant4_grouped_mm` is kernels.moe.grouped_mm (layout "EFD") over such a weight: a loop over the experts that
received rows, dequantizing one expert, multiplying, and dropping it before the next, so the extra memory at any
time is one expert's temporaries: an int32 index (2 bytes per weight), the float32 values (4) and, for a bf16/fp16
compute dtype, the cast copy (2), so at most 8 bytes per weight of ONE expert. Backward recomputes each expert's
weight the same way (nothing but the packed buffers is saved) and returns the input gradient only: the packed weight
is frozen.
"""

import torch
import torch.nn.functional as F
from torch import nn

FORMATS = ("nf4", "int4")
BLOCK_SIZES = (32, 64)
_CODEBOOKS = {
    # bitsandbytes' / QLoRA's NF4 table (float32 values as published).
    "nf4": (
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ),
    "int4": tuple((i - 8) / 7 for i in range(16)),
}
_PAIR_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def codebook(fmt: str) -> torch.Tensor:
    """The 16 float32 values a 4-bit index stands for (before the block scale)."""
    if fmt not in FORMATS:
        raise ValueError(f"4-bit format must be one of {FORMATS}, got {fmt!r}")
    return torch.tensor(_CODEBOOKS[fmt], dtype=torch.float32)


def _pair_lut(fmt: str, device: torch.device) -> torch.Tensor:
    """[256, 2] float32: byte b -> (codebook[b & 15], codebook[b >> 4]), so one gather unpacks and decodes a byte."""
    key = (fmt, device)
    if key not in _PAIR_LUTS:
        table = codebook(fmt)
        byte = torch.arange(256)
        _PAIR_LUTS[key] = torch.stack([table[byte & 15], table[byte >> 4]], dim=-1).to(device)
    return _PAIR_LUTS[key]


def quantize_4bit(w_FD: torch.Tensor, fmt: str = "nf4", block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., D/2], scales int16 [..., D/B] holding bfloat16 bits) for a weight [..., D]."""
    table = codebook(fmt)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"4-bit block_size must be one of {BLOCK_SIZES}, got {block_size}")
    D = w_FD.shape[-1]
    if D % block_size:
        raise ValueError(
            f"4-bit block_size={block_size} must divide the input dimension {D}; pick one of {BLOCK_SIZES} that does"
        )
    blocks = w_FD.detach().to(torch.float32).reshape(*w_FD.shape[:-1], D // block_size, block_size)
    scales = blocks.abs().amax(dim=-1).to(torch.bfloat16)
    # Quantize against the scale as stored (bf16-rounded), so codebook[index] * scale is what dequantization returns.
    stored = scales.to(torch.float32).unsqueeze(-1)
    normalized = torch.where(stored > 0, blocks / stored.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    midpoints = ((table[1:] + table[:-1]) / 2).to(w_FD.device)
    index = torch.bucketize(normalized.clamp(-1.0, 1.0), midpoints).to(torch.uint8).reshape(w_FD.shape)
    packed = index[..., 0::2] | (index[..., 1::2] << 4)
    return packed, scales.view(torch.int16)


def dequantize_4bit(packed: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight [..., D] in `dtype` from packed [..., D/2] and scales [..., G] (as quantize_4bit returns them)."""
    # index_select, not lut[packed]: the same gather, ~7x faster than advanced indexing on CPU
    values = _pair_lut(fmt, packed.device).index_select(0, packed.reshape(-1).int())  # [n, 2] float32
    values = values.view(*packed.shape[:-1], scales.shape[-1], -1)
    values.mul_(scales.view(torch.bfloat16).to(torch.float32).unsqueeze(-1))
    return values.view(*packed.shape[:-1], -1).to(dtype)


class Packed4Weight(nn.Module):
    """A frozen [E, F, D] weight stored in 4 bits (buffers `packed` and `scales`, format above); stands in for an
    nn.Parameter of models.moe.Experts after `Experts.quantize_`."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, fmt: str):
        super().__init__()
        assert packed.dtype == torch.uint8 and scales.dtype == torch.int16 and packed.dim() == 3, (packed, scales)
        codebook(fmt)  # validates fmt
        self.fmt = fmt
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @classmethod
    def quantize(cls, w_EFD: torch.Tensor, fmt: str = "nf4", block_size: int = 64) -> "Packed4Weight":
        """Quantize expert by expert, so the float32 temporaries stay the size of one expert."""
        parts = [quantize_4bit(w_EFD[e], fmt, block_size) for e in range(w_EFD.shape[0])]
        return cls(torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts]), fmt)

    @property
    def shape(self) -> torch.Size:
        E, F, half_D = self.packed.shape
        return torch.Size((E, F, 2 * half_D))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def block_size(self) -> int:
        return self.shape[-1] // self.scales.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [F, D] in `dtype`."""
        return dequantize_4bit(self.packed[e], self.scales[e], self.fmt, dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert [E, F, D] in `dtype` (tests and `Experts.dequantize_`; the forward never builds this)."""
        return torch.stack([self.expert(e, dtype) for e in range(self.shape[0])])

    def extra_repr(self) -> str:
        E, F, D = self.shape
        return f"experts={E}, out_features={F}, in_features={D}, fmt={self.fmt!r}, block_size={self.block_size}"


def quant4_grouped_mm(x_MD: torch.Tensor, weight: Packed4Weight, counts_E: torch.Tensor) -> torch.Tensor:
    """grouped_mm(x_MD, dequantized weight, counts_E, layout="EFD") without ever holding more than one expert's
    dequantized weight; [M, F] in x's dtype. Gradient flows to x only."""
    assert counts_E.shape == (weight.shape[0],) and x_MD.shape[-1] == weight.shape[-1], (x_MD.shape, weight.shape)
    return _Quant4GroupedMM.apply(x_MD, weight.packed, weight.scales, counts_E, weight.fmt)


def _expert_blocks(
    x_MX: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str, counts: list[int], transpose: bool
) -> torch.Tensor:
    """Rows of expert e times W_e.T (forward, [M, F]) or times W_e (backward, [M, D]), one expert at a time."""
    out_features = 2 * packed.shape[-1] if transpose else packed.shape[1]
    out = x_MX.new_empty(x_MX.shape[0], out_features)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        w_FD = dequantize_4bit(packed[e], scales[e], fmt, x_MX.dtype)
        rows = slice(start, start + count)
        out[rows] = x_MX[rows] @ w_FD if transpose else F.linear(x_MX[rows], w_FD)
        start += count
    return out


class _Quant4GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, packed, scales, counts_E, fmt):
        counts = counts_E.tolist()  # .tolist() syncs, once per call, as grouped_mm's "loop" backend does
        ctx.save_for_backward(packed, scales)
        ctx.counts, ctx.fmt = counts, fmt
        return _expert_blocks(x_MD, packed, scales, fmt, counts, transpose=False)

    @staticmethod
    def backward(ctx, grad_MF):
        packed, scales = ctx.saved_tensors
        grad_MD = _expert_blocks(grad_MF, packed, scales, ctx.fmt, ctx.counts, transpose=True)
        return grad_MD, None, None, None, None
