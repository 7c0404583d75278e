"""The one place parallelism is applied to a model, and the sharded model built from a model directory.

    build_parallel_model(model_dir, dims, mesh, lora=..., seed=..., device=...)
        1. the family's CausalLM on the meta device (no memory), its dtypes set as engine.training_dtype says
        2. LoRA added (adapter tensors on the CPU, drawn from the seed exactly as on a loaded model) or every
           weight made trainable
        3. parallelize(model, dims, mesh, ...)
        4. materialize: to_empty on the device, then the Hugging Face weights loaded into the sharded parameters
           (load_hf_weights) and the adapter's initial values copied in

    parallelize(model, dims, mesh, ...), in this fixed order (torchtitan's):
        (pipeline split: done by the caller, one stage per rank's model, models.common.pipeline)
        -> expert parallel (parallel/expert.py)  -> context parallel (parallel/context.py: the attention modules
           attend as a ring over mesh["cp"]; the engine then lays out every micro-batch with the model's
           ContextParallel, context_parallel_of(model), see forward_backward.py)
        -> activation checkpointing (before fully_shard: the recomputation runs inside each layer's FSDP unit)
        -> FSDP (parallel/fsdp.py)
    A dimension whose application is not wired here yet is refused by name (InvalidArgument on the knob), so nothing
    runs silently unparallelized along it.

Loading the weights: each rank reads the safetensors files itself, one decoder layer at a time (the family's
state_dict_adapter turns a layer's Hugging Face tensors into ours, fusing per-expert tensors), and keeps only its
shard of each tensor (torch.distributed.tensor.distribute_tensor with src_data_rank=None: every rank holds the
full tensor, so each takes its chunk locally, no communication). A rank's peak is one layer's full tensors, not the
model. Broadcasting from rank 0 (set_model_state_dict(broadcast_from_rank0=True)) would read the disk once but
hold the whole model on rank 0 and send every tensor over the network; a shared filesystem makes the per-rank read
cheaper. Reading only the rank's rows of each tensor (safetensors slices) is the next step for very large models;
the fused expert layout makes it per-tensor work.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from models.families import family_for_config
from models.lora import LoraConfig, apply_lora, set_trainable
from models.model_dir import read_config, weight_files
from services.common.errors import InvalidArgument
from services.trainer.engine.parallel.checkpointing import apply_activation_checkpointing
from services.trainer.engine.parallel.context import apply_context_parallel
from services.trainer.engine.parallel.dims import ParallelDims
from services.trainer.engine.parallel.expert import apply_expert_parallel, expert_shards
from services.trainer.engine.parallel.fsdp import apply_fsdp, mixed_precision

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _refuse_unapplied(dims: ParallelDims) -> None:
    """Dimensions whose application is not in parallelize yet (see the module docstring)."""
    unapplied = {"pp": "pipeline parallelism (a pipeline schedule over the engine)", "tp": "tensor parallelism"}
    for knob, what in unapplied.items():
        if getattr(dims, knob) > 1:
            raise InvalidArgument(f"{knob} {getattr(dims, knob)}: {what} is not available in this trainer yet; "
                                  f"set {knob} to 1", field=dims._field(knob))


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
                reshard_after_forward: bool = True) -> None:
    """Apply dims to model (a CausalLM or a pipeline stage of one, normally on the meta device), in place, in the
    module docstring's order. param_dtype / reduce_dtype: FSDP's mixed precision (fsdp.mixed_precision picks them
    from the device; None keeps each parameter's dtype for compute)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _refuse_unapplied(dims)
    dims.check_model(model.args)
    apply_expert_parallel(model, mesh, dims)  # each MoE layer keeps num_experts / ep experts; tokens over mesh["ep"]
    apply_context_parallel(model, mesh, dims)  # attention as a ring over mesh["cp"]; context.context_parallel_of
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, dims, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
               reshard_after_forward=reshard_after_forward)


def build_parallel_model(model_dir: str | Path, dims: ParallelDims, mesh: DeviceMesh, *, lora: LoraConfig | None,
                         seed: int, device: torch.device, dtype: torch.dtype, activation_checkpointing: bool = False,
                         reshard_after_forward: bool = True) -> tuple[nn.Module, list[nn.Parameter]]:
    """(the sharded model in train mode, its trainable parameters) of a model directory: the module docstring's
    four steps. dtype: the stored weights' dtype (engine.training_dtype); the parameters come back in the order
    the single-process engine lists them (apply_lora's, or model.parameters()), so optimizer states line up."""
    config = read_config(model_dir)
    family = family_for_config(config)
    args = family.ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = family.CausalLM(args)
    _set_dtypes(model, dtype, _float32_pattern(family))
    args.torch_dtype = str(dtype).removeprefix("torch.")
    if lora is not None:
        trainable = apply_lora(model, lora, seed=seed, device="cpu")
    else:
        trainable = set_trainable(model, "full")
    names = {id(p): n for n, p in model.named_parameters()}
    trainable_names = [names[id(p)] for p in trainable]
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}  # the adapter's init
    mp = mixed_precision(device, full_parameter=lora is None)
    parallelize(model, dims, mesh, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                activation_checkpointing=activation_checkpointing, reshard_after_forward=reshard_after_forward)
    model.to_empty(device=device)
    load_hf_weights(model, model_dir, family)
    targets, held = model.state_dict(), expert_shards(model)
    with torch.no_grad():
        for name, tensor in initial.items():
            copy_full_into(targets[name], held[name].take(tensor) if name in held else tensor)
    params = dict(model.named_parameters())
    return model.train(), [params[n] for n in trainable_names]


def _float32_pattern(family) -> re.Pattern:
    """Tensors the family keeps in float32 whatever the load dtype (models.checkpoint.load_pretrained's rule)."""
    return re.compile("|".join(getattr(family.state_dict_adapter, "FLOAT32_PARAMETERS", ())) or r"(?!)")


def _set_dtypes(model: nn.Module, dtype: torch.dtype, keep_fp32: re.Pattern) -> None:
    """The meta model's floating tensors in dtype, those keep_fp32 names in float32 (load_pretrained's dtypes)."""
    if dtype == torch.float32:
        return
    model.to(dtype)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if keep_fp32.search(name):
            t.data = t.data.to(torch.float32)


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter or buffer: a DTensor takes this rank's shard of it."""
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(f"shape {tuple(full.shape)} does not fit the model's {tuple(target.shape)}")
    full = full.to(target.dtype)
    if isinstance(target, DTensor):
        shard = distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def load_hf_weights(model: nn.Module, model_dir: str | Path, family) -> None:
    """Load a model directory's weights into model's (sharded, materialized) parameters and buffers, one decoder
    layer at a time (module docstring). Every key the model expects must come (LoRA tensors and a tied lm_head
    excepted, as in models.checkpoint.load_pretrained); a missing or surplus key or a wrong shape is a ValueError."""
    adapter, args = family.state_dict_adapter, model.args
    targets, held = model.state_dict(), expert_shards(model)  # expert parallelism: a rank holds some experts
    expected = adapter.expected_keys(list(targets), args)
    locations: dict[str, list[tuple[Path, str]]] = defaultdict(list)  # layer (or "") -> (file, key)
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                match = _LAYER.match(key)
                locations[match.group(1) if match else ""].append((file, key))
    loaded: set[str] = set()
    for group in sorted(locations, key=lambda g: -1 if g == "" else int(g)):
        hf_state, by_file = {}, defaultdict(list)
        for file, key in locations[group]:
            by_file[file].append(key)
        for file, keys in by_file.items():  # each file opened once per layer, not once per tensor
            with safe_open(file, framework="pt", device="cpu") as f:
                hf_state.update((key, f.get_tensor(key)) for key in keys)
        for key, full in adapter.from_hf(hf_state, args).items():
            if key not in expected:
                raise ValueError(f"Checkpoint in {str(model_dir)!r} does not match {args.architecture}: unexpected "
                                 f"key {key}")
            try:
                copy_full_into(targets[key], held[key].take(full) if key in held else full)
            except ValueError as e:
                raise ValueError(f"Checkpoint in {str(model_dir)!r}: {key}: {e}") from None
            loaded.add(key)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"Checkpoint in {str(model_dir)!r} does not match {args.architecture}: missing keys "
                         f"[{', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}]")
