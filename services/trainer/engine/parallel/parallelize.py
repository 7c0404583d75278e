"""The one place parallelism is applied to a model, and the sharded model built from a model directory.

    build_parallel_model(model_dir, dims, mesh, lora=..., seed=..., device=...)
        1. the family's CausalLM on the meta device (no memory), its dtypes set as engine.training_dtype says
        2. LoRA added (adapter tensors on the CPU, drawn from the seed exactly as on a loaded model) or every
           weight made trainable
        3. parallelize(model, dims, mesh, ...)
        4. materialize: to_empty on the device, then the Hugging Face weights loaded into the sharded parameters
           (load_hf_weights) and the adapter's initial values copied in

    parallelize(model, dims, mesh, ...), in this fixed order (torchtitan's):
        (pipeline split, pp > 1: build_parallel_model cuts the whole meta model into this rank's stages first,
         pipeline.split_model, and applies the rest to each stage over the rank's pp slice of the mesh)
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

from models.checkpoint import _stage_holds as stage_holds
from models.families import family_for_config
from models.lora import LoraConfig, apply_lora, set_trainable
from models.model_dir import read_config, weight_files
from services.common.errors import InvalidArgument
from services.trainer.engine.parallel.checkpointing import apply_activation_checkpointing
from services.trainer.engine.parallel.context import apply_context_parallel
from services.trainer.engine.parallel.dims import ParallelDims
from services.trainer.engine.parallel.expert import apply_expert_parallel, expert_shards
from services.trainer.engine.parallel.fsdp import apply_fsdp, mixed_precision
from services.trainer.engine.parallel.pipeline import apply_stage_lora, schedule_spec, split_model

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _refuse_unapplied(dims: ParallelDims) -> None:
    """Dimensions whose application is not in parallelize yet (see the module docstring)."""
    if dims.tp > 1:
        raise InvalidArgument(f"tp {dims.tp}: tensor parallelism is not available in this trainer yet; set tp to 1",
                              field=dims._field("tp"))
    if dims.pp > 1 and dims.pipeline_schedule == "zbv":  # torch's split weight backward cannot find the gradient
        # accumulators of FSDP's unsharded parameters (stage_backward_weight: KeyError); pipeline.py runs it unsharded
        raise InvalidArgument("pipeline schedule zbv is not available in the engine (its split weight backward does "
                              "not work with sharded stages); use gpipe, 1f1b or interleaved_1f1b",
                              field=dims._field("pipeline_schedule"))


def _check(dims: ParallelDims, model: nn.Module) -> None:
    """What parallelize refuses for this model (a CausalLM or a stage of one): unapplied dimensions, then
    ParallelDims.check_model with the pipeline's stages in all (pp times the schedule's stages per rank)."""
    _refuse_unapplied(dims)
    dims.check_model(model.args, pp_stages=dims.pp * schedule_spec(dims.pipeline_schedule).stages_per_rank)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
                reshard_after_forward: bool = True) -> None:
    """Apply dims to model (a CausalLM or a pipeline stage of one, normally on the meta device), in place, in the
    module docstring's order. param_dtype / reduce_dtype: FSDP's mixed precision (fsdp.mixed_precision picks them
    from the device; None keeps each parameter's dtype for compute). A stage is parallelized over its own part of
    the mesh: every sub-mesh below (mesh["dp_shard_cp"], mesh["ep"], ...) is this rank's pp slice's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _check(dims, model)
    apply_expert_parallel(model, mesh, dims)  # each MoE layer keeps num_experts / ep experts; tokens over mesh["ep"]
    apply_context_parallel(model, mesh, dims)  # attention as a ring over mesh["cp"]; context.context_parallel_of
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, dims, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
               reshard_after_forward=reshard_after_forward)


def build_parallel_model(model_dir: str | Path, dims: ParallelDims, mesh: DeviceMesh, *, lora: LoraConfig | None,
                         seed: int, device: torch.device, dtype: torch.dtype, activation_checkpointing: bool = False,
                         reshard_after_forward: bool = True
                         ) -> tuple[list[tuple[int, nn.Module]], nn.Module, list[nn.Parameter]]:
    """(this rank's models in train mode, as (pipeline stage index, CausalLM stage) pairs, one (0, the whole model)
    without pp; the whole model on the meta device; their trainable parameters) of a model directory: the module
    docstring's four steps, with pp > 1 the whole meta model first cut into this rank's stages
    (pipeline.split_model under dims.pipeline_schedule) and each stage parallelized and loaded alone (its own
    tensors). dtype: the stored weights' dtype (engine.training_dtype); the parameters come back in the order the
    single-process engine lists them (apply_lora's, or model.parameters(); a stage's: the same order restricted to
    the stage), so optimizer states line up."""
    config = read_config(model_dir)
    family = family_for_config(config)
    args = family.ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        whole = family.CausalLM(args)
    _set_dtypes(whole, dtype, _float32_pattern(family))
    args.torch_dtype = str(dtype).removeprefix("torch.")
    if dims.pp > 1:
        _check(dims, whole)  # before the split (parallelize checks each stage again)
        stages = split_model(whole, mesh["pp"].get_local_rank(), dims.pp, dims.pipeline_schedule)
    else:
        stages = [(0, whole)]
    models = [m for _, m in stages]
    if lora is not None:
        trainable = (apply_stage_lora(models, whole, lora, seed, device="cpu") if dims.pp > 1
                     else apply_lora(whole, lora, seed=seed, device="cpu"))
    else:
        trainable = [p for m in models for p in set_trainable(m, "full")]
    where = {id(p): (i, n) for i, m in enumerate(models) for n, p in m.named_parameters()}
    trainable_names = [where[id(p)] for p in trainable]
    mp = mixed_precision(device, full_parameter=lora is None)
    for model in models:
        initial = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}  # the adapter's init
        parallelize(model, dims, mesh, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                    activation_checkpointing=activation_checkpointing, reshard_after_forward=reshard_after_forward)
        model.to_empty(device=device)
        load_hf_weights(model, model_dir, family)
        targets, held = model.state_dict(), expert_shards(model)
        with torch.no_grad():
            for name, tensor in initial.items():
                copy_full_into(targets[name], held[name].take(tensor) if name in held else tensor)
        model.train()
    params = [dict(m.named_parameters()) for m in models]
    return stages, whole, [params[i][n] for i, n in trainable_names]


def local_shape(shape: tuple[int, ...], dims: ParallelDims, mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's part of a dense parameter of this (whole) shape once FSDP shards it (fsdp.py: Shard(0) over the
    dense shard mesh, replicated over dp_replicate under HSDP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from services.trainer.engine.parallel.fsdp import dense_shard_mesh

    dense = dense_shard_mesh(mesh, dims)
    placements = [Replicate()] * (dense.ndim - 1) + [Shard(0)]
    return tuple(compute_local_shape_and_global_offset(shape, dense, placements)[0])


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
    excepted, as in models.checkpoint.load_pretrained); a missing or surplus key or a wrong shape is a ValueError.
    model may be a pipeline stage (models/common/pipeline.py): then only the tensors it holds are read (the layers
    it does not hold are skipped whole), only those are expected, and a last stage whose lm_head is tied to
    embeddings it does not hold reads model.embed_tokens.weight into it (models.checkpoint.load_weights' rules)."""
    adapter, args = family.state_dict_adapter, model.args
    targets, held = model.state_dict(), expert_shards(model)  # expert parallelism: a rank holds some experts
    expected = adapter.expected_keys(list(targets), args)
    tied_head = bool(args.tie_word_embeddings) and model.lm_head is not None and model.model.embed_tokens is None
    if tied_head:
        expected.add("lm_head.weight")
    whole = (len(model.model.layers) == args.num_layers
             and None not in (model.model.embed_tokens, model.model.norm, model.lm_head))
    locations: dict[str, list[tuple[Path, str]]] = defaultdict(list)  # layer (or "") -> (file, key)
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if whole or stage_holds(model, key, tied_head):
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
            if tied_head and key == "model.embed_tokens.weight":
                key = "lm_head.weight"
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
