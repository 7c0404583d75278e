"""Dense Llama 3 / Qwen2 / Qwen3 family."""

from trainyard.lazy import lazy_exports

_EXPORTS = {"SUPPORTED_ARCHITECTURES": "models.llama.args", "ModelArgs": "models.llama.args",
            "CausalLM": "models.common.decoder", "KVCache": "models.kv_cache"}
_SUBMODULES = ("args", "model", "state_dict_adapter")

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBMODULES)
