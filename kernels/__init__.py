"""Ops shared by the trainer and the rollout.

Each op here has a pure-torch reference; faster backends (flash-attn, triton, ...) are selected behind these same
names and checked against the references, so callers never import a backend directly. kernels/backends.py holds the
selection rule (a `backend=` argument, else TRAINYARD_<OP>_BACKEND, else "auto"); docs/kernels.md describes the
backends and their accuracy bounds.
"""

from trainyard.lazy import lazy_exports

_EXPORTS = {
    "ATTENTION_BACKENDS": "kernels.attention", "Packing": "kernels.attention",
    "chunked_logprobs": "kernels.logprobs", "default_chunk_size": "kernels.logprobs",
    "logprobs_reference": "kernels.logprobs", "PermState": "kernels.moe", "grouped_mm": "kernels.moe",
    "grouped_mm_supported": "kernels.moe", "permute": "kernels.moe", "unpermute": "kernels.moe",
    "rms_norm": "kernels.norm", "SUPPORTED_ROPE_TYPES": "kernels.rope_config", "apply_rotary": "kernels.rope",
    "rope_cos_sin": "kernels.rope", "rope_inv_freq": "kernels.rope", "swiglu": "kernels.activations",
}


# The attention op is `kernels.attention.attention`: `kernels.attention` is its module (a lazy package cannot also
# bind the name to the function).

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
