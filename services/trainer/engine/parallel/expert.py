"""Expert parallelism (EP): each MoE layer's routed experts split over the ranks of the ep group, tokens sent to the
experts that own them with all_to_all and back.

Shapes: N tokens on this rank, K experts per token, M = N * K routed rows sent, R rows received, D hidden, E the
layer's experts, P = ep ranks, n = E / ep experts held per rank, F a tensor's output features, r a LoRA rank.

Split (apply_expert_parallel): rank p of the ep group (mesh["ep"]) keeps experts p * n .. (p + 1) * n - 1 of every
models.moe.Experts as plain Parameters under their own names (gate_up_proj [n, 2I, D], down_proj [n, D, I]), so the
state-dict keys are the whole model's; FSDP then shards them over mesh["efsdp"]. 4-bit frozen experts
(kernels.quant4.Packed4Weight: packed [n, F, D/2], scales [n, F, D/B]) and expert LoRA adapters (lora_A [n*r, D],
lora_B [F, r*n]: columns j*n + e) are split the same way. It works on a meta-device model (split before loading:
expert_shards says which slice of each checkpoint tensor a rank loads) as well as on a loaded one. The router and the
DeepSeek shared experts are not touched (replicated, like every dense weight): every rank routes its own tokens.

Forward of one layer (ExpertDispatcher, the Experts `dispatcher` hook; models/moe.py stays the one implementation):
1. permute this rank's N tokens into M rows grouped by global expert id (kernels.moe.permute); since rank p holds a
   contiguous block of experts, the rows are also grouped by destination rank;
2. exchange the per-expert row counts (an all_to_all of E integers; one host sync: the splits must be known);
3. all_to_all the rows with uneven splits: rank p receives R rows ordered (source rank, held expert, source order);
4. regroup them by held expert (stable: per expert, source 0's rows first, then source 1's ...), run the held
   experts' grouped GEMMs (Experts.expert_mlp, LoRA and 4-bit included), put them back in received order;
5. all_to_all them back (the reverse splits) and combine each token's K rows with its gate weights in the original
   order (kernels.moe.unpermute).
Both all_to_alls are autograd-aware (_AllToAll: the backward is the reverse all_to_all), so the gradient of a held
expert sums over every rank's tokens routed to it: with data-parallel ranks feeding different tokens, each rank's
expert gradients are those of all the group's tokens, and the dense (replicated) gradients stay per-rank partial
sums, reduced by data parallelism as usual.

Exactness: for the same routes, an expert row's output is the same product as on one process; only summation orders
differ (expert weight gradients accumulate rows per source rank, float32 differences ~1e-6 relative). Router replay
(models.moe.RouterReplay) acts before the dispatcher, so it records and forces the same ids as on one process.

Every rank of the group must run the same MoE layers in the same order (forward and backward): the collectives pair
up by order. A rank whose experts receive no row still runs them on zero rows, so its expert weights and adapters get
zero gradients (not None), as FSDP's reduce-scatter needs on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kernels.moe import PermState, permute, unpermute
from kernels.quant4 import Packed4Weight
from models.lora_layers import row_adapters
from models.moe import Experts

__all__ = ["ExpertDispatcher", "ExpertShard", "apply_expert_parallel", "expert_layout", "expert_shards"]


@dataclass(frozen=True)
class ExpertShard:
    """Where a held expert tensor lies in the whole layer's: view the whole tensor as view_shape, narrow dimension
    `dim` to start .. start + length (the held experts) and reshape to the held tensor's shape. For fused weights,
    4-bit buffers and lora_A the expert dimension is dimension 0 (lora_A viewed as [E, r, D]); lora_B [F, r*E] is
    viewed as [F, r, E] (dimension 2)."""

    global_shape: tuple[int, ...]
    view_shape: tuple[int, ...]
    dim: int
    start: int
    length: int

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """The held part of a whole tensor (a new tensor unless it is already contiguous), held shape."""
        assert tuple(whole.shape) == self.global_shape, (tuple(whole.shape), self.global_shape)
        part = whole.view(self.view_shape).narrow(self.dim, self.start, self.length)
        return part.reshape(self._local_shape())

    def put(self, whole: torch.Tensor, held: torch.Tensor) -> None:
        """Write a rank's held tensor into its place of the whole one (checkpoint gather), in place."""
        assert tuple(whole.shape) == self.global_shape, (tuple(whole.shape), self.global_shape)
        local_view = [*self.view_shape]
        local_view[self.dim] = self.length
        whole.view(self.view_shape).narrow(self.dim, self.start, self.length).copy_(held.reshape(local_view))

    def _local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        expert_dim = 0 if self.dim == 0 else len(shape) - 1  # lora_B: the expert index is the last (fastest) one
        shape[expert_dim] = shape[expert_dim] * self.length // self.view_shape[self.dim]
        return tuple(shape)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits along dimension 0; the backward is the reverse all_to_all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None


class ExpertDispatcher:
    """The Experts `dispatcher` hook of an expert-parallel group (see the module docstring, steps 1-5)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, experts: Experts, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        if experts.lora is not None and row_adapters() is not None:
            raise ValueError("per-row LoRA adapters (models.lora.per_row_adapters) are for serving on one process; "
                             "expert-parallel experts take one active adapter")
        ep, n = self.size, experts.num_experts
        x_MD, state = permute(x_ND, ids_NK, experts.total_experts)
        # recv_counts[s * n + j]: rows source rank s sends to held expert j
        recv_counts = torch.empty_like(state.counts_E)
        dist.all_to_all_single(recv_counts, state.counts_E, group=self.group)
        send_splits_P = state.counts_E.view(ep, n).sum(dim=1)
        recv_counts_PN = recv_counts.view(ep, n)
        splits = torch.cat([send_splits_P, recv_counts_PN.sum(dim=1)]).tolist()  # .tolist() syncs: splits are sizes
        send_splits, recv_splits = splits[:ep], splits[ep:]
        recv_RD = _AllToAll.apply(x_MD, recv_splits, send_splits, self.group)

        R = recv_RD.shape[0]
        held_R = torch.repeat_interleave(torch.arange(n, device=recv_counts.device).repeat(ep), recv_counts,
                                         output_size=R)
        order_R = torch.sort(held_R, stable=True).indices
        inverse_R = torch.empty_like(order_R)
        inverse_R[order_R] = torch.arange(R, device=order_R.device)
        held_state = PermState(order_R, inverse_R, recv_counts_PN.sum(dim=0), num_tokens=R, top_k=1)
        out_RD = experts.expert_mlp(recv_RD[order_R], held_state)[inverse_R]

        out_MD = _AllToAll.apply(out_RD, send_splits, recv_splits, self.group)
        return unpermute(out_MD, weights_NK, state)


def _experts_blocks(model: nn.Module) -> list[tuple[str, Experts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]


def _tensor_shards(experts: Experts) -> dict[str, ExpertShard]:
    """ExpertShard of every state-dict tensor of one (split) Experts module, by its name within the module."""
    E, n, first = experts.total_experts, experts.num_experts, experts.first_expert
    out = {}
    for name, tensor in experts.state_dict(keep_vars=True).items():
        shape = list(tensor.shape)
        if ".lora_B." in f".{name}":
            F, rn = shape
            r = rn // n
            out[name] = ExpertShard((F, r * E), (F, r, E), 2, first, n)
        else:
            rows_per_expert = shape[0] // n  # lora_A: r rows per expert; weights and 4-bit buffers: 1
            whole = (E * rows_per_expert, *shape[1:])
            out[name] = ExpertShard(whole, (E, rows_per_expert, *shape[1:]), 0, first, n)
    return out


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """For every state-dict tensor of the model's split expert blocks (fused weights or their 4-bit buffers, and
    expert LoRA tensors), keyed by its model state-dict name: which slice of the whole model's tensor this rank
    holds. A checkpoint loader takes `shard.take(whole)`; a gatherer writes each rank's tensor with `shard.put`.
    Tensors not listed (everything else) are whole on every rank. (lora_state_dict's peft keys name the same
    Parameters: match them by identity with model.named_parameters.)"""
    return {f"{path}.{name}": shard for path, experts in _experts_blocks(model)
            if experts.num_experts < experts.total_experts
            for name, shard in _tensor_shards(experts).items()}


def expert_layout(model: nn.Module) -> dict[str, ExpertShard]:
    """Like expert_shards, for every routed-expert block whether split or not (an unsplit block holds the whole:
    start 0, length E): the whole tensor's shape and expert dimension, the same for every ep. The distributed
    checkpoint stores each expert tensor whole in this layout (parallel/sharded_checkpoint.py)."""
    return {f"{path}.{name}": shard for path, experts in _experts_blocks(model)
            for name, shard in _tensor_shards(experts).items()}


def _split(experts: Experts, rank: int, ep: int) -> None:
    """Keep experts rank * n .. (rank + 1) * n - 1 of one block (weights, 4-bit buffers, LoRA), in place."""
    n = experts.total_experts // ep
    first = rank * n
    for name in Experts.WEIGHT_NAMES:
        weight = getattr(experts, name)
        if isinstance(weight, Packed4Weight):
            weight.packed = weight.packed[first:first + n].clone()
            weight.scales = weight.scales[first:first + n].clone()
        else:
            held = weight.detach()[first:first + n].clone()
            setattr(experts, name, nn.Parameter(held, requires_grad=weight.requires_grad))
    experts.num_experts, experts.first_expert = n, first
    lora = experts.lora
    if lora is None:
        return
    r_of = {}
    for adapter, tensors in lora.lora_A.items():
        for weight, A in list(tensors.items()):
            r = A.shape[0] // lora.num_experts
            r_of[adapter] = r
            tensors[weight] = nn.Parameter(A.detach()[first * r:(first + n) * r].clone(),
                                           requires_grad=A.requires_grad)
    for adapter, tensors in lora.lora_B.items():
        for weight, B in list(tensors.items()):
            F_, r = B.shape[0], r_of[adapter]
            held = B.detach().view(F_, r, lora.num_experts)[:, :, first:first + n].reshape(F_, r * n)
            tensors[weight] = nn.Parameter(held, requires_grad=B.requires_grad)
    lora.num_experts, lora.first_expert = n, first
    lora.shapes = {name: (n, *shape[1:]) for name, shape in lora.shapes.items()}


def apply_expert_parallel(model: nn.Module, mesh, dims) -> int:
    """Split every MoE layer's routed experts over mesh["ep"] (a 1-D submesh of size dims.ep) and route their tokens
    with all_to_all (module docstring); in place, before or after the weights are loaded. Returns the number of
    expert blocks split (0 with dims.ep == 1: nothing to do). Run it before FSDP wraps the experts (on
    mesh["efsdp"]) and before the optimizer is built: the expert Parameters are replaced."""
    if dims.ep == 1:
        return 0
    blocks = _experts_blocks(model)
    if not blocks:
        raise ValueError(f"ep {dims.ep} needs routed experts (models.moe.Experts); {type(model).__name__} has none")
    ep_mesh = mesh["ep"]
    if ep_mesh.size() != dims.ep:
        raise ValueError(f"mesh['ep'] has {ep_mesh.size()} ranks but dims.ep is {dims.ep}")
    rank = ep_mesh.get_local_rank()
    dispatcher = ExpertDispatcher(ep_mesh.get_group())
    for path, experts in blocks:
        if experts.num_experts != experts.total_experts:
            raise ValueError(f"{path} is already split over ranks ({experts.num_experts} of "
                             f"{experts.total_experts} experts held)")
        if experts.total_experts % dims.ep:
            raise ValueError(f"{path} has {experts.total_experts} experts, which do not split evenly over ep "
                             f"{dims.ep}")
        _split(experts, rank, dims.ep)
        experts.dispatcher = dispatcher
    return len(blocks)
