"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention + softmax-routed experts (models.moe)."""

from models.kv_cache import KVCache
from models.qwen3_moe import state_dict_adapter
from models.qwen3_moe.args import SUPPORTED_ARCHITECTURES, ModelArgs
from models.qwen3_moe.model import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "KVCache", "ModelArgs", "state_dict_adapter"]
