"""Dense Llama 3 / Qwen2 / Qwen3 family."""

from models.llama import state_dict_adapter
from models.llama.args import SUPPORTED_ARCHITECTURES, ModelArgs
from models.kv_cache import KVCache
from models.llama.model import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "KVCache", "ModelArgs", "state_dict_adapter"]
