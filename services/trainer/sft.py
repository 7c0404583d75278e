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
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from models import CausalLM
from models.lora import LoraConfig
from models.tokenizer import load_tokenizer
from services.common import metrics
from services.common.methods.sft import SftHyperparams
from services.trainer.data import MicroBatch, SftData, StepSampler, batches, load_sft_data
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.checkpoint import STATE_DIR, WEIGHTS_DIR, CheckpointMismatch, read_checkpoint
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
            resume: SftCheckpoint | None = None, base_model_name: str = "", work_dir: Path) -> Iterator[SftEvent]:
    """Train a LoRA adapter on the JSONL dataset; see the module docstring for the events and their order."""
    tokenizer = load_tokenizer(model_dir)
    data = load_sft_data(
        Path(dataset_path), tokenizer, max_seq_len=hp.max_seq_len, eval_fraction=hp.eval_fraction, seed=hp.seed
    )
    if data.skipped:
        yield Log(f"skipped {data.skipped} of {data.num_rows} rows with no assistant/completion token within "
                  f"max_seq_len={hp.max_seq_len}", "warning")
    run = _SftRun(model_dir, data, hp, stop, base_model_name or str(model_dir), Path(work_dir))
    if resume is not None:
        run.restore(resume)
        yield Log(f"resumed at step {run.step} of {run.total_steps}")
    else:
        torch.manual_seed(hp.seed)
    yield Started(run.total_steps, {"train examples": len(data.train), "eval examples": len(data.eval),
                                    "trainable params": run.num_trainable})
    yield from run.train()


class _SftRun:
    def __init__(self, model_dir: Path, data: SftData, hp: SftHyperparams, stop: StopFlag, base_name: str,
                 work_dir: Path):
        self.hp, self.stop, self.data, self.base_name, self.work_dir = hp, stop, data, base_name, work_dir
        self.lora_cfg = LoraConfig(
            rank=hp.lora_rank, alpha=hp.lora_alpha, dropout=hp.lora_dropout, target_modules=hp.target_modules
        )
        self.engine = TrainingEngine.load(model_dir, lora=self.lora_cfg, seed=hp.seed,
                                          optimizer=self._adamw(hp.learning_rate))
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

    def _train_step(self, step: int) -> dict[str, float] | None:
        """One optimizer step over its micro-batches; None when the stop flag was set before one of them."""
        hp = self.hp
        lr = learning_rate(
            step, peak_lr=hp.learning_rate, kind=hp.lr_scheduler, warmup_steps=hp.warmup_steps,
            total_steps=self.total_steps,
        )
        micro_batches = self.sampler.step_batches(step)
        num_targets = sum(mb.num_targets for mb in micro_batches)
        nll = torch.zeros((), device=self.engine.device)
        start = time.perf_counter()
        for mb in micro_batches:
            if self.stop.is_set():
                return None
            # Dividing every micro-batch by the whole step's target count makes accumulation equal one big batch.
            mb_nll = self._nll_sum(mb)
            (mb_nll / num_targets).backward()
            nll += mb_nll.detach()
        grad_norm = self.engine.step(self._adamw(lr))
        loss = (nll / num_targets).item()  # .item() syncs, once per step
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
        nll = torch.zeros((), device=self.engine.device)
        num_targets = 0
        for mb in batches(self.data.eval, self.hp.batch_size):
            nll += self._nll_sum(mb)
            num_targets += mb.num_targets
        self.model.train()
        return {"eval/loss": (nll / num_targets).item()}  # .item() syncs

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
        yield Checkpoint(SftCheckpoint(step=self.step, root=root), final, metrics)
        shutil.rmtree(root)  # the caller has persisted it; a long run must not fill the worker's disk

    def restore(self, ckpt: SftCheckpoint) -> None:
        """Load the adapter, optimizer, RNG state and step of a checkpoint: everything checked first."""
        try:
            saved = read_checkpoint(Path(ckpt.root))
        except CheckpointMismatch as exc:
            raise ValueError(f"The checkpoint at step {ckpt.step} cannot be resumed: {exc}") from None
        trained_on = saved.progress.get("train_examples")
        if trained_on != len(self.data.train):
            raise ValueError(
                f"The checkpoint at step {ckpt.step} was trained on {trained_on} examples but this run "
                f"has {len(self.data.train)}; resume with the same dataset, max_seq_len, eval_fraction and seed"
            )
        if saved.lora is None or (saved.lora.rank, saved.lora.target_modules) != (self.lora_cfg.rank,
                                                                                  self.lora_cfg.target_modules):
            raise ValueError(f"The checkpoint at step {ckpt.step} does not match this run's LoRA layout (lora rank, "
                             "target_modules or base model)")
        try:
            self.engine.restore(saved, weights=True, optimizer=True, rng=True)
        except CheckpointMismatch as exc:
            raise ValueError(f"The checkpoint at step {ckpt.step} does not fit this run: {exc}") from None
