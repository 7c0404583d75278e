"""The LoRA settings every job method shares, with the platform's one set of LoRA defaults.

Rank 32, alpha 32 (Tinker's convention: alpha stays 32 whatever the rank), no dropout, every attention and MLP
projection of the model. Managed jobs declare these fields by inheriting LoraSettings; the Training API's sessions
(services/trainer/session_spec.py) take their rank and alpha defaults from here too.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.methods.spec import setting


@dataclass(frozen=True)
class LoraSettings:
    lora_rank: int = setting(
        32, label="LoRA rank", proto="lora.rank", flag="--rank", aliases=("--lora-rank",), ge=1, le=1024,
        help="Adapter size: the rank of each low-rank update")
    lora_alpha: float = setting(
        32.0, label="LoRA alpha", proto="lora.alpha", flag="--alpha", aliases=("--lora-alpha",), gt=0,
        help="Adapter scale: updates are multiplied by alpha / rank")
    lora_dropout: float = setting(
        0.0, label="LoRA dropout", proto="lora.dropout", flag="--dropout", aliases=("--lora-dropout",), ge=0, lt=1,
        advanced=True, help="Dropout on the adapter's input")
    # Empty means the default menu (models.lora_targets.DEFAULT_TARGETS): the server fills it in, so the list of
    # projection names lives with the model code only.
    target_modules: tuple[str, ...] = setting(
        (), label="LoRA target modules", proto="lora.target_modules", flag="--target", names=True, advanced=True,
        help="Module names to adapt, e.g. q_proj (repeat the flag); empty: every attention and MLP projection")


@dataclass(frozen=True)
class TrainingModeSettings:
    """Whether a job trains a LoRA adapter (the default) or every weight of the model. Full-parameter jobs ignore the
    LoRA settings; their checkpoints hold the whole model (a Hugging Face-format directory) instead of an adapter."""

    full_parameter: bool = setting(
        False, label="Full-parameter", help="Train every weight of the model instead of a LoRA adapter")


LORA_DEFAULTS = LoraSettings()
