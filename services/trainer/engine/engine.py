"""The training engine: one model in training and everything done to it, the same for every caller.

    TrainingEngine.load(model_dir, lora=..., ...)   build: load the weights (device, dtype: `training_dtype`), add a
                                                    LoRA adapter or make every weight trainable, AdamW over them
    engine.nll_sum(ids_BT, targets_BT)              forward to hidden states + the chunked logprob head (logprobs.py)
    engine.sequence_logprobs(ids_BT, targets_BT,    the same forward, summed per packed sequence (DPO's logprobs)
                             packing=...)
    engine.loss_call(req, ...)                      a micro-batched forward / backward of datums under a built-in
                                                    loss (forward_backward.py)
    engine.step(AdamW(...))                         clip / measure the gradient norm, AdamW step, clear gradients
    engine.save(root, base_model=..., progress=...) the checkpoint (checkpoint.py: weights/ + state/, one format for
                                                    every caller): weights, optimizer, RNG, step count, pending
                                                    gradients
    engine.restore(read_checkpoint(root), ...)      check all of it against this engine, then load it: training
                                                    continues bit for bit

Managed SFT (services/trainer/sft.py), Training API sessions (services/trainer/sessions.py) and `trainyard validate`
(services/trainer/validate.py) all train through it; none keeps a loop of its own. A LoRA session on a shared base
builds its engine around the base it shares (`TrainingEngine(model, params, ...)`): the engine owns the session's
parameters and optimizer, not the base.

This is the seam where the distributed trainer adds a device mesh: building, stepping and the training state go
through here, so sharding the parameters and the optimizer state (and a controller driving several ranks) changes
this module, not its callers. TrainingEngine.load(..., parallel=ParallelDims(...)) on every rank of a
torch.distributed group builds the model on the meta device and shards it (parallel/parallelize.py); the engine's
parameters are then DTensors, AdamW runs on them as they are (each rank updates its shard), the gradient norm is the
global one (optim.total_norm), and loss_call takes each data-parallel rank's share of a call's datums and the call's
batch_scale (forward_backward.py). A sharded engine's checkpoint has the same layout (parallel/sharded_checkpoint.py):
the weights gathered from the shards and written by rank 0, the optimizer state and pending gradients with
torch.distributed.checkpoint under state/dcp/; save, save_weights and restore are then called on every rank, and
either engine restores either kind of checkpoint (any layout: DCP reshards).

Under pipeline parallelism (pp > 1, ParallelDims.pipeline_schedule) each rank holds its stages of the model
(engine.stage_models; engine.model is the first), each sharded over the rest of the mesh; loss_call runs the
pipeline's schedule over the rank's share (parallel/pipeline.py PipelineLossCall), step's gradient norm is summed
over the pp group too, and the checkpoint is the same layout (docs/pipeline.md). nll_sum is refused there.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import Packing
from kernels.logprobs import IGNORE_INDEX
from models import load_pretrained
from models.lora import LoraConfig, apply_lora, lora_state_dict, set_trainable
from services.trainer.engine import checkpoint as ckpt_format
from services.trainer.engine.checkpoint import EngineCheckpoint
from services.trainer.engine.forward_backward import LossCall, LossRequest
from services.trainer.engine.logprobs import sequence_logprob_sums, target_nll_sum, token_logprobs
from services.trainer.engine.optim import AdamW, make_optimizer, optimizer_step
from services.trainer.engine.parallel.dims import ParallelDims


def training_device(device: str | torch.device | None = None) -> torch.device:
    """The device to train on: the one asked for, else CUDA when there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def training_dtype(device: torch.device, *, full_parameter: bool) -> torch.dtype:
    """The weights' dtype: a frozen LoRA base in bf16 on CUDA (half the memory; the adapter stays float32, see
    models.lora), float32 otherwise (every CPU run, and full-parameter training, whose AdamW updates need it)."""
    return torch.bfloat16 if device.type == "cuda" and not full_parameter else torch.float32


class TrainingEngine:
    """model: the model in training; params: what this engine trains (a LoRA adapter's parameters, named `adapter`
    in the model, or every weight when lora is None); seed: the adapter's init seed, kept with its checkpoints."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], *, optimizer: AdamW, device: torch.device,
                 lora: LoraConfig | None, adapter: str = "default", seed: int = 0,
                 parallel: ParallelDims | None = None, mesh=None, stages: list[tuple[int, nn.Module]] | None = None,
                 whole: nn.Module | None = None, activation_dtype: torch.dtype = torch.float32):
        self.model, self.params, self.device = model, params, device
        self.lora, self.adapter, self.seed = lora, adapter, seed
        self.parallel, self.mesh = parallel, mesh  # None: one process (the model unsharded)
        # under pipeline parallelism (pp > 1): this rank's stages ((stage index, CausalLM stage); model is the first
        # of them), the whole model on the meta device, the activations' dtype, and a Pipeline per row size
        self.stages = stages if stages is not None else [(0, model)]
        self.whole, self.activation_dtype = whole, activation_dtype
        self._pipelines: dict = {}
        self._stage_module_list: list | None = None
        self.context_parallel = None  # the model's ContextParallel under cp > 1 (parallel/context.py)
        if parallel is not None and parallel.cp > 1:
            from services.trainer.engine.parallel.context import context_parallel_of

            self.context_parallel = context_parallel_of(model)
        self.optimizer = make_optimizer(params, optimizer)
        self.steps = 0  # optimizer steps taken (restored with a checkpoint's optimizer state)

    @classmethod
    def load(cls, model_dir: str | Path, *, lora: LoraConfig | None, seed: int, optimizer: AdamW,
             device: str | torch.device | None = None, parallel: ParallelDims | None = None,
             activation_checkpointing: bool = False) -> TrainingEngine:
        """A model directory ready to train: a LoRA adapter (lora) or every weight (lora None) trainable.

        parallel: the degrees of a torch.distributed group this process is one rank of (the default process group,
        already initialized; every rank calls load alike). The model is then built on the meta device, given LoRA
        or made trainable, parallelized (parallel/parallelize.py: FSDP, activation checkpointing when asked) and
        its weights loaded shard by shard; the adapter starts from the same values as the single-process engine's
        for the same seed. Without it (or activation_checkpointing) the single-process engine is unchanged."""
        device = training_device(device)
        dtype = training_dtype(device, full_parameter=lora is None)
        if parallel is not None:
            import torch.distributed as dist

            from services.trainer.engine.parallel import build_mesh
            from services.trainer.engine.parallel.fsdp import mixed_precision
            from services.trainer.engine.parallel.parallelize import build_parallel_model

            dims = parallel.resolved(dist.get_world_size())
            mesh = build_mesh(dims, device.type)
            stages, whole, params = build_parallel_model(model_dir, dims, mesh, lora=lora, seed=seed, device=device,
                                                         dtype=dtype,
                                                         activation_checkpointing=activation_checkpointing)
            return cls(stages[0][1], params, optimizer=optimizer, device=device, lora=lora, seed=seed, parallel=dims,
                       mesh=mesh, stages=stages, whole=whole,
                       activation_dtype=mixed_precision(device, full_parameter=lora is None).param_dtype or dtype)
        model = load_pretrained(model_dir, dtype=dtype, device=device)
        params = apply_lora(model, lora, seed=seed) if lora is not None else set_trainable(model, "full")
        if activation_checkpointing:
            from services.trainer.engine.parallel.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        return cls(model.train(), params, optimizer=optimizer, device=device, lora=lora, seed=seed)

    # -- data parallel ----------------------------------------------------------------------------------------------
    @property
    def dp_group(self):
        """The process group of the ranks that see different datums (mesh "dp"), None on one process."""
        return None if self.mesh is None else self.mesh["dp"].get_group()

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (0 on one process): which share of the datums it takes."""
        return 0 if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return 1 if self.mesh is None else self.mesh["dp"].size()

    # -- pipeline parallel -------------------------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        """Pipeline stages' ranks (1: no pipeline)."""
        return 1 if self.parallel is None else self.parallel.pp

    @property
    def stage_models(self) -> list[nn.Module]:
        """The models this rank trains: the whole model, or under pp its stages (each keeps the whole model's
        parameter names; model is the first)."""
        return [m for _, m in self.stages]

    def pipeline(self, row_tokens: int):
        """This rank's Pipeline (parallel/pipeline.py) over its stages for rows of row_tokens tokens (built on first
        use per row size: PipelineStages have static shapes)."""
        pipe = self._pipelines.get(row_tokens)
        if pipe is None:
            from services.trainer.engine.parallel.parallelize import local_shape
            from services.trainer.engine.parallel.pipeline import pipeline_of

            args = self.whole.args
            pipe = pipeline_of(self.stages, self.mesh["pp"].get_group(), self.whole,
                               schedule=self.parallel.pipeline_schedule, row_tokens=row_tokens,
                               dtype=self.activation_dtype, device=self.device,
                               tied_shape=local_shape((args.vocab_size, args.hidden_size), self.parallel, self.mesh),
                               cp=self.context_parallel, modules=self._stage_modules())
            self._pipelines[row_tokens] = pipe
        return pipe

    def _stage_modules(self) -> list:
        """The StageModule of each of this rank's stages, made once (pipeline.stage_modules), shared by the
        pipelines of every row size."""
        if self._stage_module_list is None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from services.trainer.engine.parallel.fsdp import dense_shard_mesh, mixed_precision
            from services.trainer.engine.parallel.pipeline import stage_modules

            mp = mixed_precision(self.device, full_parameter=self.lora is None)
            self._stage_module_list = stage_modules(
                self.stages, dense_shard_mesh(self.mesh, self.parallel),
                MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype))
        return self._stage_module_list

    def _uncounted(self) -> frozenset[int]:
        """The parameters the gradient norm leaves out: under pp with tied embeddings, the last stage's lm_head (a
        second copy of the embeddings, whose gradient pipeline.py makes the same; the first stage's counts)."""
        if self.pp == 1 or not self.model.args.tie_word_embeddings:
            return frozenset()
        return frozenset(id(m.lm_head.weight) for m in self.stage_models
                         if m.lm_head is not None and m.model.embed_tokens is None)

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    def nll_sum(self, input_ids_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                packing: Packing | None = None) -> torch.Tensor:
        """Summed float32 NLL of the target tokens (logprobs.target_nll_sum), inputs moved to the engine's device.

        Under context parallelism (every rank of a cp group passes the same batch) each row ([B, T], or the packed
        row with packing) is padded to a multiple of 2 cp tokens (IGNORE_INDEX targets; with packing a padding
        document of its own), this rank's shard runs the model and the logprob head, and the value returned is the
        whole batch's sum (an all_reduce over the cp group) whose backward reaches this rank's tokens only
        (context.SumOverGroup): FSDP sums the weights' gradients over the cp group, so they are the whole sum's.
        Not under pipeline parallelism (InvalidArgument on pp): a pipeline runs its schedule's forward and backward
        together, so a loss tensor to call backward on does not exist; train through loss_call instead."""
        if self.pp > 1:
            from services.common.errors import InvalidArgument

            raise InvalidArgument(f"pp {self.pp}: the summed-NLL forward (managed SFT's) is not available with "
                                  "pipeline parallelism; set pp to 1", field=self.parallel._field("pp"))
        cp = self.context_parallel
        if cp is None:
            return target_nll_sum(self.model, input_ids_BT.to(self.device), targets_BT.to(self.device),
                                  packing=packing)
        from services.trainer.engine.parallel.context import SumOverGroup, padded_packing

        T = input_ids_BT.shape[1]
        if packing is not None:
            packing = padded_packing(packing.lengths, cp, self.device)
            layout = cp.layout(packing=packing)
        else:
            layout = cp.layout(T + -T % (2 * cp.size))
        pad = layout.seq_len - T
        tokens_BL = layout.shard(F.pad(input_ids_BT, (0, pad)).to(self.device))
        targets_BL = layout.shard(F.pad(targets_BT, (0, pad), value=IGNORE_INDEX).to(self.device))
        hidden_BLD = self.model(tokens_BL, packing=layout, return_hidden=True)
        local = -token_logprobs(self.model, hidden_BLD.flatten(0, 1), targets_BL.flatten()).sum()
        return SumOverGroup.apply(local, cp.group)

    def sequence_logprobs(self, input_ids_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                          packing: Packing) -> torch.Tensor:
        """[S] float32: each packed sequence's summed target logprobs (logprobs.sequence_logprob_sums), inputs moved
        to the engine's device. One process only (no mesh): managed DPO runs in one process."""
        if self.mesh is not None:
            raise NotImplementedError("per-sequence logprobs are computed on one process only (no device mesh)")
        return sequence_logprob_sums(self.model, input_ids_BT.to(self.device), targets_BT.to(self.device),
                                     packing=packing)

    def step(self, settings: AdamW) -> torch.Tensor:
        """One optimizer step over the accumulated gradients (optim.optimizer_step); the gradient norm."""
        norm = optimizer_step(self.params, self.optimizer, settings, split_over=self._split_gradients(),
                              sum_over=self.mesh["pp"].get_group() if self.pp > 1 else None,
                              uncounted=self._uncounted())
        self.steps += 1
        return norm

    def _split_gradients(self) -> dict | None:
        """{expert shard mesh: ep group} under expert parallelism (optim.total_norm): the routed experts' gradients
        differ across the ep ranks (each holds other experts), beyond their FSDP shards."""
        if self.parallel is None or self.parallel.ep == 1:
            return None
        from services.trainer.engine.parallel.fsdp import expert_shard_mesh

        return {expert_shard_mesh(self.mesh, self.parallel): self.mesh["ep"].get_group()}

    def loss_call(self, req: LossRequest, *, backward: bool, deterministic: bool, lock,
                  batch_scale: float | None = None) -> LossCall:
        """A Training API Forward / ForwardBackward over this engine's model and parameters (forward_backward.py);
        lock: a context manager held around each micro-batch (the shared base's, with the session's adapter on).

        Over a mesh, each data-parallel rank runs the call on its own share of the call's datums (the caller splits
        them, e.g. split_for_ranks(datums, engine.dp_size)[engine.dp_rank]) and passes batch_scale, the call's c
        (losses.batch_scale) over ALL its datums: every rank must apply the same c. The gradients are then the
        whole call's (summed over ranks by FSDP), the metrics too (their sums all-reduced); the logprobs returned
        are this rank's datums'. On one process batch_scale may be left None (computed from the datums).
        Under context parallelism the cp ranks of a group take the SAME share (dp_size and dp_rank count the dp
        ranks only) and each returns its datums' whole logprobs (forward_backward.py's module docstring)."""
        if self.dp_size > 1 and batch_scale is None:
            raise ValueError("a data-parallel engine needs the call's batch_scale over every rank's datums")
        if self.pp > 1:
            from services.trainer.engine.parallel.pipeline import PipelineLossCall

            return PipelineLossCall(self.pipeline(req.micro_batch_tokens), req, backward=backward,
                                    deterministic=deterministic, lock=lock, batch_scale=batch_scale,
                                    dp_group=self.dp_group if self.dp_size > 1 else None)
        return LossCall(self.model, self.params, req, backward=backward, deterministic=deterministic,
                        device=self.device, lock=lock, dp_group=self.dp_group, batch_scale=batch_scale,
                        cp=self.context_parallel)

    # -- checkpoints (checkpoint.py) -------------------------------------------------------------------------------
    def rng_state(self) -> dict:
        """The global RNG state (LoRA dropout draws from the global generator)."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def save_weights(self, out: Path, *, base_model: str) -> None:
        """The trained weights alone: the PEFT adapter, or the Hugging Face model directory. Sharded: gathered
        from the shards and written by rank 0 (every rank calls it), the same files as one process writes."""
        if self.mesh is not None:
            from services.trainer.engine.parallel.sharded_checkpoint import export_weights

            export_weights(self, out, base_model=base_model)
            return
        ckpt_format.write_weights(self.model, self.lora, out, base_model=base_model, adapter=self.adapter)

    def save(self, root: Path, *, base_model: str, progress: dict) -> None:
        """A checkpoint under root: weights/ and state/ (the optimizer, the RNG, the step count, the caller's
        progress and any pending gradients). Sharded: every rank calls it with the same arguments; rank 0 writes
        the files, every rank its shards of state/dcp/ (parallel/sharded_checkpoint.py)."""
        self.save_weights(root / ckpt_format.WEIGHTS_DIR, base_model=base_model)
        if self.mesh is not None:
            import torch.distributed as dist

            from services.trainer.engine.parallel.sharded_checkpoint import save_state

            save_state(self, root / ckpt_format.STATE_DIR / ckpt_format.DCP_DIR)
            if dist.get_rank() == 0:
                layout = {**{k: getattr(self.parallel, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp",
                                                                    "ep", "pipeline_schedule")},
                          "world_size": dist.get_world_size()}
                ckpt_format.write_state(root / ckpt_format.STATE_DIR, base_model=base_model, lora=self.lora,
                                        seed=self.seed, optim_steps=self.steps, optimizer=None,
                                        rng=self.rng_state(), progress=progress, parallel=layout)
            dist.barrier()
            return
        grads = [p.grad for p in self.params]
        ckpt_format.write_state(root / ckpt_format.STATE_DIR, base_model=base_model, lora=self.lora, seed=self.seed,
                                optim_steps=self.steps, optimizer=self.optimizer, rng=self.rng_state(),
                                progress=progress, gradients=grads if any(g is not None for g in grads) else None)

    def restore(self, ckpt: EngineCheckpoint, *, weights: bool = True, optimizer: bool = True,
                rng: bool = False, gradients: bool = False) -> None:
        """Load a checkpoint's weights, optimizer state and step count, and (rng) its RNG state. Everything is
        checked before the first copy (CheckpointMismatch), so a checkpoint that does not fit changes nothing.
        Pending gradients are dropped, or with gradients replaced by the checkpoint's (none when it holds none).
        rng is for a process that trains one engine: the generator is global.

        Either engine restores either kind of checkpoint: a sharded engine (every rank calls it) a single-process
        one or a distributed one of any layout, the single-process engine a distributed one (its optimizer and
        gradients from state/dcp/). A sharded engine restores rank 0's RNG state on every rank."""
        if self.mesh is not None or ckpt.has_dcp:
            self._restore_sharded(ckpt, weights=weights, optimizer=optimizer, rng=rng, gradients=gradients)
            return
        targets = tensors = optim = rng_state = grads = None
        if weights:
            targets, tensors = self._weights_of(ckpt)
        if optimizer:
            optim = ckpt_format.optimizer_state(ckpt, self.params, self.device)
        if rng:
            rng_state = ckpt_format.rng_state(ckpt)
        if gradients and ckpt.has_gradients:
            grads = ckpt_format.gradient_tensors(ckpt, self.params, self.device)
        if tensors is not None:
            ckpt_format.copy_into(tensors, targets)
        for i, p in enumerate(self.params):
            p.grad = None if grads is None else grads[i]
        if optim is not None:
            self.optimizer.load_state_dict(optim)
            self.steps = ckpt.optim_steps
        if rng_state is not None:
            self._set_rng_state(rng_state)

    def _weights_of(self, ckpt: EngineCheckpoint) -> tuple[dict, dict]:
        """(this engine's tensors a checkpoint's weights go into, the checkpoint's tensors for them): the whole
        state dict, or the adapter's."""
        if self.lora is None:
            return self.model.state_dict(), ckpt_format.full_tensors(ckpt, self.model)
        return lora_state_dict(self.model, self.adapter), ckpt_format.lora_tensors(ckpt, self.model, self.adapter)

    def _set_rng_state(self, rng_state: dict) -> None:
        torch.set_rng_state(rng_state["cpu"])
        if self.device.type == "cuda" and "cuda" in rng_state:
            torch.cuda.set_rng_state(rng_state["cuda"], self.device)

    def _restore_sharded(self, ckpt: EngineCheckpoint, *, weights: bool, optimizer: bool, rng: bool,
                         gradients: bool) -> None:
        """restore where the engine is sharded or the checkpoint distributed (parallel/sharded_checkpoint.py)."""
        from services.trainer.engine.parallel import sharded_checkpoint as sharded

        self._check_config(ckpt)
        rng_state = ckpt_format.rng_state(ckpt) if rng else None
        if ckpt.has_dcp:
            sharded.load_state(self, ckpt.state_dir / ckpt_format.DCP_DIR, weights=weights and self.mesh is not None,
                               optimizer=optimizer, gradients=gradients)
            if weights and self.mesh is None:  # the export: the weights as the single-process engine reads them
                targets, tensors = self._weights_of(ckpt)
                ckpt_format.copy_into(tensors, targets)
        else:
            sharded.load_single_process(self, ckpt, weights=weights, optimizer=optimizer, gradients=gradients)
        if not gradients:
            for p in self.params:
                p.grad = None
        if optimizer:
            self.steps = ckpt.optim_steps
        if rng_state is not None:
            self._set_rng_state(rng_state)

    def _check_config(self, ckpt: EngineCheckpoint) -> None:
        if (ckpt.lora is None) != (self.lora is None):
            raise ckpt_format.CheckpointMismatch(
                f"the checkpoint is {'full-parameter' if ckpt.lora is None else 'LoRA'}, this engine "
                f"{'full-parameter' if self.lora is None else 'LoRA'}")

    def release(self) -> None:
        """Drop the gradients and the optimizer state (the parameters stay with the model, which the caller frees)."""
        for p in self.params:
            p.grad = None
        self.params = []
        self.optimizer.state.clear()

