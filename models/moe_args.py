"""The MoE block's settings (models/moe.py), without torch: family args build them from a config.json."""

from dataclasses import dataclass

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    router: str  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3 / Kimi K2)
    norm_topk_prob: bool
    n_group: int = 1  # sigmoid router: experts are split into n_group groups ...
    topk_group: int = 1  # ... of which the topk_group best are eligible
    routed_scaling_factor: float = 1.0  # sigmoid router: multiplies the gate weights
    n_shared_experts: int = 0  # > 0: a shared MLP of n_shared_experts * moe_intermediate_size

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"MoE router must be one of {ROUTERS}, got {self.router!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.router == "sigmoid":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
            if self.num_experts // self.n_group < 2:
                raise ValueError(f"n_group={self.n_group} leaves fewer than 2 experts per group (group score = top-2)")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.top_k > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(
                    f"num_experts_per_tok={self.top_k} exceeds the experts in topk_group={self.topk_group} groups"
                )
