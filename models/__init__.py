"""Single-device model code shared by the trainer and the rollout (same numerics on both paths).

One folder per model family; this package-level API loads, saves and inspects Hugging Face-format directories.
"""

from models.checkpoint import ModelDirError, ModelInfo, inspect_model_dir, load_pretrained, save_pretrained
from models.llama import CausalLM, KVCache, ModelArgs

__all__ = [
    "CausalLM", "KVCache", "ModelArgs", "ModelDirError", "ModelInfo", "inspect_model_dir", "load_pretrained",
    "save_pretrained",
]
