"""Per-expert checkpoint keys <-> fused expert tensors, shared by the MoE families' state-dict adapters.

On disk (the published Qwen3-MoE, DeepSeek-V3 and Kimi K2 checkpoints, and what transformers 5.24 writes) every
routed expert has its own keys, `<prefix>.E.{gate,up,down}_proj.weight`; in memory we hold them fused per layer,
`<prefix>.gate_up_proj` [E, 2I, D] (gate rows, then up rows) and `<prefix>.down_proj` [E, D, I]. Loading fuses one
layer at a time and drops the per-expert tensors as it goes, so the peak is the checkpoint plus one layer's experts,
not twice every expert. Saving copies each expert straight to the CPU (no second fused copy on the accelerator).
"""

import re
from collections import defaultdict

import torch

LORA_MARKERS = (".lora_A.", ".lora_B.")
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
PROJS = ("gate_proj", "up_proj", "down_proj")


def without_lora(state: dict) -> dict:
    return {k: v for k, v in state.items() if not any(m in k for m in LORA_MARKERS)}


def fuse_experts(hf_state: dict[str, torch.Tensor], num_experts: int, setting: str) -> dict[str, torch.Tensor]:
    """hf_state with every layer's per-expert tensors replaced by the fused pair. Consumes hf_state (entries are
    popped as they are used). setting names the config field holding num_experts, for the error message."""
    per_layer: dict[str, list[str]] = defaultdict(list)
    for key in hf_state:
        match = PER_EXPERT.match(key)
        if match:
            per_layer[match.group(1)].append(key)
    for prefix, keys in per_layer.items():
        if f"{prefix}.gate_up_proj" in hf_state or f"{prefix}.down_proj" in hf_state:
            raise ValueError(f"Checkpoint holds {prefix} both fused and as per-expert tensors; keep one form")
        found = {(int(m.group(2)), m.group(3)) for m in map(PER_EXPERT.match, keys)}
        missing = [f"{prefix}.{e}.{p}.weight" for e in range(num_experts) for p in PROJS if (e, p) not in found]
        extra = sorted(f"{prefix}.{e}.{p}.weight" for e, p in found if e >= num_experts)
        if missing or extra:
            raise ValueError(
                f"Per-expert weights under {prefix} do not match {setting}={num_experts}: "
                f"missing [{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}]; "
                f"unexpected [{', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}]"
            )

        def take(e: int, proj: str) -> torch.Tensor:
            return hf_state.pop(f"{prefix}.{e}.{proj}.weight")

        hf_state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([take(e, "gate_proj"), take(e, "up_proj")], dim=0) for e in range(num_experts)])
        hf_state[f"{prefix}.down_proj"] = torch.stack([take(e, "down_proj") for e in range(num_experts)])
    return hf_state


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors -> per-expert keys, each an independent CPU copy (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        fused = FUSED.match(key)
        if fused is None:
            out[key] = tensor
            continue
        prefix, name = fused.groups()
        if name == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].to("cpu", copy=True)
        else:
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].to("cpu", copy=True)
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].to("cpu", copy=True)
    return out
