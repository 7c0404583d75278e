"""Rollout service settings (env TRAINYARD_*, see services/common/config.py)."""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from services.common.config import TrainyardSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RolloutSettings(TrainyardSettings):
    # LoRA adapters holding weights at once (least recently used are freed first and reloaded on their next use).
    max_loaded_adapters: int = Field(default=8, ge=1)
    # Precision and device of the base weights; adapters stay float32 (as peft keeps them).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field(default="cpu", description="torch device for the models, e.g. 'cpu' or 'cuda:0'")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        try:
            return str(torch.device(v))
        except RuntimeError as exc:
            raise ValueError(f"not a torch device: {v!r} ({exc})") from None

    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def adapters_dir(self):
        return self.data_dir / "rollout" / "adapters"
