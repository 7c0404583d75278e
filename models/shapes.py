"""Exact parameter counts of any supported architecture, from config.json alone (the model is built on the meta
device: no memory, no weights).

Counts are grouped by module kind so a user sees where the parameters are (embeddings, attention, dense MLPs, routed
and shared experts, routers, norms, unembedding), and the active count per token follows from the routed experts'
top-k share.
"""

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.families import family_for_config

CONFIGS_DIR = Path(__file__).parent / "configs"

# (pattern on the parameter name, group); first match wins.
_GROUPS = (
    (r"\.lora_[AB]\.", "lora"),
    (r"^model\.embed_tokens\.", "embedding"),
    (r"^lm_head\.", "unembedding"),
    (r"\.mlp\.experts\.", "routed experts"),
    (r"\.mlp\.shared_experts?\.", "shared experts"),
    (r"\.mlp\.gate\.", "routers"),
    (r"\.self_attn\.", "attention"),
    (r"\.mlp\.", "dense MLP"),
    (r"norm", "norms"),
)


@dataclass
class ParameterCount:
    architecture: str
    total: int
    active: int  # per token: routed experts count with their top-k share
    by_group: dict[str, int] = field(default_factory=dict)
    by_layer: list[int] = field(default_factory=list)


def load_config(path: str | Path) -> dict:
    """config.json from a model directory, a config file, or the name of a shipped config (models/configs/NAME)."""
    p = Path(path)
    if not p.exists() and (CONFIGS_DIR / str(path)).is_dir():
        p = CONFIGS_DIR / str(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        shipped = ", ".join(sorted(d.name for d in CONFIGS_DIR.iterdir() if d.is_dir()))
        raise ValueError(f"{path}: no config.json there and no shipped config of that name (shipped: {shipped})")
    return json.loads(p.read_text())


def count_parameters(config: dict) -> ParameterCount:
    family = family_for_config(config)
    args = family.ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = family.CausalLM(args)
    seen: set[int] = set()
    by_group: dict[str, int] = defaultdict(int)
    by_layer: dict[int, int] = defaultdict(int)
    routed = 0
    for name, param in model.named_parameters():
        if id(param) in seen:  # tied embeddings count once
            continue
        seen.add(id(param))
        group = next((g for pattern, g in _GROUPS if re.search(pattern, name)), "other")
        by_group[group] += param.numel()
        if group == "routed experts":
            routed += param.numel()
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:
            by_layer[int(layer.group(1))] += param.numel()
    total = sum(by_group.values())
    top_k, num_experts = _routing(args)
    active = total - routed + (routed * top_k // num_experts if num_experts else 0)
    return ParameterCount(architecture=args.architecture, total=total, active=active, by_group=dict(by_group),
                          by_layer=[by_layer[i] for i in range(len(by_layer))])


def _routing(args) -> tuple[int, int]:
    """(experts per token, routed experts) of an MoE family's args; (0, 0) for dense models."""
    for k_name, e_name in (("num_experts_per_tok", "num_experts"), ("num_experts_per_tok", "n_routed_experts")):
        if getattr(args, e_name, None):
            return getattr(args, k_name), getattr(args, e_name)
    return 0, 0
