"""Ops shared by the trainer and the rollout.

Each op here is the pure-torch reference; faster backends (flash-attn, triton, ...) are to be selected behind these
same names and checked against these references, so callers never import a backend directly.
"""

from kernels.attention import Packing, attention
from kernels.norm import rms_norm
from kernels.rope import SUPPORTED_ROPE_TYPES, apply_rotary, rope_cos_sin, rope_inv_freq

__all__ = ["Packing", "SUPPORTED_ROPE_TYPES", "apply_rotary", "attention", "rms_norm", "rope_cos_sin", "rope_inv_freq"]
