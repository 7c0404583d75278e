"""Managed DPO: the training run a worker drives for one DPO job, as the same stream of events as managed SFT
(services/trainer/sft.py: Log, Started, Metrics, Checkpoint, ..., Finished), on the same training engine, with
checkpoints it resumes from bit-exactly.

Shapes: P pairs in a micro-batch, S = 2 P sequences (chosen_0, rejected_0, chosen_1, ...: data.collate_pairs).

A sequence's logprob is the sum of its response tokens' logprobs (the loss mask of data.tokenize_pairs: the prompt
carries none), from the engine's forward and chunked logprob head (engine.sequence_logprobs: never [N, V] logits).
For pair i with policy logprobs pi_c, pi_r and reference logprobs ref_c, ref_r:
    z_i = beta * ((pi_c - ref_c) - (pi_r - ref_r))         the reward margin (chosen reward - rejected reward)
    loss_i = -(1 - eps) * log sigmoid(z_i) - eps * log sigmoid(-z_i)      eps = label_smoothing (0: plain DPO)
and a step's loss is the mean of loss_i over the step's pairs: each micro-batch's backward is of its summed loss_i /
the step's pair count, so gradient accumulation equals one big batch, as in SFT.

The reference logprobs (ref_c, ref_r of every train and held-out pair) come from ONE pass over the data at the start,
without gradients and in eval mode (so no random numbers are drawn): for a LoRA job the base model with the adapter
switched off, for a full-parameter job the weights before the first step. They are kept in every checkpoint's state
(state/dpo_reference.pt) and a resumed run reads them from there instead of computing them again (a full-parameter
run could not: its starting weights are gone). The pass checks the stop flag before each of its micro-batches; a
stop there ends the run with Finished(step 0, stopped=True) and no checkpoint.

Order of one optimizer step s and what a checkpoint holds are SFT's (the run is sft._SftRun's loop with DPO's step,
evaluation and state): lr(s) -> per micro-batch: stop.is_set()? -> forward -> backward -> grad norm (+ clip) ->
AdamW step -> eval if due -> Metrics(s + 1) -> checkpoint if due. The data position is a pure function of (seed,
step) (data.StepSampler over the pairs), so resuming at k and running to N gives the same weights, bit for bit, as
running 0..N straight (deterministic kernels, a fixed thread count).

One process only: a DPO job does not run on a torchrun group (the recipe refuses managed_nproc > 1).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.lora import LoraConfig, set_active_adapter
from models.tokenizer import load_tokenizer
from services.common import metrics
from services.common.methods.dpo import DpoHyperparams
from services.trainer.data import (MicroBatch, PreferenceData, PreferencePair, StepSampler, batches, collate_pairs,
                                   load_preference_data)
from services.trainer.engine import TrainingEngine
from services.trainer.engine.checkpoint import STATE_DIR
from services.trainer.schedule import learning_rate
from services.trainer.sft import Finished, Log, SftCheckpoint, SftEvent, Started, StopFlag, _SftRun

REFERENCE_FILE = "dpo_reference.pt"  # in a checkpoint's state/: {"train": [n, 2], "eval": [m, 2]} float32


@dataclass
class PairBatch:
    """A micro-batch of pairs and their reference logprobs ([P, 2]: chosen, rejected)."""

    batch: MicroBatch
    reference_P2: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.reference_P2.shape[0]


def dpo_losses(policy_S: torch.Tensor, reference_P2: torch.Tensor, *, beta: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_P, chosen reward_P, rejected reward_P) of P pairs: policy_S the S = 2 P sequences' logprobs (chosen,
    rejected, chosen, ...), reference_P2 theirs under the reference. The rewards are beta x the logprob change; the
    loss is DPO's (module docstring) on their difference."""
    policy_P2 = policy_S.view(-1, 2)
    rewards_P2 = beta * (policy_P2 - reference_P2.to(policy_P2.device))
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    loss_P = -F.logsigmoid(margin_P)
    if label_smoothing:
        loss_P = (1 - label_smoothing) * loss_P - label_smoothing * F.logsigmoid(-margin_P)
    return loss_P, rewards_P2[:, 0], rewards_P2[:, 1]


@torch.no_grad()
def reference_logprobs(engine: TrainingEngine, pairs: list[PreferencePair], batch_size: int, *,
                       stop: StopFlag | None = None) -> torch.Tensor | None:
    """[n, 2] float32 on the CPU: each pair's chosen and rejected logprob under the reference model -- the engine's
    model as it is, with a LoRA adapter switched off -- in eval mode (no dropout, no random numbers drawn). None when
    stop was set before one of its micro-batches."""
    out = torch.zeros(len(pairs), 2)
    if not pairs:
        return out
    model, was_training = engine.model, engine.model.training
    model.eval()
    if engine.lora is not None:
        set_active_adapter(model, None)
    try:
        at = 0
        for mb in batches(pairs, batch_size, collate_pairs):
            if stop is not None and stop.is_set():
                return None
            logprobs_S = engine.sequence_logprobs(mb.input_ids_BT, mb.targets_BT, packing=mb.packing)
            n = logprobs_S.shape[0] // 2
            out[at:at + n] = logprobs_S.view(n, 2).float().cpu()
            at += n
    finally:
        if engine.lora is not None:
            set_active_adapter(model, engine.adapter)
        model.train(was_training)
    return out


def run_dpo(model_dir: Path, dataset_path: Path, hp: DpoHyperparams, *, stop: StopFlag,
            resume: SftCheckpoint | None = None, base_model_name: str = "",
            work_dir: Path, start_from: SftCheckpoint | None = None) -> Iterator[SftEvent]:
    """Train with DPO on the JSONL preference pairs (a LoRA adapter, or every weight with hp.full_parameter); the
    events and their order are run_sft's (services/trainer/sft.py). start_from: run_sft's (weights only), loaded
    before the reference logprobs are computed (LoRA: the reference stays the base model, adapter off)."""
    tokenizer = load_tokenizer(model_dir)
    data = load_preference_data(Path(dataset_path), tokenizer, max_seq_len=hp.max_seq_len,
                                eval_fraction=hp.eval_fraction, seed=hp.seed)
    if data.skipped:
        yield Log(f"skipped {data.skipped} of {data.num_rows} rows with a response that has no token within "
                  f"max_seq_len={hp.max_seq_len}", "warning")
    run = _DpoRun(Path(model_dir), data, hp, stop, base_model_name or str(model_dir), Path(work_dir))
    if resume is not None:
        run.restore(resume)
        yield Log(f"resumed at step {run.step} of {run.total_steps} (reference logprobs from the checkpoint)")
    else:
        torch.manual_seed(hp.seed)
        if start_from is not None:
            run.start_from(start_from)
            yield Log(f"starting from the weights of a checkpoint at step {start_from.step}")
        start = time.perf_counter()
        if not run.compute_reference():
            yield Finished(step=0, stopped=True, metrics={})
            return
        yield Log(f"reference logprobs of {len(data.train) + len(data.eval)} pairs computed in "
                  f"{time.perf_counter() - start:.1f}s ({'initial weights' if hp.full_parameter else 'adapter off'})")
    yield Started(run.total_steps, {"train pairs": len(data.train), "eval pairs": len(data.eval),
                                    "trainable params": run.num_trainable,
                                    "mode": "full-parameter" if hp.full_parameter else "LoRA"})
    yield from run.train()


class _DpoRun(_SftRun):
    """SFT's run loop (train, checkpoints, stop flag) with DPO's step, evaluation and reference state."""

    def __init__(self, model_dir: Path, data: PreferenceData, hp: DpoHyperparams, stop: StopFlag, base_name: str,
                 work_dir: Path):
        self.hp, self.stop, self.data, self.base_name, self.work_dir = hp, stop, data, base_name, work_dir
        self.lora_cfg = None if hp.full_parameter else LoraConfig(
            rank=hp.lora_rank, alpha=hp.lora_alpha, dropout=hp.lora_dropout, target_modules=hp.target_modules)
        self.engine = TrainingEngine.load(model_dir, lora=self.lora_cfg, seed=hp.seed,
                                          optimizer=self._adamw(hp.learning_rate))
        self.grouped, self.rank0 = False, True
        self.model = self.engine.model
        self.num_trainable = self.engine.num_trainable
        self.reference: dict[str, torch.Tensor] | None = None  # "train" / "eval": [n, 2]
        self.sampler = StepSampler(list(range(len(data.train))), batch_size=hp.batch_size,
                                   grad_accum=hp.gradient_accumulation_steps, seed=hp.seed,
                                   collate=self._train_batch)
        self.total_steps = hp.max_steps or self.sampler.steps_per_epoch * hp.epochs

    def compute_reference(self) -> bool:
        """The reference logprobs of every pair; False when the stop flag ended the pass (nothing kept)."""
        reference = {}
        for split, pairs in (("train", self.data.train), ("eval", self.data.eval)):
            reference[split] = reference_logprobs(self.engine, pairs, self.hp.batch_size, stop=self.stop)
            if reference[split] is None:
                return False
        self.reference = reference
        return True

    def _train_batch(self, indices: list[int]) -> PairBatch:
        return PairBatch(collate_pairs([self.data.train[i] for i in indices]), self.reference["train"][indices])

    def _losses(self, pb: PairBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mb = pb.batch
        policy_S = self.engine.sequence_logprobs(mb.input_ids_BT, mb.targets_BT, packing=mb.packing)
        return dpo_losses(policy_S, pb.reference_P2, beta=self.hp.beta, label_smoothing=self.hp.label_smoothing)

    @staticmethod
    def _sums(loss_P: torch.Tensor, chosen_P: torch.Tensor, rejected_P: torch.Tensor) -> torch.Tensor:
        """[5]: summed loss, margin, correctly ordered pairs, chosen and rejected rewards (detached)."""
        margin_P = (chosen_P - rejected_P).detach()
        return torch.stack([loss_P.detach().sum(), margin_P.sum(), (margin_P > 0).float().sum(),
                            chosen_P.detach().sum(), rejected_P.detach().sum()])

    def _train_step(self, step: int) -> dict[str, float] | None:
        """One optimizer step over its micro-batches; None when the stop flag was set before one of them."""
        hp = self.hp
        lr = learning_rate(step, peak_lr=hp.learning_rate, kind=hp.lr_scheduler, warmup_steps=hp.warmup_steps,
                           total_steps=self.total_steps)
        pair_batches: list[PairBatch] = self.sampler.step_batches(step)
        num_pairs = sum(pb.num_pairs for pb in pair_batches)
        sums = torch.zeros(5, device=self.engine.device)
        start = time.perf_counter()
        for pb in pair_batches:
            if self.stop.is_set():
                return None
            loss_P, chosen_P, rejected_P = self._losses(pb)
            (loss_P.sum() / num_pairs).backward()  # the step's mean over its pairs, however they are split
            sums += self._sums(loss_P, chosen_P, rejected_P)
        grad_norm = self.engine.step(self._adamw(lr))
        loss, margin, accuracy, chosen, rejected = (sums / num_pairs).tolist()  # syncs, once per step
        metrics.TRAINING_STEP_SECONDS.labels("managed").observe(time.perf_counter() - start)
        metrics.TRAINING_TOKENS.labels("managed").inc(sum(pb.batch.input_ids_BT.numel() for pb in pair_batches))
        return {
            "train/loss": loss,
            "train/reward_margin": margin,
            "train/reward_accuracy": accuracy,
            "train/chosen_reward": chosen,
            "train/rejected_reward": rejected,
            "train/lr": lr,
            "train/grad_norm": grad_norm.item(),
            "train/pairs": float(num_pairs),
            "train/epoch": (step + 1) / self.sampler.steps_per_epoch,
        }

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """The held-out pairs' mean loss, reward margin and accuracy ({} when there are none)."""
        pairs = self.data.eval
        if not pairs:
            return {}
        self.model.eval()
        sums = torch.zeros(5, device=self.engine.device)
        at = 0
        for mb in batches(pairs, self.hp.batch_size, collate_pairs):
            n = len(mb.packing.lengths) // 2
            sums += self._sums(*self._losses(PairBatch(mb, self.reference["eval"][at:at + n])))
            at += n
        self.model.train()
        loss, margin, accuracy, chosen, rejected = (sums / len(pairs)).tolist()
        return {"eval/loss": loss, "eval/reward_margin": margin, "eval/reward_accuracy": accuracy,
                "eval/chosen_reward": chosen, "eval/rejected_reward": rejected}

    def _save_more_state(self, state_dir: Path) -> None:
        torch.save({split: t.clone() for split, t in self.reference.items()}, state_dir / REFERENCE_FILE)

    def restore(self, ckpt: SftCheckpoint) -> None:
        """Load the weights, optimizer, RNG state, step and reference logprobs of a checkpoint: everything checked
        first."""
        saved = self._read(ckpt, "resumed")
        counts = (saved.progress.get("train_examples"), saved.progress.get("eval_examples"))
        if counts != (len(self.data.train), len(self.data.eval)):
            raise ValueError(
                f"The checkpoint at step {ckpt.step} was trained on {counts[0]} pairs ({counts[1]} held out) but this "
                f"run has {len(self.data.train)} ({len(self.data.eval)}); resume with the same dataset, max_seq_len, "
                "eval_fraction and seed")
        path = Path(ckpt.root) / STATE_DIR / REFERENCE_FILE
        try:
            reference = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise ValueError(f"The checkpoint at step {ckpt.step} holds no readable DPO reference logprobs "
                             f"({REFERENCE_FILE}): {exc}") from None
        shapes = {split: tuple(reference[split].shape) if split in reference else None for split in ("train", "eval")}
        if shapes != {"train": (len(self.data.train), 2), "eval": (len(self.data.eval), 2)}:
            raise ValueError(f"The checkpoint at step {ckpt.step}'s reference logprobs have shapes {shapes}, not "
                             f"this run's pairs ({len(self.data.train)} train, {len(self.data.eval)} held out)")
        self._load(saved, ckpt, everything=True)  # the layout checked, then weights, optimizer, RNG and step
        self.reference = reference
