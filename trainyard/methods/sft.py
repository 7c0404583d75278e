"""Managed supervised fine-tuning: its settings, declared once (see trainyard.methods.spec).

The worker's recipe (services/worker/recipes/sft.py) trains with them through services/trainer/sft.py; the server adds
only the checks that need the model directory (services/common/methods/).
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.methods.lora import LoraSettings
from trainyard.methods.spec import setting

MAX_STEPS = 10**7  # upper bound of every step count


@dataclass(frozen=True)
class LoopSettings:
    """The optimizer loop of a supervised method: steps, batches, schedule, evaluation and checkpoints."""

    learning_rate: float = setting(
        1e-4, label="Learning rate", flag="--lr", aliases=("--learning-rate",), gt=0, lt=1,
        help="Peak learning rate of AdamW")
    epochs: int = setting(1, label="Epochs", ge=1, le=1000, help="Passes over the train split (unless max steps is set)")
    max_steps: int | None = setting(
        None, label="Max steps", ge=1, le=MAX_STEPS, unit="steps",
        help="Optimizer steps to run; unset: epochs x steps per epoch")
    batch_size: int = setting(
        4, label="Batch size", ge=1, le=1024, unit="sequences", help="Sequences per micro-batch")
    gradient_accumulation_steps: int = setting(
        1, label="Gradient accumulation", flag="--grad-accum", aliases=("--gradient-accumulation-steps",), ge=1,
        le=1024, help="Micro-batches per optimizer step")
    warmup_steps: int = setting(
        0, label="Warmup steps", ge=0, le=MAX_STEPS, advanced=True, help="Steps of linear warmup to the peak rate")
    lr_scheduler: str = setting(
        "cosine", label="LR schedule", choices=("cosine", "linear", "constant"), advanced=True,
        help="Decay of the learning rate after warmup")
    weight_decay: float = setting(0.0, label="Weight decay", ge=0, lt=1, advanced=True, help="AdamW weight decay")
    max_seq_len: int = setting(
        2048, label="Max sequence length", ge=16, le=1 << 20, unit="tokens", advanced=True,
        help="Rows are truncated to this many tokens (at most the model's context length)")
    eval_fraction: float = setting(
        0.1, label="Eval fraction", ge=0, lt=0.5, help="Share of rows held out for the eval loss; 0: no eval")
    eval_every: int = setting(
        0, label="Eval every", ge=0, le=MAX_STEPS, unit="steps", advanced=True,
        help="Steps between eval passes; 0: at each checkpoint")
    checkpoint_every: int = setting(
        50, label="Checkpoint every", ge=1, le=MAX_STEPS, unit="steps", help="Steps between checkpoints")
    seed: int = setting(0, label="Seed", advanced=True, help="Seed of the data order, the split and the adapter init")
    max_grad_norm: float = setting(
        1.0, label="Max gradient norm", ge=0, advanced=True, help="Gradient clipping norm; 0: no clipping")


@dataclass(frozen=True)
class SftSettings(LoopSettings, LoraSettings):
    """LoRA SFT on chat or prompt/completion rows: the loss is the NLL of the assistant / completion tokens."""
