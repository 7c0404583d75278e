"""Ops shared by the trainer and the rollout.

Each op here has a pure-torch reference; faster backends (flash-attn, triton, ...) are selected behind these same
names and checked against the references, so callers never import a backend directly. kernels/backends.py holds the
selection rule (a `backend=` argument, else TRAINYARD_<OP>_BACKEND, else "auto"); docs/kernels.md describes the
backends and their accuracy bounds.
"""

from kernels.attention import ATTENTION_BACKENDS, Packing, attention
from kernels.logprobs import chunked_logprobs, default_chunk_size, logprobs_reference
from kernels.moe import PermState, grouped_mm, grouped_mm_supported, permute, unpermute
from kernels.norm import rms_norm
from kernels.rope import SUPPORTED_ROPE_TYPES, apply_rotary, rope_cos_sin, rope_inv_freq

__all__ = [
    "ATTENTION_BACKENDS",
    "SUPPORTED_ROPE_TYPES",
    "Packing",
    "PermState",
    "apply_rotary",
    "attention",
    "chunked_logprobs",
    "default_chunk_size",
    "grouped_mm",
    "grouped_mm_supported",
    "logprobs_reference",
    "permute",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "unpermute",
]
