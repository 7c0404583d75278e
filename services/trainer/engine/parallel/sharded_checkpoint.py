"""Checkpoints of a sharded engine (torch.distributed.checkpoint) and the whole-model exports gathered from the shards.

The directory layout is checkpoint.py's, extended (one format for every engine):

    <root>/weights/            the export, written by rank 0 alone: the PEFT adapter or the Hugging Face model
                               directory, gathered from the shards (export_weights): the same files, byte for byte,
                               as the single-process engine writes for the same weights (whole experts under EP)
    <root>/state/engine_state.json   as before, plus "parallel" (the ParallelDims the engine ran with and its world
                               size; null for the single-process engine)
    <root>/state/rng.pt        rank 0's RNG state
    <root>/state/dcp/          the trainable state, written by every rank with dcp.save (each rank its shards):
                                   model.<name>                 every trainable parameter (our state-dict names)
                                   optim.<name>.exp_avg|exp_avg_sq|step   AdamW's state of that parameter
                                   grad.<name>                  pending gradients (only when there were any)
                               a single-process engine writes optimizer.pt / gradients.pt instead (checkpoint.py)

Resharding: every tensor in dcp/ is stored under the whole model's shape (DCP keeps each rank's chunk with its
offsets), so a checkpoint written on N ranks loads on M ranks of any layout, or on one process (no process group:
dcp.load(no_dist=True)) — dcp.load reads exactly the chunks each rank's target shards cover.

Experts (expert parallelism): a rank holds n = E / ep experts of each routed-expert tensor as a plain Parameter of
the held shape (FSDP then shards it over efsdp). Each such tensor goes to DCP whole, in its layout
(expert.expert_layout, the same for every ep): the held tensor is gathered over its FSDP mesh and wrapped as a
DTensor on mesh["ep"] whose shard along the expert dimension is this rank's experts (Shard(0) of [E * rows, ...]
for fused weights and lora_A; Shard(2) of lora_B viewed as [F, r, E], since its columns are r-major, expert-minor).
Ranks of other ep groups hold the same chunks: DCP deduplicates them. The gather holds every held expert tensor
unsharded over efsdp while dcp.save runs; a planner writing the efsdp shards with their offsets directly is the
refinement for very large experts.

A single-process checkpoint (weights/ + optimizer.pt) loads into a sharded engine (load_single_process: the weights
from the export, each rank keeping its shard; AdamW's moments taken the same way), and a sharded one into the
single-process engine (the export for the weights, dcp/ for the optimizer and gradients), so both directions work.

The state dict is built here rather than with torch.distributed.checkpoint.state_dict.get_state_dict: the expert
tensors need the whole-tensor wrapping above (get_state_dict would hand DCP the held tensors under the whole
model's names, each ep rank's experts overwriting the others'), and the same code then serves the single-process
engine without a process group. Keys are the parameters' state-dict names (get_state_dict's FQNs), a LoRA
adapter's under the name "default" whatever the engine calls it (a Training API session's adapter is named by its
session id on one process): any LoRA engine loads any LoRA engine's state of the same shapes.

Pipeline parallelism: a rank's trainable tensors are its stages' (engine.stage_models, the whole model's names);
a last stage's tied lm_head copy is stored under model.embed_tokens.weight (the first stage's tensor, equal after
every step: DCP writes one of the two), so the keys are those of a layout without pp and DCP reshards either way. A
stage checks the saved keys against the whole pipeline's expected keys (gathered over pp). The export is gathered
within each stage, sent to rank 0 over its pp group and written in the whole model's order (_from_stages). A
single-process checkpoint's optimizer.pt and gradients.pt are indexed by the single-process engine's parameters,
rebuilt on the meta device (_whole_trainable), so a stage takes its parameters' entries by name.

Not here: per-rank RNG (rank 0's generator is saved and restored on every rank; only LoRA dropout draws from it).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, Shard

from models.lora import ADAPTER_WEIGHTS, lora_parameters
from services.trainer.engine.parallel.expert import ExpertShard, expert_layout, expert_shards

_MOMENTS = ("exp_avg", "exp_avg_sq")
STORED_ADAPTER = "default"  # the adapter name LoRA parameters are stored under (the module docstring)


def _register_sharded(engine) -> None:
    """FSDP2 leaves a root unit's parameters unsharded after a forward (fsdp.py), registered on the modules in place
    of the sharded ones the engine trains: reshard them (local, nothing is communicated), so that named_parameters()
    names the engine's parameters again. It matters for the root's trainable ones: a LoRA adapter on lm_head."""
    from torch.distributed.fsdp import FSDPModule

    for m in engine.stage_models:
        if isinstance(m, FSDPModule):
            m.reshard()


class _Layout:
    """How one engine's trainable tensors map to the checkpoint's whole tensors.

    params: the trainable parameters by state-dict name, in the optimizer's order; layout: each expert tensor's
    whole layout; held: this rank's slice of each split expert tensor (empty without expert parallelism); ep: the
    ep DeviceMesh (None: no expert parallelism); keys: each parameter's name in the checkpoint (see the module
    docstring)."""

    def __init__(self, engine):
        _register_sharded(engine)
        models = engine.stage_models  # the whole model, or this rank's pipeline stages (the whole model's names)
        named = {id(p): n for m in models for n, p in m.named_parameters()}
        for m in models:  # a pipeline's tied lm_head copy is the embeddings (pipeline.py): stored under their name
            if m.args.tie_word_embeddings and m.lm_head is not None and m.model.embed_tokens is None:
                named[id(m.lm_head.weight)] = "model.embed_tokens.weight"
        # no rank holds both tied copies (one key): the engine's schedules put the first and the last stage on
        # different pp ranks (parallelize refuses zbv, whose rank 0 holds both)
        self.params = dict(zip([named[id(p)] for p in engine.params], engine.params))
        assert len(self.params) == len(engine.params), "two trainable tensors under one checkpoint key"
        adapter = engine.adapter if engine.lora is not None else STORED_ADAPTER
        self.keys = {n: n if adapter == STORED_ADAPTER else n.replace(f".{adapter}.", f".{STORED_ADAPTER}.")
                     for n in self.params}
        self.layout = {k: v for m in models for k, v in expert_layout(m).items()}
        self.held = {k: v for m in models for k, v in expert_shards(m).items()}
        self.ep = engine.mesh["ep"] if engine.parallel is not None and engine.parallel.ep > 1 else None
        self.sharded = engine.mesh is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored (whole) shape of parameter `name` and of its moments and gradient."""
        return _stored_shape(self.layout[name]) if name in self.layout else tuple(self.params[name].shape)

    def stored(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t (a tensor shaped like parameter `name`: the parameter, a moment, a gradient) as the checkpoint stores
        it: a DTensor or plain tensor of the whole tensor's stored shape whose local data is this rank's part. A new
        tensor for expert tensors (copy it back with `restore`), a detached view of t otherwise (loaded in place)."""
        if name not in self.layout:
            return t.detach()
        whole = self.layout[name]
        with torch.no_grad():
            held = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
        if name not in self.held:  # every expert on this rank
            return held.reshape(_stored_shape(whole))
        local = held.reshape(_held_view(self.held[name]) if whole.dim != 0 else held.shape)
        shape = _stored_shape(whole)
        return DTensor.from_local(local, self.ep, [Shard(whole.dim)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def restore(self, name: str, target: torch.Tensor, stored: torch.Tensor) -> None:
        """Copy a loaded `stored(name, target)` back into target (its FSDP shard, its held experts)."""
        if name not in self.layout:
            return  # loaded in place
        local = stored.to_local() if isinstance(stored, DTensor) else stored
        _copy_full_into(target, local.detach().reshape(target.shape))


def _stored_shape(s: ExpertShard) -> tuple[int, ...]:
    """[E * rows, ...] (the tensor's own shape) when the expert dimension is the first; lora_B's [F, r, E] view."""
    return tuple(s.global_shape) if s.dim == 0 else tuple(s.view_shape)


def _held_view(s: ExpertShard) -> tuple[int, ...]:
    shape = list(s.view_shape)
    shape[s.dim] = s.length
    return tuple(shape)


def _copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    from services.trainer.engine.parallel.parallelize import copy_full_into

    with torch.no_grad():
        copy_full_into(target, full)


def _state(engine, lay: _Layout, *, gradients: bool) -> tuple[dict, dict]:
    """({checkpoint key: stored tensor}, {checkpoint key: (name, target)}) of the engine's trainable state."""
    sd, targets = {}, {}

    def put(key, name, target):
        sd[key] = lay.stored(name, target)
        targets[key] = (name, target)

    for name, p in lay.params.items():
        key = lay.keys[name]
        put(f"model.{key}", name, p)
        state = engine.optimizer.state.get(p, {})
        for moment in _MOMENTS:
            if moment in state:
                put(f"optim.{key}.{moment}", name, state[moment])
        if "step" in state:
            sd[f"optim.{key}.step"] = state["step"]
            targets[f"optim.{key}.step"] = (None, state["step"])
        if gradients and p.grad is not None:
            put(f"grad.{key}", name, p.grad)
    return sd, targets


def save_state(engine, out: Path) -> None:
    """The engine's trainable parameters, AdamW state and pending gradients with dcp.save under out (every rank of
    a sharded engine calls it; the single-process engine can too)."""
    lay = _Layout(engine)
    sd, _ = _state(engine, lay, gradients=True)
    dcp.save(sd, checkpoint_id=str(out), no_dist=not lay.sharded)


def saved_keys(path: Path) -> dict[str, tuple[int, ...]]:
    """The keys of a dcp/ directory and their whole shapes."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}


def load_state(engine, path: Path, *, weights: bool, optimizer: bool, gradients: bool) -> None:
    """Load what is asked from a dcp/ directory into the engine (whatever layout wrote it). Keys and shapes are
    checked before anything changes (checkpoint.CheckpointMismatch). optimizer: AdamW's state becomes the saved one
    (a parameter without saved state has none); gradients: the saved pending gradients, or none."""
    from services.trainer.engine.checkpoint import CheckpointMismatch

    lay = _Layout(engine)
    saved = saved_keys(path)
    kinds = ("model.",) * weights + ("optim.",) * optimizer + ("grad.",) * gradients
    keys = lay.keys
    expected = {f"model.{keys[n]}": lay.shape(n) for n in lay.params}
    for name in lay.params:
        key = keys[name]
        expected |= {f"optim.{key}.{m}": lay.shape(name) for m in _MOMENTS} | {f"grad.{key}": lay.shape(name)}
        expected[f"optim.{key}.step"] = ()
    if engine.pp > 1:  # a stage expects its own keys; a key no stage of the pipeline expects is unexpected
        stages = [None] * engine.pp
        dist.all_gather_object(stages, expected, group=engine.mesh["pp"].get_group())
        expected = {k: v for part in stages for k, v in part.items()}
    unexpected = sorted(k for k in saved if k.startswith(kinds) and k not in expected)
    missing = sorted(f"model.{keys[n]}" for n in lay.params if weights and f"model.{keys[n]}" not in saved)
    if missing or unexpected:
        raise CheckpointMismatch(f"the distributed checkpoint does not fit: missing {missing[:5]}, unexpected "
                                 f"{unexpected[:5]}")
    bad = [f"{k}: saved {list(v)} vs this run's {list(expected[k])}" for k, v in saved.items()
           if k.startswith(kinds) and v != expected[k]]
    if bad:
        raise CheckpointMismatch(f"the distributed checkpoint has other shapes: {'; '.join(bad[:5])}")
    if optimizer:  # the saved state, created as zeros where the engine has none yet, then loaded
        engine.optimizer.state.clear()
        for name, p in lay.params.items():
            if f"optim.{keys[name]}.step" in saved:
                engine.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                             **{m: torch.zeros_like(p) for m in _MOMENTS}}
    if gradients:
        for name, p in lay.params.items():
            p.grad = torch.zeros_like(p) if f"grad.{keys[name]}" in saved else None
    sd, targets = _state(engine, lay, gradients=gradients)
    request = {k: v for k, v in sd.items() if k.startswith(kinds)}
    dcp.load(request, checkpoint_id=str(path), no_dist=not lay.sharded)
    for k, stored in request.items():
        name, target = targets[k]
        if name is not None:  # None: a step count, loaded in place
            lay.restore(name, target, stored)


def load_single_process(engine, ckpt, *, weights: bool, optimizer: bool, gradients: bool) -> None:
    """A single-process checkpoint (checkpoint.py: weights/ export, optimizer.pt, gradients.pt) into a sharded
    engine: every rank reads the whole files and keeps its shard (its experts, then its FSDP chunk). Under pipeline
    parallelism a rank keeps its stages' part: optimizer.pt and gradients.pt are indexed by the single-process
    engine's parameter list, which _whole_trainable rebuilds on the meta device."""
    from models.families import family_for_config
    from models.model_dir import read_config
    from services.trainer.engine import checkpoint as ckpt_format
    from services.trainer.engine.parallel.parallelize import load_hf_weights

    lay = _Layout(engine)
    whole = _whole_trainable(engine, lay)  # {name: a meta tensor of its whole shape}, the single-process order
    plain = list(whole.values())
    optim = ckpt_format.optimizer_state(ckpt, plain, torch.device("cpu")) if optimizer else None
    grads = (ckpt_format.gradient_tensors(ckpt, plain, torch.device("cpu"))
             if gradients and ckpt.has_gradients else None)
    if weights:
        if engine.lora is None:
            family = family_for_config(read_config(ckpt.weights_dir))
            for model in engine.stage_models:
                load_hf_weights(model, ckpt.weights_dir, family)
        else:
            names = {id(p): n for m in engine.stage_models for n, p in m.named_parameters()}
            params = {k: p for m in engine.stage_models for k, p in lora_parameters(m, engine.adapter).items()}
            try:
                tensors = load_file(str(ckpt.weights_dir / ADAPTER_WEIGHTS))
            except (OSError, ValueError, RuntimeError) as exc:
                raise ckpt_format.CheckpointMismatch(f"the saved adapter cannot be read: {exc}") from None
            ckpt_format._checked(tensors, _whole_adapter(engine, lay))
            for key, p in params.items():
                _copy_full_into(p, _held(lay, names[id(p)], tensors[key]))
    index = {name: i for i, name in enumerate(whole)}
    for name, p in lay.params.items():
        if grads is not None:
            g = grads[index[name]]
            p.grad = None if g is None else _sharded_like(p, _held(lay, name, g))
        elif gradients:
            p.grad = None
    if optim is not None:
        engine.optimizer.state.clear()
        indices = [i for g in optim["param_groups"] for i in g["params"]]
        for name, p in lay.params.items():
            saved = optim["state"].get(indices[index[name]])
            if saved:
                engine.optimizer.state[p] = {"step": saved["step"].clone(),
                                             **{m: _sharded_like(p, _held(lay, name, saved[m])) for m in _MOMENTS}}


def _whole_trainable(engine, lay: _Layout) -> dict[str, torch.Tensor]:
    """{name: meta tensor of the whole shape and dtype} of the single-process engine's trainable parameters, in its
    order (its optimizer's): this engine's own without pp; under pp the whole meta model's (every parameter, the
    tied one once) or the whole adapter's (pipeline.lora_skeleton)."""
    if engine.pp == 1:
        return {n: torch.empty(lay.held[n].global_shape if n in lay.held else p.shape, dtype=p.dtype,
                               device="meta") for n, p in lay.params.items()}
    if engine.lora is None:
        return {n: p for n, p in engine.whole.named_parameters()}
    from services.trainer.engine.parallel.pipeline import lora_skeleton

    skeleton, order = lora_skeleton(engine.whole, engine.lora, engine.adapter)
    names = {id(p): n for n, p in skeleton.named_parameters()}
    return {names[id(p)]: p for p in order}


def _whole_adapter(engine, lay: _Layout) -> dict[str, torch.Tensor]:
    """{PEFT key: meta tensor of the whole shape} of the whole adapter (what a saved adapter must hold)."""
    model = engine.model
    if engine.pp > 1:
        from services.trainer.engine.parallel.pipeline import lora_skeleton

        model = lora_skeleton(engine.whole, engine.lora, engine.adapter)[0]
    names = {id(p): n for n, p in model.named_parameters()}
    return {k: torch.empty(lay.held[names[id(p)]].global_shape if names[id(p)] in lay.held else p.shape,
                           device="meta") for k, p in lora_parameters(model, engine.adapter).items()}


def _held(lay: _Layout, name: str, whole: torch.Tensor) -> torch.Tensor:
    return lay.held[name].take(whole) if name in lay.held else whole


def _sharded_like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(p)
    _copy_full_into(out, full)
    return out


# -- exports ---------------------------------------------------------------------------------------------------------
def gather_whole(engine, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{key: whole tensor} on every rank of tensors {state-dict name: tensor} of a sharded model: DTensors gathered
    with full_tensor(), split experts all_gathered over mesh["ep"] and put in place (ExpertShard.put). Collective:
    every rank calls it with the same names in the same order."""
    lay = _Layout(engine)
    out = {}
    for name, t in tensors.items():
        with torch.no_grad():
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        if name in lay.held:
            mine = lay.held[name]
            parts = [torch.empty_like(full) for _ in range(lay.ep.size())]
            dist.all_gather(parts, full.contiguous(), group=lay.ep.get_group())
            full = full.new_empty(mine.global_shape)
            for rank, part in enumerate(parts):
                replace(mine, start=rank * mine.length).put(full, part)
        out[name] = full
    return out


def export_weights(engine, out: Path, *, base_model: str) -> None:
    """The trained weights gathered from the shards, written by rank 0 alone (checkpoint.write_weights' files for
    the whole model: the PEFT adapter, or the Hugging Face model directory). Every rank calls it. Under pipeline
    parallelism each stage's tensors are gathered within the stage, then sent to rank 0 over its pp group (the
    ranks at data-parallel coordinate 0), which writes them in the whole model's order."""
    from models import save_pretrained
    from models.lora import save_peft_adapter

    _register_sharded(engine)
    if engine.lora is None:
        tensors = {k: v for m in engine.stage_models for k, v in m.state_dict().items()}
        whole = _from_stages(engine, gather_whole(engine, tensors))
        if dist.get_rank() == 0:
            if engine.pp > 1:
                whole = {k: whole[k] for k in engine.whole.state_dict()}
            save_pretrained(engine.model, out, state_dict=whole)
    else:
        names = {id(p): n for m in engine.stage_models for n, p in m.named_parameters()}
        params = [p for m in engine.stage_models for p in lora_parameters(m, engine.adapter).values()]
        whole = _from_stages(engine, gather_whole(engine, {names[id(p)]: p for p in params}))
        if dist.get_rank() == 0:
            model = engine.model
            if engine.pp > 1:  # the whole adapter's layout (a stage lacks some of its modules)
                from services.trainer.engine.parallel.pipeline import lora_skeleton

                model = lora_skeleton(engine.whole, engine.lora, engine.adapter)[0]
            names = {id(p): n for n, p in model.named_parameters()}
            tensors = {key: whole[names[id(p)]] for key, p in lora_parameters(model, engine.adapter).items()}
            save_peft_adapter(model, engine.lora, out, base_model_name_or_path=base_model,
                              adapter_name=engine.adapter, tensors=tensors)
    dist.barrier()


def _from_stages(engine, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's {name: whole tensor} of every pipeline stage (mine: this rank's stages'); mine itself without pp.
    The ranks at data-parallel coordinate 0 (rank 0's pp group) send theirs to rank 0 (gather_object)."""
    if engine.pp == 1:
        return mine
    if engine.mesh["dp_cp"].get_local_rank() != 0:
        return {}
    parts = [None] * engine.pp if dist.get_rank() == 0 else None
    dist.gather_object({k: v.cpu() for k, v in mine.items()}, parts, dst=0, group=engine.mesh["pp"].get_group())
    return {k: v for part in parts or [] for k, v in part.items()}
