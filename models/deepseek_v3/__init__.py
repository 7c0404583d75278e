"""DeepSeek-V3 / Kimi K2 family: multi-head latent attention + DeepSeek MoE (docs/mla.md)."""

from trainyard.lazy import lazy_exports

_EXPORTS = {"SUPPORTED_ARCHITECTURES": "models.deepseek_v3.args", "ModelArgs": "models.deepseek_v3.args",
            "CausalLM": "models.common.decoder", "KVCache": "models.kv_cache"}
_SUBMODULES = ("args", "model", "state_dict_adapter")

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBMODULES)
