"""DeepSeek-V3 / Kimi K2 family: multi-head latent attention + DeepSeek MoE (docs/mla.md)."""

from models.deepseek_v3 import state_dict_adapter
from models.deepseek_v3.args import SUPPORTED_ARCHITECTURES, ModelArgs
from models.deepseek_v3.model import CausalLM
from models.kv_cache import KVCache

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "KVCache", "ModelArgs", "state_dict_adapter"]
