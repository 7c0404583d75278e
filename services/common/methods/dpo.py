"""Managed DPO's settings on the server: the declaration (trainyard/methods/dpo.py) resolved (resolved.py).

The scheduler validates a request with ``DpoHyperparams.from_request`` (violations name the request field, e.g.
"spec.dpo.beta") and stores ``to_json()``; the worker rebuilds the same object with ``from_json`` and the trainer
(services/trainer/dpo.py) reads its fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.common.methods.resolved import Resolved
from trainyard.methods import METHODS
from trainyard.methods.dpo import DpoSettings


@dataclass(frozen=True)
class DpoHyperparams(Resolved, DpoSettings):
    request_prefix: ClassVar[str] = METHODS["dpo"].prefix


__all__ = ["DpoHyperparams"]
