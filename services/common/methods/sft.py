"""Managed SFT's settings on the server: the declaration (trainyard/methods/sft.py) resolved (resolved.py).

The scheduler validates a request with ``SftHyperparams.from_request`` (violations name the request field, e.g.
"spec.sft.learning_rate") and stores ``to_json()``; the worker rebuilds the same object with ``from_json`` and the
trainer (services/trainer/sft.py) reads its fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.common.methods.resolved import Resolved, lora_target_problem
from trainyard.methods import METHODS
from trainyard.methods.sft import SftSettings
from trainyard.methods.spec import declared_field

LR_SCHEDULERS = declared_field(SftSettings, "lr_scheduler").setting.choices


@dataclass(frozen=True)
class SftHyperparams(Resolved, SftSettings):
    request_prefix: ClassVar[str] = METHODS["sft"].prefix


__all__ = ["LR_SCHEDULERS", "SftHyperparams", "lora_target_problem"]
