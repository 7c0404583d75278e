"""Single-device model code shared by the trainer and the rollout (same numerics on both paths).

One folder per model family; this package-level API loads, saves and inspects Hugging Face-format directories.
Names are imported on first use: config-level modules (model_dir.py, each family's args.py, lora_targets.py) need no
torch, so a service that only inspects model directories (the scheduler) never loads it.
"""

_EXPORTS = {"CausalLM": "models.llama", "KVCache": "models.llama", "ModelArgs": "models.llama",
            "ModelDirError": "models.model_dir", "ModelInfo": "models.model_dir", "inspect_model_dir": "models.model_dir",
            "load_pretrained": "models.checkpoint", "save_pretrained": "models.checkpoint"}
_SUBMODULES = ()


def __getattr__(name: str):
    """Import on first use, so that reading a config (args) never imports torch."""
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted([*_EXPORTS, *_SUBMODULES])
