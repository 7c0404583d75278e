"""Managed DPO (direct preference optimization): its settings, declared once (see trainyard.methods.spec).

A DPO job trains on preference pairs ({"prompt", "chosen", "rejected"} rows) with the loss of Rafailov et al.:
    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
where pi and ref are the summed logprobs of a response's tokens under the model in training and under the frozen
starting model. It trains a LoRA adapter (the LoRA settings) or every weight (full_parameter), with the optimizer
loop of supervised fine-tuning (LoopSettings: batch_size counts pairs here). The worker's recipe
(services/worker/recipes/dpo.py) runs it through services/trainer/dpo.py; docs/dpo.md describes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.methods.lora import LoraSettings, TrainingModeSettings
from trainyard.methods.sft import LoopSettings
from trainyard.methods.spec import setting


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference loss adds to the loop: how far the policy may move from the reference, label noise."""

    beta: float = setting(
        0.1, label="Beta", gt=0, le=100,
        help="Strength of the pull toward the reference model: the implicit reward is beta x the logprob change")
    label_smoothing: float = setting(
        0.0, label="Label smoothing", ge=0, lt=0.5, advanced=True,
        help="Assumed share of flipped preference labels (conservative DPO); 0: plain DPO")


@dataclass(frozen=True)
class DpoSettings(PreferenceSettings, TrainingModeSettings, LoopSettings, LoraSettings):
    """DPO on preference pairs: a LoRA adapter, or every weight with full_parameter; batch_size counts pairs."""
