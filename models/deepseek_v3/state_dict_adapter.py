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

import torch

from models.deepseek_v3.args import ModelArgs
from models.expert_checkpoint import fuse_experts, split_experts, without_lora

# Loaded in float32 whatever the load dtype, as transformers does: the router weight and the selection bias decide
# which experts win, and bf16 rounding flips near-ties.
FLOAT32_PARAMETERS = (r"\.mlp\.gate\.weight$", r"\.mlp\.gate\.e_score_correction_bias$")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def from_hf(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state from a checkpoint's tensors (consumes hf_state)."""
    fp8_scales = [k for k in hf_state if k.endswith("_scale_inv")]
    if fp8_scales:
        raise ValueError(
            f"This is an FP8 checkpoint ({len(fp8_scales)} block-scale tensors such as {fp8_scales[0]!r}); "
            "load a bf16 copy instead (DeepSeek's inference/fp8_cast_bf16.py converts it)"
        )
    mtp_layers = range(args.num_layers, args.num_layers + args.num_nextn_predict_layers)
    for name in list(hf_state):
        layer = _LAYER.match(name)
        if (layer and int(layer.group(1)) in mtp_layers) or name.endswith(".rotary_emb.inv_freq"):
            del hf_state[name]
    state = fuse_experts(hf_state, args.n_routed_experts, "n_routed_experts")
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Per-expert keys, as the published checkpoints and transformers' save_pretrained."""
    return split_experts(_checkpoint_entries(state, args))


def expected_keys(model_state_keys: list[str], args: ModelArgs) -> set[str]:
    """Keys `from_hf` must return for a model whose state_dict has `model_state_keys` (our fused naming)."""
    return set(_checkpoint_entries(dict.fromkeys(model_state_keys), args))


def _checkpoint_entries(state: dict, args: ModelArgs) -> dict:
    entries = without_lora(state)
    if args.tie_word_embeddings:
        entries.pop("lm_head.weight", None)
    return entries
