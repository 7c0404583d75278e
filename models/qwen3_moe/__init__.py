"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention + softmax-routed experts (models.moe)."""

_EXPORTS = {"SUPPORTED_ARCHITECTURES": "models.qwen3_moe.args", "ModelArgs": "models.qwen3_moe.args", "CausalLM": "models.qwen3_moe.model",
            "KVCache": "models.kv_cache"}
_SUBMODULES = ("args", "model", "state_dict_adapter")


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
