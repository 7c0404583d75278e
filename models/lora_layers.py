"""LoRA layers: the adapter math on one nn.Linear (LoRALinear) and on one routed-expert block (ExpertsLoRA).

models/lora.py applies them to a model, switches, merges, saves and loads adapters; docs/lora.md has the design.
Shapes: E experts, F output features, D input features, r rank, M routed rows (kernels/moe.py), N rows of a
forward's flattened tokens (B * T).

Two ways to choose the adapter: `active_adapter` (one for the whole model: the trainer), or `per_row_adapters`
(a context: each token row names its own adapter or the base model, so requests for different adapters share one
forward: the rollout's multi-LoRA batches). Per row, the math is the single-adapter math on that row's inputs.
"""

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import PermState, grouped_mm
from models.lora_targets import DEFAULT_TARGETS

if TYPE_CHECKING:  # models.moe imports the common blocks, which project through this module
    from models.moe import Experts

INITS = ("kaiming", "gaussian")


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    init: str = "kaiming"  # A's init: "kaiming" (peft's default, init_lora_weights=True) or "gaussian"; B is zeros

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ValueError(f"target_modules must be a non-empty tuple of module names, got {self.target_modules!r}")
        if self.init not in INITS:
            raise ValueError(f"LoRA init must be one of {INITS}, got {self.init!r}")
        self.target_modules = tuple(self.target_modules)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class RowAdapters:
    """The adapter of each row of one forward's flattened tokens [N].

    groups: (adapter name, int64 row indices) for each adapter present, rows in no group run the base weights only;
    group_N: int64 [N], each row's index into groups, -1 for base rows (routed expert rows look it up)."""

    groups: tuple[tuple[str, torch.Tensor], ...]
    group_N: torch.Tensor

    @classmethod
    def from_names(cls, names_N: Sequence[str | None], device: torch.device | str = "cpu") -> "RowAdapters":
        """From each row's adapter name (None = base model)."""
        order = list(dict.fromkeys(n for n in names_N if n is not None))
        index = {name: i for i, name in enumerate(order)}
        group_N = torch.tensor([-1 if n is None else index[n] for n in names_N], dtype=torch.int64)
        groups = tuple((name, (group_N == i).nonzero().squeeze(1).to(device)) for i, name in enumerate(order))
        return cls(groups=groups, group_N=group_N.to(device))


_ROW_ADAPTERS: contextvars.ContextVar[RowAdapters | None] = contextvars.ContextVar("lora_row_adapters", default=None)


@contextlib.contextmanager
def per_row_adapters(rows: RowAdapters) -> Iterator[None]:
    """Within this context (in this thread), every LoRA layer applies each row's own adapter from `rows` and ignores
    `active_adapter`. The forward's inputs must flatten to the N rows `rows` describes. No adapter may be merged."""
    token = _ROW_ADAPTERS.set(rows)
    try:
        yield
    finally:
        _ROW_ADAPTERS.reset(token)


def row_adapters() -> RowAdapters | None:
    """The per_row_adapters in force in this context, if any."""
    return _ROW_ADAPTERS.get()


def _check_not_merged(layer: "LoRALinear | ExpertsLoRA") -> None:
    if layer.merged_adapter is not None:
        raise ValueError(
            f"Adapter {layer.merged_adapter!r} is merged into the weights; unmerge_adapter it before running "
            "per-row adapters"
        )


def _init_A(rows: int, cols: int, cfg: LoraConfig, generator: torch.Generator | None) -> torch.Tensor:
    # On the CPU so a seed gives the same adapter on every device. Expert A's are [E*r, D]: fan_in stays D.
    a = torch.empty(rows, cols, dtype=torch.float32)
    if cfg.init == "gaussian":
        nn.init.normal_(a, std=1 / cfg.rank, generator=generator)
    else:
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


class LoRALinear(nn.Module):
    """An nn.Linear's weight/bias plus any number of named low-rank adapters."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.added_at: dict[str, int] = {}  # adapter -> models.lora's add counter, for adapter_names' order
        self.active_adapter: str | None = None
        self.merged_adapter: str | None = None

    def add_adapter(self, name: str, cfg: LoraConfig, generator: torch.Generator | None,
                    device: torch.device | str | None = None) -> list[nn.Parameter]:
        device = device or self.weight.device
        lora_A = nn.Linear(self.in_features, cfg.rank, bias=False, device=device, dtype=torch.float32)
        lora_B = nn.Linear(cfg.rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            lora_A.weight.copy_(_init_A(cfg.rank, self.in_features, cfg, generator))
            lora_B.weight.zero_()
        self.lora_A[name], self.lora_B[name] = lora_A, lora_B
        self.lora_dropout[name] = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.scaling[name] = cfg.scaling
        return [lora_A.weight, lora_B.weight]

    def delete_adapter(self, name: str) -> None:
        for container in (self.lora_A, self.lora_B, self.lora_dropout):
            del container[name]
        del self.scaling[name], self.added_at[name]
        if self.active_adapter == name:
            self.active_adapter = None

    def rank(self, name: str) -> int:
        return self.lora_A[name].weight.shape[0]

    def peft_tensors(self, name: str) -> dict[str, nn.Parameter]:
        """The adapter's Parameters under their peft key suffixes."""
        return {"lora_A.weight": self.lora_A[name].weight, "lora_B.weight": self.lora_B[name].weight}

    def delta_weight(self, name: str) -> torch.Tensor:
        return (self.lora_B[name].weight @ self.lora_A[name].weight) * self.scaling[name]

    @torch.no_grad()
    def merge(self, name: str) -> None:
        self.weight.data += self.delta_weight(name).to(self.weight.dtype)
        self.merged_adapter = name

    @torch.no_grad()
    def unmerge(self) -> None:
        self.weight.data -= self.delta_weight(self.merged_adapter).to(self.weight.dtype)
        self.merged_adapter = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        rows = _ROW_ADAPTERS.get()
        if rows is not None:
            return self._add_per_row(x, result, rows)
        name = self.active_adapter
        if name is None or name == self.merged_adapter or name not in self.lora_A:
            return result
        lora_A = self.lora_A[name]
        h = lora_A(self.lora_dropout[name](x.to(lora_A.weight.dtype)))
        return self.add_update(result, h.reshape(-1, h.shape[-1]), name)

    def add_update(self, result: torch.Tensor, h_Nr: torch.Tensor, name: str) -> torch.Tensor:
        """result + scaling * (h @ B^T) as one GEMM that accumulates into the base output: no [N, out] product to
        scale and add, forward or backward (the same math as peft's result + lora_B(h) * scaling). h_Nr: the
        adapter's A output, [N, r] (a column slice of a wider one is fine)."""
        out_NF = torch.addmm(result.reshape(-1, self.out_features).to(h_Nr.dtype), h_Nr,
                             self.lora_B[name].weight.t(), alpha=self.scaling[name])
        return out_NF.view(result.shape).to(result.dtype)

    def _add_per_row(self, x: torch.Tensor, result: torch.Tensor, rows: RowAdapters) -> torch.Tensor:
        """result (the base output) plus, on each adapter's rows, that adapter's update; in place on result."""
        _check_not_merged(self)
        x_NX, out_NF = x.reshape(-1, x.shape[-1]), result.view(-1, result.shape[-1])
        for name, rows_n in rows.groups:
            if name not in self.lora_A:
                continue
            lora_A = self.lora_A[name]
            x_nX = self.lora_dropout[name](x_NX.index_select(0, rows_n).to(lora_A.weight.dtype))
            sum_nF = out_NF.index_select(0, rows_n) + self.lora_B[name](lora_A(x_nX)) * self.scaling[name]
            out_NF.index_copy_(0, rows_n, sum_nF.to(out_NF.dtype))
        return result

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, adapters={list(self.lora_A)}, "
            f"active={self.active_adapter!r}, merged={self.merged_adapter!r}"
        )


def project(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    """[m(x) for m in linears], for the projections of one input (q / k / v, gate / up). When they are LoRALinear
    layers training one active, unmerged adapter without dropout, their A matrices run as one GEMM: x is read once
    for all of them, and in backward dA and A's share of dx are one GEMM each instead of one per projection (rank-r
    GEMMs are bound by reading x, not by arithmetic). Each output is the same sum as the layer's own forward; anything
    else (per-row adapters, merged or inactive adapters, dropout) runs the layers one by one."""
    name = getattr(linears[0], "active_adapter", None)
    fusable = name is not None and _ROW_ADAPTERS.get() is None and all(
        isinstance(m, LoRALinear) and m.active_adapter == name and m.merged_adapter != name and name in m.lora_A
        and isinstance(m.lora_dropout[name], nn.Identity) for m in linears)
    if not fusable or len(linears) < 2:
        return [m(x) for m in linears]
    A_RD = torch.cat([m.lora_A[name].weight for m in linears])
    h_NR = F.linear(x.to(A_RD.dtype), A_RD).reshape(-1, A_RD.shape[0])
    outs, start = [], 0
    for m in linears:
        rank = m.rank(name)
        outs.append(m.add_update(F.linear(x, m.weight, m.bias), h_NR[:, start:start + rank], name))
        start += rank
    return outs


class ExpertsLoRA(nn.Module):
    """Named adapters on the fused expert tensors of one models.moe.Experts (installed as its `lora` hook).

    Per adapter and adapted tensor W [E, F, D] (gate_up_proj: F = 2I, D = hidden; down_proj: F = hidden, D = I):
    expert e computes x W_e^T + scaling * (dropout(x) A_e^T) B_e^T with two grouped GEMMs over the same row groups
    as the base GEMM, in the activation dtype (so torch._grouped_mm serves bf16 on GPU); the float32 LoRA weights
    are cast on the way in. Storage is peft's ParamWrapper layout, so lora_state_dict hands out the Parameters
    themselves: lora_A [E*r, D] (rows e*r .. e*r+r-1 are A_e) and lora_B [F, r*E] (column j*E + e is column j of
    B_e)."""

    def __init__(self, experts: "Experts"):
        super().__init__()
        # the held experts (global ids first_expert .. + num_experts - 1 of total_experts): expert parallelism
        # keeps a slice of each layer's experts, and of their adapters
        self.num_experts, self.first_expert, self.total_experts = (
            experts.num_experts, experts.first_expert, experts.total_experts)
        self.shapes = {name: tuple(getattr(experts, name).shape) for name in type(experts).WEIGHT_NAMES}
        self.lora_A = nn.ModuleDict()  # adapter -> ParameterDict(weight name -> [E*r, D])
        self.lora_B = nn.ModuleDict()  # adapter -> ParameterDict(weight name -> [F, r*E])
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.added_at: dict[str, int] = {}  # adapter -> models.lora's add counter, for adapter_names' order
        self.active_adapter: str | None = None
        self.merged_adapter: str | None = None

    def add_adapter(
        self, name: str, cfg: LoraConfig, weight_names: list[str], device: torch.device,
        generator: torch.Generator | None,
    ) -> list[nn.Parameter]:
        E, params = self.num_experts, []
        held = slice(self.first_expert * cfg.rank, (self.first_expert + E) * cfg.rank)
        lora_A, lora_B = nn.ParameterDict(), nn.ParameterDict()
        for weight in weight_names:
            _, out_features, in_features = self.shapes[weight]
            # A is drawn for all the layer's experts and the held ones kept: a seed gives the same adapter whether
            # or not the experts are split over ranks
            A = _init_A(self.total_experts * cfg.rank, in_features, cfg, generator)[held].clone()
            lora_A[weight] = nn.Parameter(A.to(device))
            lora_B[weight] = nn.Parameter(torch.zeros(out_features, cfg.rank * E, device=device))
            params += [lora_A[weight], lora_B[weight]]
        self.lora_A[name], self.lora_B[name] = lora_A, lora_B
        self.lora_dropout[name] = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.scaling[name] = cfg.scaling
        return params

    def delete_adapter(self, name: str) -> None:
        for container in (self.lora_A, self.lora_B, self.lora_dropout):
            del container[name]
        del self.scaling[name], self.added_at[name]
        if self.active_adapter == name:
            self.active_adapter = None

    def rank(self, name: str) -> int:
        return next(iter(self.lora_A[name].values())).shape[0] // self.num_experts

    def factors(self, name: str, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r, D], B [E, F, r]) of adapter `name` on fused tensor `weight` (views of the Parameters)."""
        A, B = self.lora_A[name][weight], self.lora_B[name][weight]
        return A.view(self.num_experts, -1, A.shape[-1]), B.view(B.shape[0], -1, self.num_experts).permute(2, 0, 1)

    def peft_tensors(self, name: str) -> dict[str, nn.Parameter]:
        """peft nests one ParamWrapper per adapted tensor on the experts module: with both adapted, gate_up_proj is
        the inner one (`experts.base_layer.lora_A`) and down_proj the outer (`experts.lora_A`)."""
        weights = list(self.lora_A[name])
        out = {}
        for weight in weights:
            prefix = "base_layer." if len(weights) == 2 and weight == "gate_up_proj" else ""
            out[f"{prefix}lora_A.weight"] = self.lora_A[name][weight]
            out[f"{prefix}lora_B.weight"] = self.lora_B[name][weight]
        return out

    @torch.no_grad()
    def merge(self, name: str, experts: "Experts") -> None:
        for weight in self.lora_A[name]:
            self._add_delta(name, weight, getattr(experts, weight), sign=1.0)
        self.merged_adapter = name

    @torch.no_grad()
    def unmerge(self, experts: "Experts") -> None:
        for weight in self.lora_A[self.merged_adapter]:
            self._add_delta(self.merged_adapter, weight, getattr(experts, weight), sign=-1.0)
        self.merged_adapter = None

    def _add_delta(self, name: str, weight: str, w_EFD: torch.Tensor, sign: float) -> None:
        A_ErD, B_EFr = self.factors(name, weight)
        for e in range(self.num_experts):  # one expert's [F, D] delta at a time
            w_EFD.data[e] += (sign * (B_EFr[e] @ A_ErD[e]) * self.scaling[name]).to(w_EFD.dtype)

    def forward(
        self, weight: str, x_MX: torch.Tensor, out_MF: torch.Tensor, state: PermState, backend: str
    ) -> torch.Tensor:
        rows = _ROW_ADAPTERS.get()
        if rows is not None:
            return self._add_per_row(weight, x_MX, out_MF, state, backend, rows)
        name = self.active_adapter
        if name is None or name == self.merged_adapter or name not in self.lora_A or weight not in self.lora_A[name]:
            return out_MF
        return out_MF + self._delta(name, weight, x_MX, state.counts_E, backend, out_MF.dtype)

    def _delta(
        self, name: str, weight: str, x_MX: torch.Tensor, counts_E: torch.Tensor, backend: str, dtype: torch.dtype
    ) -> torch.Tensor:
        A_ErD, B_EFr = self.factors(name, weight)
        x_MX = self.lora_dropout[name](x_MX).to(dtype)
        a_Mr = grouped_mm(x_MX, A_ErD.to(dtype), counts_E, layout="EFD", backend=backend)
        delta_MF = grouped_mm(a_Mr, B_EFr.to(dtype).contiguous(), counts_E, layout="EFD", backend=backend)
        return delta_MF * self.scaling[name]

    def _add_per_row(
        self, weight: str, x_MX: torch.Tensor, out_MF: torch.Tensor, state: PermState, backend: str,
        rows: RowAdapters,
    ) -> torch.Tensor:
        """out plus each adapter's update on the routed rows of its tokens. The permuted rows are grouped by expert
        and keep their order inside a group, so any subset of them is still grouped by expert."""
        _check_not_merged(self)
        present = [(g, name) for g, (name, _) in enumerate(rows.groups)
                   if name in self.lora_A and weight in self.lora_A[name]]
        if not present:
            return out_MF
        out_MF = out_MF.clone()
        group_M = rows.group_N[state.order_M // state.top_k]
        expert_M = torch.repeat_interleave(
            torch.arange(self.num_experts, device=out_MF.device), state.counts_E, output_size=group_M.numel()
        )
        for g, name in present:
            rows_m = (group_M == g).nonzero().squeeze(1)
            counts_E = torch.bincount(expert_M.index_select(0, rows_m), minlength=self.num_experts)
            delta_mF = self._delta(name, weight, x_MX.index_select(0, rows_m), counts_E, backend, out_MF.dtype)
            out_MF.index_copy_(0, rows_m, out_MF.index_select(0, rows_m) + delta_mF)
        return out_MF

    def extra_repr(self) -> str:
        adapted = {name: list(weights) for name, weights in self.lora_A.items()}
        return (
            f"experts={self.num_experts}, adapters={adapted}, active={self.active_adapter!r}, "
            f"merged={self.merged_adapter!r}"
        )
