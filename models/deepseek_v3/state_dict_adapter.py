"""Hugging Face <-> Trainyard state-dict names for DeepSeek-V3 / Kimi K2.

Our modules carry transformers 5.x's in-memory names, so most keys map one to one. The differences:
- Routed experts. We hold them fused, `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, D] and `.down_proj`
  [E, D, I] (transformers 5.x in memory). Checkpoints on disk use per-expert keys
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`: the published DeepSeek-V3 / Kimi K2 files, and what
  transformers 5.24's save_pretrained writes. `from_hf` accepts either form per layer; `to_hf` writes per-expert
  keys, which transformers 5.24's from_pretrained (and older loaders) read.
- Multi-token prediction. A DeepSeek-V3 checkpoint carries its MTP module as layer num_hidden_layers
  (`model.layers.61.*`: a full decoder layer plus embed_tokens, enorm, hnorm, eh_proj, shared_head). This model
  does not run MTP, so `from_hf` skips the num_nextn_predict_layers layers from index num_hidden_layers on (exactly
  those; any other surplus layer is still reported as unexpected), as transformers does.
- FP8 checkpoints (`*.weight_scale_inv` block scales next to float8 weights) are refused with a clear error: load
  a bf16 copy (DeepSeek's fp8_cast_bf16.py makes one).
- The tied lm_head (omitted from the file when tie_word_embeddings is set) and LoRA tensors (they belong in a PEFT
  adapter file), as in the dense family.
"""

import re
from collections import defaultdict

import torch

from models.deepseek_v3.args import ModelArgs

# Loaded in float32 whatever the load dtype, as transformers does: the router weight and the selection bias decide
# which experts win, and bf16 rounding flips near-ties.
FLOAT32_PARAMETERS = (r"\.mlp\.gate\.weight$", r"\.mlp\.gate\.e_score_correction_bias$")

_LORA_MARKERS = (".lora_A.", ".lora_B.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def from_hf(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    fp8_scales = [k for k in hf_state if k.endswith("_scale_inv")]
    if fp8_scales:
        raise ValueError(
            f"This is an FP8 checkpoint ({len(fp8_scales)} block-scale tensors such as {fp8_scales[0]!r}); "
            "load a bf16 copy instead (DeepSeek's inference/fp8_cast_bf16.py converts it)"
        )
    mtp_layers = range(args.num_layers, args.num_layers + args.num_nextn_predict_layers)
    state: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
    for name, tensor in hf_state.items():
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) in mtp_layers:
            continue
        if name.endswith(".rotary_emb.inv_freq"):
            continue
        expert = _PER_EXPERT.match(name)
        if expert:
            per_expert[expert.group(1)][(expert.group(3), int(expert.group(2)))] = tensor
        else:
            state[name] = tensor
    for prefix, tensors in per_expert.items():
        if f"{prefix}.gate_up_proj" in state or f"{prefix}.down_proj" in state:
            raise ValueError(f"Checkpoint holds {prefix} both fused and as per-expert tensors; keep one form")
        state.update(_fuse_experts(prefix, tensors, args.n_routed_experts))
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _fuse_experts(
    prefix: str, tensors: dict[tuple[str, int], torch.Tensor], num_experts: int
) -> dict[str, torch.Tensor]:
    missing = [f"{prefix}.{e}.{p}.weight" for e in range(num_experts) for p in _PROJS if (p, e) not in tensors]
    extra = [f"{prefix}.{e}.{p}.weight" for p, e in tensors if e >= num_experts]
    if missing or extra:
        raise ValueError(
            f"Checkpoint's per-expert tensors under {prefix} do not match n_routed_experts={num_experts}: "
            f"missing [{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}]; "
            f"unexpected [{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}]"
        )
    gate_up = [torch.cat([tensors["gate_proj", e], tensors["up_proj", e]], dim=0) for e in range(num_experts)]
    return {
        f"{prefix}.gate_up_proj": torch.stack(gate_up),
        f"{prefix}.down_proj": torch.stack([tensors["down_proj", e] for e in range(num_experts)]),
    }


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Per-expert keys, as the published checkpoints and transformers' save_pretrained. Each expert tensor is a
    copy, not a view of the fused one (safetensors refuses tensors that share storage)."""
    hf_state = {}
    for name, tensor in _checkpoint_entries(state, args).items():
        fused = _FUSED.match(name)
        if fused is None:
            hf_state[name] = tensor
            continue
        prefix = fused.group(1)
        if fused.group(2) == "down_proj":
            for e in range(tensor.shape[0]):
                hf_state[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                hf_state[f"{prefix}.{e}.gate_proj.weight"] = gate[e].clone()
                hf_state[f"{prefix}.{e}.up_proj.weight"] = up[e].clone()
    return hf_state


def expected_keys(model_state_keys: list[str], args: ModelArgs) -> set[str]:
    """Keys `from_hf` must return for a model whose state_dict has `model_state_keys` (our fused naming)."""
    return set(_checkpoint_entries(dict.fromkeys(model_state_keys), args))


def _checkpoint_entries(state: dict, args: ModelArgs) -> dict:
    entries = {k: v for k, v in state.items() if not any(m in k for m in _LORA_MARKERS)}
    if args.tie_word_embeddings:
        entries.pop("lm_head.weight", None)
    return entries
