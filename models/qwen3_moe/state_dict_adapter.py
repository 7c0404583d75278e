"""Hugging Face <-> Trainyard state-dict names for Qwen3-MoE.

Our module names are transformers 5.x's in-memory names, with experts fused per layer:
  model.layers.N.mlp.experts.gate_up_proj [E, 2I, D] = per expert cat(gate_proj.weight, up_proj.weight, dim=0)
  model.layers.N.mlp.experts.down_proj    [E, D, I]  = per expert down_proj.weight
Checkpoints on disk (the published Qwen3-30B-A3B, and what transformers 5.24's save_pretrained writes) use per-expert
keys model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight. from_hf accepts either form (also mixed across
layers or shards); to_hf writes per-expert keys, which transformers 5.24 loads (it also loads fused keys).
Besides that: the tied lm_head, stale rotary buffers and LoRA tensors, as in models.llama.
"""

import torch

from models.expert_checkpoint import fuse_experts, split_experts, without_lora
from models.qwen3_moe.args import ModelArgs


def from_hf(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state from a checkpoint's tensors (consumes hf_state)."""
    for key in [k for k in hf_state if k.endswith(".rotary_emb.inv_freq")]:
        del hf_state[key]
    state = fuse_experts(hf_state, args.num_experts, "num_experts")
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    hf_state = split_experts(without_lora(state))
    if args.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
    return hf_state


def expected_keys(model_state_keys: list[str], args: ModelArgs) -> set[str]:
    """Keys (our names, i.e. after from_hf) a checkpoint must provide for a model with these state_dict keys."""
    keys = set(without_lora(dict.fromkeys(model_state_keys)))
    if args.tie_word_embeddings:
        keys.discard("lm_head.weight")
    return keys
