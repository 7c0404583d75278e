"""FSDP2 (torch.distributed.fsdp.fully_shard) over a CausalLM: parameters, gradients and optimizer state sharded.

Units, innermost first (each unit all-gathers its parameters before its forward / backward and reduce-scatters its
gradients after its backward):
1. with ep > 1, each MoE layer's routed experts (models.moe.Experts: its local experts after expert parallelism,
   plus their LoRA tensors) on mesh["efsdp"]: expert weights are already split over ep, so they are sharded over
   the ranks left over (dp_shard_mod_ep);
2. each decoder layer (model.model.layers[i]) on the dense shard mesh;
3. the root (the CausalLM): embeddings, final norm and lm_head, one tied Parameter counted once. The root keeps its
   parameters unsharded after forward (FSDP2's own rule for the root): the engine's logprob head reads lm_head's
   weight after the model's forward (services/trainer/engine/logprobs.py), and backward needs them next anyway.

The dense shard mesh is mesh["dp_shard_cp"] (cp ranks hold the same weights and are part of the shard group), or
with dp_replicate > 1 the 2-D mesh ("dp_replicate", "dp_shard_cp"): HSDP, sharded within a replica and all-reduced
across replicas.

Every parameter is sharded on dim 0 (Shard(0), FSDP2's default): a DTensor whose local tensor is this rank's chunk
of rows (torch.chunk sizes). Frozen parameters (a LoRA base) are sharded the same way; FSDP2 reduce-scatters only
the gradients that exist, so a unit mixing frozen base weights and trainable adapters needs no special grouping
(its trainable parameters must share one dtype: the adapters are float32).

Gradient semantics: the engine's loss is c * sum_i datum_loss_i over all of a call's datums, each data-parallel rank
backpropagating its own datums' unscaled sum, so the gradient is the SUM over data-parallel ranks. FSDP2 averages by
default (divides by the shard group's size, and HSDP by the replica count too); every unit's divide factor is set
to 1 with SUM-only collectives (a factor alone would become NCCL's PREMUL_SUM(1), which gloo lacks), so the
reduce-scatter (and HSDP's all-reduce) sums and nothing divides. Order of the sum: the collective's, so the result
agrees with the single-process gradient to float32 rounding, not bitwise.

Mixed precision (mixed_precision): on CUDA the compute copy is bf16 and gradients are reduced in float32; on the
CPU everything stays float32. A LoRA base on CUDA is already stored in bf16 (engine.training_dtype) and its float32
adapters must stay float32 (models.lora), so LoRA runs with no parameter cast.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from models.moe import Experts
from services.trainer.engine.parallel.dims import ParallelDims


def mixed_precision(device: torch.device, *, full_parameter: bool) -> MixedPrecisionPolicy:
    """bf16 compute + float32 gradient reduction on CUDA (full-parameter: float32 master weights cast to bf16 for
    compute; LoRA: no cast, the base is stored in bf16 and the adapter in float32), float32 throughout on the CPU."""
    if device.type != "cuda":
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if full_parameter else None, reduce_dtype=torch.float32)


def dense_shard_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh the dense parameters are sharded over: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP."""
    return mesh[("dp_replicate", "dp_shard_cp")] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]


def expert_shard_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh the (expert-parallel, local) routed experts are sharded over: efsdp, with dp_replicate outside."""
    return mesh[("dp_replicate", "efsdp")] if dims.dp_replicate > 1 else mesh["efsdp"]


def apply_fsdp(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool = True) -> list[FSDPModule]:
    """fully_shard the units listed in the module docstring, in place; returns them innermost first.

    reshard_after_forward: free each layer's gathered parameters after its forward and gather them again for its
    backward (ZeRO-3, the least memory), or keep them until the backward (ZeRO-2 style, one all-gather fewer per
    layer). The root always keeps them (see the module docstring)."""
    dense = dense_shard_mesh(mesh, dims)
    units: list[FSDPModule] = []
    for layer in model.model.layers.values():
        if dims.ep > 1:
            for experts in [m for m in layer.modules() if isinstance(m, Experts)]:
                units.append(fully_shard(experts, mesh=expert_shard_mesh(mesh, dims), mp_policy=mp_policy,
                                         reshard_after_forward=reshard_after_forward))
        units.append(fully_shard(layer, mesh=dense, mp_policy=mp_policy,
                                 reshard_after_forward=reshard_after_forward))
    units.append(fully_shard(model, mesh=dense, mp_policy=mp_policy, reshard_after_forward=False))
    for unit in units:  # a SUM over data-parallel ranks (module docstring): divide by 1, with plain SUM collectives
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units
