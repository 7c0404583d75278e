"""The mixture-of-experts block shared by Qwen3-MoE and DeepSeek-V3 (and Kimi K2), plus router replay.

Shapes: B batch, T tokens, N = B * T tokens flattened, D hidden, E routed experts, K experts per token (top-k),
I moe_intermediate_size.

Module and parameter names are transformers 5.x's, so checkpoints and PEFT keys map without renaming:
  gate.weight [E, D]                      the router (Qwen3MoeTopKRouter / DeepseekV3TopkRouter)
  gate.e_score_correction_bias [E]        DeepSeek only, a float32 buffer
  experts.gate_up_proj [E, 2I, D]         per expert: rows 0..I-1 are gate_proj.weight, rows I..2I-1 up_proj.weight
  experts.down_proj [E, D, I]             per expert: down_proj.weight
  shared_experts.{gate,up,down}_proj      DeepSeek: one dense MLP of n_shared_experts * I, added to the routed output

Routers follow transformers line by line, dtypes included:
- "softmax" (Qwen3-MoE): logits = x @ W.T in the activation dtype, softmax in float32, top-k, divide by the top-k sum
  when norm_topk_prob, cast to the logits' dtype.
- "sigmoid" (DeepSeek-V3): logits in float32 (x and W upcast), scores = sigmoid; selection uses scores +
  e_score_correction_bias, restricted to the topk_group groups whose top-2 biased scores sum highest; the gate
  weights are the UNBIASED scores at the chosen ids, divided by (their sum + 1e-20) when norm_topk_prob, times
  routed_scaling_factor; they stay float32.
The gate weights are always gathered from the live scores at the chosen ids, so a replayed choice keeps the
router's gradient.

Router replay: a RouterReplay passed as forward(routing=...) records the chosen ids (mode "record", e.g. in the
rollout) or forces them (mode "replay", e.g. in the trainer, so it trains the experts the sampler used).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import PermState, grouped_mm, permute, unpermute
from kernels.quant4 import Packed4Weight, quant4_grouped_mm
from kernels.activations import swiglu
from models.common.blocks import MLP
from models.moe_args import MoEArgs  # noqa: F401 - re-exported

RECORD, REPLAY = "record", "replay"
INIT_STD = 0.02  # transformers' initializer_range default, used for experts and router at construction


def routed_id_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype that holds every expert id: uint8 up to 256 experts, then int16, then int32."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


@dataclass(frozen=True)
class MLPShape:
    """The fields models.common.blocks.MLP reads, for MLPs whose width is not the config's intermediate_size."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


class RouterReplay:
    """Routed expert ids per MoE layer, recorded from or replayed into a model forward (`routing=`).

    expert_ids maps the decoder layer index to an integer tensor [B, T, K] (uint8 for <= 256 experts, see
    routed_id_dtype); `ids.flatten(0, 1)` is the [N, K] view, one row per token. In "record" mode each forward
    appends its tokens along T, so a prefill followed by decode steps leaves one [B, T_total, K] tensor per layer.
    In "replay" mode a forward must cover exactly the stored tokens (same B and T); it reads them without consuming
    them, so activation-checkpoint recomputation replays the same ids. Record with torch.no_grad (the rollout):
    a recomputed forward would append twice.
    """

    def __init__(self, mode: str, expert_ids: dict[int, torch.Tensor] | None = None):
        if mode not in (RECORD, REPLAY):
            raise ValueError(f"RouterReplay mode must be {RECORD!r} or {REPLAY!r}, got {mode!r}")
        self.mode = mode
        self.expert_ids: dict[int, torch.Tensor] = dict(expert_ids or {})

    @classmethod
    def record(cls) -> "RouterReplay":
        return cls(RECORD)

    @classmethod
    def replay(cls, expert_ids: dict[int, torch.Tensor]) -> "RouterReplay":
        return cls(REPLAY, expert_ids)

    @classmethod
    def from_stacked(cls, layers: list[int], ids_BTLK: torch.Tensor) -> "RouterReplay":
        """Replay from the stacked layout of `stacked()`."""
        assert ids_BTLK.shape[2] == len(layers), (ids_BTLK.shape, layers)
        return cls.replay({layer: ids_BTLK[:, :, i] for i, layer in enumerate(layers)})

    @property
    def layers(self) -> list[int]:
        return sorted(self.expert_ids)

    def stacked(self) -> torch.Tensor:
        """[B, T, L, K] over the MoE layers in `layers` order (what the rollout returns per generated token)."""
        return torch.stack([self.expert_ids[layer] for layer in self.layers], dim=2)

    def select(self, row_indices: torch.Tensor) -> "RouterReplay":
        """New RouterReplay whose row i is this one's row row_indices[i] (mirrors KVCache.select)."""
        return RouterReplay(self.mode, {k: v.index_select(0, row_indices) for k, v in self.expert_ids.items()})

    def route(self, layer_idx: int, live_ids_BTK: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The ids a MoE layer must use (int64 [B, T, K]): the live choice, recorded, or the stored one."""
        if self.mode == RECORD:
            ids = live_ids_BTK.detach().to(routed_id_dtype(num_experts))
            previous = self.expert_ids.get(layer_idx)
            self.expert_ids[layer_idx] = ids if previous is None else torch.cat([previous, ids], dim=1)
            return live_ids_BTK
        stored = self.expert_ids.get(layer_idx)
        if stored is None:
            raise ValueError(f"RouterReplay has no expert ids for MoE layer {layer_idx}; it holds {self.layers}")
        if stored.shape != live_ids_BTK.shape:
            raise ValueError(
                f"RouterReplay ids for layer {layer_idx} have shape {tuple(stored.shape)} but the forward routes "
                f"{tuple(live_ids_BTK.shape)} [B, T, top_k]; replay must cover exactly the forward's tokens"
            )
        return stored.to(device=live_ids_BTK.device, dtype=torch.int64)


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE: softmax over experts, top-k, optional renormalisation."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.top_k, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        nn.init.normal_(self.weight, std=INIT_STD)

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """float32 softmax probabilities [N, E]."""
        return F.softmax(F.linear(x_ND, self.weight), dim=-1, dtype=torch.float32)

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        return torch.topk(scores_NE, self.top_k, dim=-1).indices

    def gate_weights(self, scores_NE: torch.Tensor, ids_NK: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        weights_NK = scores_NE.gather(1, ids_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return weights_NK.to(act_dtype)  # transformers casts to router_logits.dtype, the activation dtype


class SigmoidGroupRouter(nn.Module):
    """DeepSeek-V3: sigmoid scores, bias-corrected group-limited selection, unbiased weights."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, std=INIT_STD)
        self.register_buffer("e_score_correction_bias", torch.zeros(args.num_experts, dtype=torch.float32))

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """float32 sigmoid scores [N, E] (x and the router weight are upcast, as in transformers)."""
        return F.linear(x_ND.to(torch.float32), self.weight.to(torch.float32)).sigmoid()

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        N = scores_NE.shape[0]
        choice_NE = scores_NE + self.e_score_correction_bias.to(torch.float32)
        group_scores_NG = choice_NE.view(N, self.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
        group_idx = torch.topk(group_scores_NG, k=self.topk_group, dim=-1, sorted=False).indices
        group_mask_NG = torch.zeros_like(group_scores_NG).scatter_(1, group_idx, 1).bool()
        expert_mask_NE = group_mask_NG[:, :, None].expand(N, self.n_group, self.num_experts // self.n_group)
        choice_NE = choice_NE.masked_fill(~expert_mask_NE.reshape(N, -1), float("-inf"))
        return torch.topk(choice_NE, k=self.top_k, dim=-1, sorted=False).indices

    def gate_weights(self, scores_NE: torch.Tensor, ids_NK: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        del act_dtype  # DeepSeek keeps the gate weights in float32; unpermute multiplies in float32
        weights_NK = scores_NE.gather(1, ids_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_NK * self.routed_scaling_factor


class Experts(nn.Module):
    """E SwiGLU experts stored fused, computed with kernels.moe's permute -> grouped_mm -> unpermute.

    `backend` picks kernels.moe.grouped_mm's backend ("auto", "loop", "grouped").

    Three hooks, all off by default (the plain path is unchanged, bitwise):
    - `lora`: None, or a module (models.lora.ExpertsLoRA, set by apply_lora) called as
      `lora(name, x_MX, out_MF, state, backend)` after each grouped GEMM (state: the kernels.moe.PermState of the
      permutation, whose order_M tells each routed row's token); it returns out plus the adapter's per-expert
      low-rank update, itself computed with grouped GEMMs (docs/lora.md).
    - `quantize_()` swaps the fused Parameters for frozen kernels.quant4.Packed4Weight modules under the same names;
      those are dequantized one expert at a time inside the GEMM (docs/quant4.md). `dequantize_()` undoes it.
    - `dispatcher`: None, or an object (services/trainer/engine/parallel/expert.py, set with the expert-parallel
      split) called as `dispatcher(self, x_ND, ids_NK, weights_NK)` in place of the local permute -> GEMMs ->
      unpermute; it sends the routed rows to the ranks holding their experts and runs `expert_mlp` there.

    Which experts the module holds: `num_experts` of them, global ids first_expert .. first_expert + num_experts - 1
    out of the layer's total_experts (all of them, 0 .. E - 1, unless expert parallelism split the layer).
    """

    WEIGHT_NAMES = ("gate_up_proj", "down_proj")

    def __init__(self, args: MoEArgs):
        super().__init__()
        E, D, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.num_experts, self.first_expert, self.total_experts = E, 0, E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        nn.init.normal_(self.gate_up_proj, std=INIT_STD)
        nn.init.normal_(self.down_proj, std=INIT_STD)
        self.backend = "auto"
        self.lora: nn.Module | None = None
        self.dispatcher = None

    def forward(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        """Sum over each token's K experts of weight * expert(x), [N, D]; ids_NK are global expert ids."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x_ND, ids_NK, weights_NK)
        x_MD, state = permute(x_ND, ids_NK, self.num_experts)
        return unpermute(self.expert_mlp(x_MD, state), weights_NK, state)

    def expert_mlp(self, x_MD: torch.Tensor, state: PermState) -> torch.Tensor:
        """The held experts' SwiGLU MLPs on rows grouped by expert (state.counts_E rows each, in held order)."""
        gate_up_M2I = self._project("gate_up_proj", x_MD, state)
        gate_MI, up_MI = gate_up_M2I.chunk(2, dim=-1)
        h_MI = swiglu(gate_MI, up_MI)
        return self._project("down_proj", h_MI, state)

    def _project(self, name: str, x_MX: torch.Tensor, state: PermState) -> torch.Tensor:
        weight = getattr(self, name)
        if isinstance(weight, Packed4Weight):
            out_MF = quant4_grouped_mm(x_MX, weight, state.counts_E)
        else:
            out_MF = grouped_mm(x_MX, weight, state.counts_E, layout="EFD", backend=self.backend)
        if self.lora is not None:
            out_MF = self.lora(name, x_MX, out_MF, state, self.backend)
        return out_MF

    @property
    def is_quantized(self) -> bool:
        return any(isinstance(getattr(self, name), Packed4Weight) for name in self.WEIGHT_NAMES)

    def weight_nbytes(self) -> int:
        """Bytes the fused expert weights occupy (packed buffers and scales when quantized)."""
        return sum(
            w.nbytes if isinstance(w, Packed4Weight) else w.numel() * w.element_size()
            for w in (getattr(self, name) for name in self.WEIGHT_NAMES)
        )

    def quantize_(self, fmt: str = "nf4", block_size: int = 64) -> None:
        """Replace both fused weights by frozen 4-bit Packed4Weight modules (kernels/quant4.py); in place."""
        if self.is_quantized:
            raise ValueError("These experts are already quantized; dequantize_() them first to change the format")
        if getattr(self.lora, "merged_adapter", None) is not None:
            raise ValueError(
                f"LoRA adapter {self.lora.merged_adapter!r} is merged into the expert weights; unmerge_adapter it "
                "before quantizing (the adapter keeps working on top of the 4-bit experts)"
            )
        packed = {name: Packed4Weight.quantize(getattr(self, name), fmt, block_size) for name in self.WEIGHT_NAMES}
        for name, weight in packed.items():
            delattr(self, name)
            setattr(self, name, weight)

    def dequantize_(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Back to frozen (requires_grad=False) Parameters holding the dequantized values, in `dtype`."""
        for name in self.WEIGHT_NAMES:
            weight = getattr(self, name)
            if isinstance(weight, Packed4Weight):
                delattr(self, name)
                setattr(self, name, nn.Parameter(weight.dequantize(dtype), requires_grad=False))


def require_whole_experts(module: nn.Module, action: str) -> None:
    """Raise unless every routed-expert block holds all its layer's experts: a model split by expert parallelism
    holds a slice (its experts renumbered from 0), which a checkpoint must not take for the whole."""
    for name, m in module.named_modules():
        if isinstance(m, Experts) and m.num_experts != m.total_experts:
            raise ValueError(
                f"cannot {action}: {name} holds experts {m.first_expert}..{m.first_expert + m.num_experts - 1} of "
                f"{m.total_experts} (expert parallelism); gather the whole expert tensors first"
            )


def quantize_experts_(module: nn.Module, fmt: str = "nf4", block_size: int = 64) -> int:
    """Quantize every routed-expert block in `module` (a model, a MoE block or an Experts) to 4 bits in place and
    return how many there were. The experts become frozen; LoRA on them keeps training (docs/quant4.md)."""
    blocks = [m for m in module.modules() if isinstance(m, Experts)]
    if not blocks:
        raise ValueError(f"{type(module).__name__} has no routed experts (models.moe.Experts) to quantize")
    for experts in blocks:
        experts.quantize_(fmt, block_size)
    return len(blocks)


def dequantize_experts_(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Undo quantize_experts_: frozen `dtype` Parameters holding the dequantized (not the original) values."""
    for m in module.modules():
        if isinstance(m, Experts):
            m.dequantize_(dtype)


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) for one decoder layer; a drop-in for the layer's `mlp`."""

    def __init__(self, args: MoEArgs, layer_idx: int):
        super().__init__()
        self.args, self.layer_idx = args, layer_idx
        self.gate = SoftmaxRouter(args) if args.router == "softmax" else SigmoidGroupRouter(args)
        self.experts = Experts(args)
        self.shared_experts = None
        if args.n_shared_experts > 0:
            shape = MLPShape(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
            self.shared_experts = MLP(shape)

    def forward(self, x_BTD: torch.Tensor, routing: RouterReplay | None = None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        scores_NE = self.gate.scores(x_ND)
        with torch.no_grad():
            ids_NK = self.gate.select(scores_NE)
        if routing is not None:
            ids_NK = routing.route(self.layer_idx, ids_NK.view(B, T, -1), self.args.num_experts).reshape(B * T, -1)
        weights_NK = self.gate.gate_weights(scores_NE, ids_NK, x_BTD.dtype)
        out_BTD = self.experts(x_ND, ids_NK, weights_NK).view(B, T, D)
        if self.shared_experts is not None:
            out_BTD = out_BTD + self.shared_experts(x_BTD)
        return out_BTD
