"""Managed LoRA SFT: the training run a worker drives for one job, as a stream of events, with checkpoints it resumes
from bit-exactly.

Shapes: B rows in a micro-batch, T tokens per row, V vocab, D hidden, N = B * T, C tokens per chunk.

`run_sft(...)` yields what happens, in order -- Log, Started, Metrics, Checkpoint, ..., Finished -- and the caller (the
worker's recipe) records each one; nothing here calls back into the caller, and a Checkpoint's files stay on disk
until the caller asks for the next event. `stop` (a threading.Event, or anything with is_set()) is checked before
every micro-batch; once set, the run ends promptly with Finished(stopped=True).

The run trains through the engine (services/trainer/engine/): the loss is its summed target NLL (the chunked logprob
head: never [B, T, V] logits), the step its AdamW step (torch's defaults, the job's weight decay and clipping).

Order of one optimizer step s (0-based; `step` counts completed steps, so it becomes s + 1):
  lr(s) -> for each of the step's gradient_accumulation_steps micro-batches: stop.is_set()? -> forward -> backward
  of (summed target-token NLL / target tokens of the whole step) -> grad norm (+ clip) -> AdamW step ->
  eval if due -> Metrics(s + 1) -> checkpoint if due (Checkpoint, then our copy is deleted).

A checkpoint at step k is the engine's (engine/checkpoint.py: the adapter under weights/, the rest under state/) and
holds everything step k depends on: the AdamW state, the global torch RNG (LoRA dropout draws from it) and k itself,
which fixes both the learning rate (schedule.py) and the data position (data.py). Evaluation draws no random numbers.
So resuming at k and running to N gives the same adapter, bit for bit, as running 0..N straight, as long as the
kernels are deterministic (CPU with a fixed thread count, or torch.use_deterministic_algorithms).

On a group (`parallel=ParallelDims(...)`: every rank of an initialized torch.distributed group calls run_sft with the
same arguments; services/trainer/sft_group.py is the managed job's entry under torchrun) the engine is sharded
(engine.py) and one step is the one-process step, split:
  - the step's micro-batches go to the data-parallel ranks in contiguous shares (forward_backward.split_for_ranks
    over engine.dp_size; the ranks of one cp group take the same share), and every rank runs as many micro-batches
    as the largest share, padding ones (forward_backward.run_padding_micro_batch: gradients of exactly zero) after
    its own, because every forward and backward of the sharded model is a collective;
  - each backward still divides by the WHOLE step's target count, and FSDP sums the gradients over the ranks, so the
    gradient is the one-process run's (summed in another order: float32 rounding apart);
  - the train and eval losses are sums all-reduced over the data-parallel ranks, the grad norm the global one;
  - the stop decision is rank 0's: before every micro-batch rank 0 reads its flag and broadcasts it (other ranks'
    flags are never read), so every rank stops at the same micro-batch;
  - checkpoints go through engine.save on every rank (rank 0 writes weights/ and the state files, every rank its
    shards of state/dcp/: the same layout, resumable on any layout, one process included); every rank yields the
    same events, the caller records rank 0's, and only rank 0 removes a checkpoint once its caller moves on.
LoRA dropout draws from each rank's global generator for the rank's own micro-batches, so with dropout > 0 a group
trains with other (equally random) masks than one process.
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from models import CausalLM
from models.lora import LoraConfig
from models.tokenizer import load_tokenizer
from services.common import metrics
from services.common.methods.sft import SftHyperparams
from services.trainer.data import MicroBatch, SftData, StepSampler, batches, load_sft_data
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.checkpoint import STATE_DIR, WEIGHTS_DIR, CheckpointMismatch, read_checkpoint
from services.trainer.engine.forward_backward import run_padding_micro_batch, split_for_ranks
from services.trainer.engine.parallel.dims import ParallelDims
from services.trainer.schedule import learning_rate


@dataclass
class SftCheckpoint:
    step: int  # optimizer steps completed
    root: Path  # the engine's checkpoint layout (engine/checkpoint.py)

    @property
    def weights_dir(self) -> Path:  # the PEFT adapter (adapter_config.json, adapter_model.safetensors)
        return self.root / WEIGHTS_DIR

    @property
    def state_dir(self) -> Path:  # what resuming needs: engine_state.json, optimizer.pt, rng.pt
        return self.root / STATE_DIR


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


# -- events ------------------------------------------------------------------------------------------------------
@dataclass
class Log:
    message: str
    level: str = "info"


@dataclass
class Started:
    total_steps: int
    info: dict


@dataclass
class Metrics:
    step: int
    metrics: dict[str, float]


@dataclass
class Checkpoint:
    checkpoint: SftCheckpoint  # its files are removed when the next event is asked for
    final: bool
    metrics: dict[str, float]


@dataclass
class Finished:
    step: int
    stopped: bool  # True when the stop flag ended the run early
    metrics: dict[str, float]


SftEvent = Log | Started | Metrics | Checkpoint | Finished


def run_sft(model_dir: Path, dataset_path: Path, hp: SftHyperparams, *, stop: StopFlag,
            resume: SftCheckpoint | None = None, base_model_name: str = "", work_dir: Path,
            parallel: ParallelDims | None = None, start_from: SftCheckpoint | None = None) -> Iterator[SftEvent]:
    """Train a LoRA adapter on the JSONL dataset; see the module docstring for the events and their order.
    parallel: run as one rank of the current torch.distributed group (module docstring), every rank alike.
    start_from: a checkpoint (of another run, e.g. the previous iteration of a loop job) whose adapter this run
    starts from instead of a fresh one: its weights only (a fresh optimizer, step 0; resume takes precedence)."""
    tokenizer = load_tokenizer(model_dir)
    data = load_sft_data(
        Path(dataset_path), tokenizer, max_seq_len=hp.max_seq_len, eval_fraction=hp.eval_fraction, seed=hp.seed
    )
    if data.skipped:
        yield Log(f"skipped {data.skipped} of {data.num_rows} rows with no assistant/completion token within "
                  f"max_seq_len={hp.max_seq_len}", "warning")
    run = _SftRun(model_dir, data, hp, stop, base_model_name or str(model_dir), Path(work_dir), parallel)
    if resume is not None:
        run.restore(resume)
        yield Log(f"resumed at step {run.step} of {run.total_steps}")
    else:
        torch.manual_seed(hp.seed)
        if start_from is not None:
            run.start_from(start_from)
            yield Log(f"starting from the weights of a checkpoint at step {start_from.step}")
    yield Started(run.total_steps, {"train examples": len(data.train), "eval examples": len(data.eval),
                                    "trainable params": run.num_trainable})
    yield from run.train()


class _SftRun:
    def __init__(self, model_dir: Path, data: SftData, hp: SftHyperparams, stop: StopFlag, base_name: str,
                 work_dir: Path, parallel: ParallelDims | None):
        self.hp, self.stop, self.data, self.base_name, self.work_dir = hp, stop, data, base_name, work_dir
        self.lora_cfg = LoraConfig(
            rank=hp.lora_rank, alpha=hp.lora_alpha, dropout=hp.lora_dropout, target_modules=hp.target_modules
        )
        self.engine = TrainingEngine.load(model_dir, lora=self.lora_cfg, seed=hp.seed,
                                          optimizer=self._adamw(hp.learning_rate), parallel=parallel)
        self.grouped = self.engine.mesh is not None
        self.rank0 = not self.grouped or dist.get_rank() == 0
        self.model: CausalLM = self.engine.model
        self.num_trainable = self.engine.num_trainable
        self.sampler = StepSampler(
            data.train, batch_size=hp.batch_size, grad_accum=hp.gradient_accumulation_steps, seed=hp.seed
        )
        self.total_steps = hp.max_steps or self.sampler.steps_per_epoch * hp.epochs

    @property
    def step(self) -> int:
        """Optimizer steps completed (the engine counts them; a restored checkpoint sets them)."""
        return self.engine.steps

    def train(self) -> Iterator[SftEvent]:
        hp, start = self.hp, self.step
        metrics: dict[str, float] = {}
        self.model.train()
        while self.step < self.total_steps:
            step_metrics = self._train_step(self.step)
            if step_metrics is None:
                yield Finished(step=self.step, stopped=True, metrics=metrics)
                return
            metrics = step_metrics
            final = self.step == self.total_steps
            checkpoint_due = final or self.step % hp.checkpoint_every == 0
            if final or (self.step % hp.eval_every == 0 if hp.eval_every else checkpoint_due):
                metrics |= self._evaluate()
            yield Metrics(self.step, metrics)
            if checkpoint_due:
                yield from self._checkpoint(final, metrics)
        if self.step == start:  # resumed from a checkpoint at (or past) the end: report and finish again
            metrics = self._evaluate()
            if metrics:
                yield Metrics(self.step, metrics)
            yield from self._checkpoint(True, metrics)
        yield Finished(step=self.step, stopped=False, metrics=metrics)

    def _adamw(self, lr: float) -> AdamW:
        """torch's AdamW defaults (betas 0.9 / 0.999, eps 1e-8) with the job's weight decay and clipping."""
        return AdamW(learning_rate=lr, weight_decay=self.hp.weight_decay, grad_clip_norm=self.hp.max_grad_norm)

    def _nll_sum(self, mb: MicroBatch) -> torch.Tensor:
        return self.engine.nll_sum(mb.input_ids_BT, mb.targets_BT, packing=mb.packing)

    def _stop_requested(self) -> bool:
        """The stop flag; on a group rank 0's, broadcast to every rank (a collective, before every micro-batch)."""
        if not self.grouped:
            return self.stop.is_set()
        flag = torch.tensor([int(self.rank0 and self.stop.is_set())], device=self.engine.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _share(self, micro_batches: list[MicroBatch]) -> tuple[list[MicroBatch], int]:
        """This data-parallel rank's micro-batches and how many every rank runs (the largest share)."""
        shares = split_for_ranks(micro_batches, self.engine.dp_size)
        return shares[self.engine.dp_rank], max(len(share) for share in shares)

    def _pad(self, *, backward: bool) -> None:
        """A micro-batch that changes nothing, run where this rank's share is shorter than another's."""
        run_padding_micro_batch(self.model, backward=backward, device=self.engine.device,
                                cp=self.engine.context_parallel)

    def _summed(self, nll: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's micro-batches made the sum over every data-parallel rank's."""
        if self.engine.dp_size > 1:
            dist.all_reduce(nll, group=self.engine.dp_group)
        return nll

    def _train_step(self, step: int) -> dict[str, float] | None:
        """One optimizer step over its micro-batches; None when the stop flag was set before one of them."""
        hp = self.hp
        lr = learning_rate(
            step, peak_lr=hp.learning_rate, kind=hp.lr_scheduler, warmup_steps=hp.warmup_steps,
            total_steps=self.total_steps,
        )
        micro_batches = self.sampler.step_batches(step)
        num_targets = sum(mb.num_targets for mb in micro_batches)
        mine, runs = self._share(micro_batches)
        nll = torch.zeros((), device=self.engine.device)
        start = time.perf_counter()
        for i in range(runs):
            if self._stop_requested():
                return None
            if i >= len(mine):
                self._pad(backward=True)
                continue
            # Dividing every micro-batch by the whole step's target count makes accumulation equal one big batch
            # (and, the gradients summed over the ranks, a group's step the one-process step).
            mb_nll = self._nll_sum(mine[i])
            (mb_nll / num_targets).backward()
            nll += mb_nll.detach()
        grad_norm = self.engine.step(self._adamw(lr))
        loss = (self._summed(nll) / num_targets).item()  # .item() syncs, once per step
        metrics.TRAINING_STEP_SECONDS.labels("managed").observe(time.perf_counter() - start)
        metrics.TRAINING_TOKENS.labels("managed").inc(sum(mb.input_ids_BT.numel() for mb in micro_batches))
        return {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm.item(),
            "train/tokens": float(num_targets),
            "train/epoch": (step + 1) / self.sampler.steps_per_epoch,
        }

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Token-weighted mean NLL over the held-out split ({} when there is none)."""
        if not self.data.eval:
            return {}
        self.model.eval()
        micro_batches = batches(self.data.eval, self.hp.batch_size)
        mine, runs = self._share(micro_batches)
        nll = torch.zeros((), device=self.engine.device)
        for mb in mine:
            nll += self._nll_sum(mb)
        for _ in range(runs - len(mine)):
            self._pad(backward=False)
        self.model.train()
        num_targets = sum(mb.num_targets for mb in micro_batches)
        return {"eval/loss": (self._summed(nll) / num_targets).item()}  # .item() syncs

    def _checkpoint(self, final: bool, metrics: dict[str, float]) -> Iterator[SftEvent]:
        root = self.work_dir / "checkpoints" / f"step-{self.step:07d}"
        progress = {
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.step / self.sampler.steps_per_epoch,
            "train_examples": len(self.data.train),
            "eval_examples": len(self.data.eval),
            "hyperparams": self.hp.to_json(),
            "metrics": metrics,
        }
        self.engine.save(root, base_model=self.base_name, progress=progress)
        self._save_more_state(root / STATE_DIR)
        yield Checkpoint(SftCheckpoint(step=self.step, root=root), final, metrics)
        if self.rank0:  # rank 0's caller has persisted it; a long run must not fill the worker's disk
            shutil.rmtree(root)

    def _save_more_state(self, state_dir: Path) -> None:
        """Files a method adds to a checkpoint's state/ beside the engine's (DPO: its reference logprobs); none."""

    def start_from(self, ckpt: SftCheckpoint) -> None:
        """Load a checkpoint's weights only (the adapter, or every weight): no optimizer state, RNG or step."""
        saved = self._read(ckpt, "started from")
        self._load(saved, ckpt, everything=False)

    def restore(self, ckpt: SftCheckpoint) -> None:
        """Load the adapter, optimizer, RNG state and step of a checkpoint: everything checked first."""
        saved = self._read(ckpt, "resumed")
        trained_on = saved.progress.get("train_examples")
        if trained_on != len(self.data.train):
            raise ValueError(
                f"The checkpoint at step {ckpt.step} was trained on {trained_on} examples but this run "
                f"has {len(self.data.train)}; resume with the same dataset, max_seq_len, eval_fraction and seed"
            )
        self._load(saved, ckpt, everything=True)

    @staticmethod
    def _read(ckpt: SftCheckpoint, verb: str):
        try:
            return read_checkpoint(Path(ckpt.root))
        except CheckpointMismatch as exc:
            raise ValueError(f"The checkpoint at step {ckpt.step} cannot be {verb}: {exc}") from None

    def _load(self, saved, ckpt: SftCheckpoint, *, everything: bool) -> None:
        """The checkpoint's layout checked against this run's (LoRA rank and targets, or full-parameter), then its
        weights (and, with everything, its optimizer state, RNG state and step) loaded into the engine."""
        if self.lora_cfg is None:
            if saved.lora is not None:
                raise ValueError(f"The checkpoint at step {ckpt.step} is a LoRA one; this run is full-parameter")
        elif saved.lora is None or (saved.lora.rank, saved.lora.target_modules) != (self.lora_cfg.rank,
                                                                                  self.lora_cfg.target_modules):
            raise ValueError(f"The checkpoint at step {ckpt.step} does not match this run's LoRA layout (lora rank, "
                             "target_modules or base model)")
        try:
            self.engine.restore(saved, weights=True, optimizer=everything, rng=everything)
        except CheckpointMismatch as exc:
            raise ValueError(f"The checkpoint at step {ckpt.step} does not fit this run: {exc}") from None
