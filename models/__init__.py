"""Single-device model code shared by the trainer and the rollout (same numerics on both paths).

One folder per model family; this package-level API loads, saves and inspects Hugging Face-format directories.
Names are imported on first use: config-level modules (model_dir.py, each family's args.py, lora_targets.py) need no
torch, so a service that only inspects model directories (the scheduler) never loads it.
"""

from trainyard.lazy import lazy_exports

_EXPORTS = {"CausalLM": "models.common", "KVCache": "models.kv_cache", "ModelArgs": "models.llama",
            "ModelDirError": "models.model_dir", "ModelInfo": "models.model_dir",
            "inspect_model_dir": "models.model_dir", "load_pretrained": "models.checkpoint",
            "save_pretrained": "models.checkpoint"}

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
