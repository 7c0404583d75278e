"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention + softmax-routed experts (models.moe)."""

from trainyard.lazy import lazy_exports

_EXPORTS = {"SUPPORTED_ARCHITECTURES": "models.qwen3_moe.args", "ModelArgs": "models.qwen3_moe.args",
            "CausalLM": "models.common.decoder", "KVCache": "models.kv_cache"}
_SUBMODULES = ("args", "model", "state_dict_adapter")

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBMODULES)
