"""Hugging Face <-> Trainyard state-dict names for the dense Llama/Qwen family.

Our modules carry HF's names, so the mapping is the identity except for: the tied lm_head (HF omits it from the
file when tie_word_embeddings is set), stale rotary buffers in old checkpoints, and LoRA tensors, which belong in a
PEFT adapter file and never in the base checkpoint.
"""

import torch

from models.llama.args import ModelArgs

_LORA_MARKERS = (".lora_A.", ".lora_B.")


def from_hf(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in hf_state.items() if not k.endswith(".rotary_emb.inv_freq")}
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    hf_state = {k: v for k, v in state.items() if not any(m in k for m in _LORA_MARKERS)}
    if args.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
    return hf_state


def expected_keys(model_state_keys: list[str], args: ModelArgs) -> set[str]:
    """Keys a checkpoint must provide for a model whose state_dict has `model_state_keys`."""
    return set(to_hf(dict.fromkeys(model_state_keys), args))
