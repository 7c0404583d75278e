"""Hugging Face <-> Trainyard state-dict names for Qwen3-MoE.

Our module names are transformers 5.x's in-memory names, with experts fused per layer:
  model.layers.N.mlp.experts.gate_up_proj [E, 2I, D] = per expert cat(gate_proj.weight, up_proj.weight, dim=0)
  model.layers.N.mlp.experts.down_proj    [E, D, I]  = per expert down_proj.weight
Checkpoints on disk (the published Qwen3-30B-A3B, and what transformers 5.24's save_pretrained writes) use per-expert
keys model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight. from_hf accepts either form (also mixed across
layers or shards); to_hf writes per-expert keys, which transformers 5.24 loads (it also loads fused keys).
Besides that: the tied lm_head, stale rotary buffers and LoRA tensors, as in models.llama.
"""

import re
from collections import defaultdict

import torch

from models.qwen3_moe.args import ModelArgs

_LORA_MARKERS = (".lora_A.", ".lora_B.")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def from_hf(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    for key, tensor in hf_state.items():
        if key.endswith(".rotary_emb.inv_freq"):
            continue
        match = _PER_EXPERT.match(key)
        if match:
            prefix, expert, proj = match.groups()
            per_expert[prefix][(int(expert), proj)] = tensor
        else:
            state[key] = tensor
    for prefix, tensors in per_expert.items():
        if f"{prefix}.gate_up_proj" in state or f"{prefix}.down_proj" in state:
            raise ValueError(f"Checkpoint has both fused and per-expert weights for {prefix}")
        missing = [
            f"{prefix}.{e}.{proj}.weight"
            for e in range(args.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
            if (e, proj) not in tensors
        ]
        extra = sorted(f"{prefix}.{e}.{proj}.weight" for e, proj in tensors if e >= args.num_experts)
        if missing or extra:
            raise ValueError(
                f"Per-expert weights of {prefix} do not match num_experts={args.num_experts}: "
                f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}; unexpected {extra[:6]}"
            )
        experts = range(args.num_experts)
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[(e, "gate_proj")], tensors[(e, "up_proj")]], dim=0) for e in experts]
        )
        state[f"{prefix}.down_proj"] = torch.stack([tensors[(e, "down_proj")] for e in experts])
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    hf_state: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if any(m in key for m in _LORA_MARKERS):
            continue
        match = _FUSED.match(key)
        if not match:
            hf_state[key] = tensor
            continue
        prefix, name = match.groups()
        # Cloned: safetensors refuses to save tensors that share storage.
        for e in range(args.num_experts):
            if name == "down_proj":
                hf_state[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
            else:
                gate_ID, up_ID = tensor[e].chunk(2, dim=0)
                hf_state[f"{prefix}.{e}.gate_proj.weight"] = gate_ID.clone()
                hf_state[f"{prefix}.{e}.up_proj.weight"] = up_ID.clone()
    if args.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
    return hf_state


def expected_keys(model_state_keys: list[str], args: ModelArgs) -> set[str]:
    """Keys (our names, i.e. after from_hf) a checkpoint must provide for a model with these state_dict keys."""
    keys = {k for k in model_state_keys if not any(m in k for m in _LORA_MARKERS)}
    if args.tie_word_embeddings:
        keys.discard("lm_head.weight")
    return keys
