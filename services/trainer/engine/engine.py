"""The training engine: one model in training and everything done to it, the same for every caller.

    TrainingEngine.load(model_dir, lora=..., ...)   build: load the weights (device, dtype: `training_dtype`), add a
                                                    LoRA adapter or make every weight trainable, AdamW over them
    engine.nll_sum(ids_BT, targets_BT)              forward to hidden states + the chunked logprob head (logprobs.py)
    engine.loss_call(req, ...)                      a micro-batched forward / backward of datums under a built-in
                                                    loss (forward_backward.py)
    engine.step(AdamW(...))                         clip / measure the gradient norm, AdamW step, clear gradients
    engine.training_state()                         the optimizer and RNG state a bit-exact resume needs, restored
                                                    by load_optimizer_state / load_rng_state

Managed SFT (services/trainer/sft.py), Training API sessions (services/trainer/sessions.py) and `trainyard validate`
(services/trainer/validate.py) all train through it; none keeps a loop of its own. A LoRA session on a shared base
builds its engine around the base it shares (`TrainingEngine(model, params, ...)`): the engine owns the session's
parameters and optimizer, not the base.

This is the seam where the distributed trainer adds a device mesh: building, stepping and the training state go
through here, so sharding the parameters and the optimizer state (and a controller driving several ranks) changes
this module, not its callers.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kernels import Packing
from models import load_pretrained
from models.lora import LoraConfig, apply_lora, set_trainable
from services.trainer.engine.forward_backward import LossCall, LossRequest
from services.trainer.engine.logprobs import target_nll_sum
from services.trainer.engine.optim import AdamW, make_optimizer, optimizer_step


def training_device(device: str | torch.device | None = None) -> torch.device:
    """The device to train on: the one asked for, else CUDA when there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def training_dtype(device: torch.device, *, full_parameter: bool) -> torch.dtype:
    """The weights' dtype: a frozen LoRA base in bf16 on CUDA (half the memory; the adapter stays float32, see
    models.lora), float32 otherwise (every CPU run, and full-parameter training, whose AdamW updates need it)."""
    return torch.bfloat16 if device.type == "cuda" and not full_parameter else torch.float32


class TrainingEngine:
    def __init__(self, model: nn.Module, params: list[nn.Parameter], *, optimizer: AdamW, device: torch.device):
        self.model, self.params, self.device = model, params, device
        self.optimizer = make_optimizer(params, optimizer)

    @classmethod
    def load(cls, model_dir: str | Path, *, lora: LoraConfig | None, seed: int, optimizer: AdamW,
             device: str | torch.device | None = None) -> TrainingEngine:
        """A model directory ready to train: a LoRA adapter (lora) or every weight (lora None) trainable."""
        device = training_device(device)
        model = load_pretrained(model_dir, dtype=training_dtype(device, full_parameter=lora is None), device=device)
        params = apply_lora(model, lora, seed=seed) if lora is not None else set_trainable(model, "full")
        return cls(model.train(), params, optimizer=optimizer, device=device)

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    def nll_sum(self, input_ids_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                packing: Packing | None = None) -> torch.Tensor:
        """Summed float32 NLL of the target tokens (logprobs.target_nll_sum), inputs moved to the engine's device."""
        return target_nll_sum(self.model, input_ids_BT.to(self.device), targets_BT.to(self.device), packing=packing)

    def step(self, settings: AdamW) -> torch.Tensor:
        """One optimizer step over the accumulated gradients (optim.optimizer_step); the gradient norm."""
        return optimizer_step(self.params, self.optimizer, settings)

    def loss_call(self, req: LossRequest, *, backward: bool, deterministic: bool, lock) -> LossCall:
        """A Training API Forward / ForwardBackward over this engine's model and parameters (forward_backward.py);
        lock: a context manager held around each micro-batch (the shared base's, with the session's adapter on)."""
        return LossCall(self.model, self.params, req, backward=backward, deterministic=deterministic,
                        device=self.device, lock=lock)

    # -- the state a resume needs ----------------------------------------------------------------------------------
    def training_state(self) -> dict:
        """The optimizer's state_dict and the RNG state (LoRA dropout draws from the global generator)."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"optimizer": self.optimizer.state_dict(), "rng": rng}

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def load_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["cpu"])
        if self.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def release(self) -> None:
        """Drop the gradients and the optimizer state (the parameters stay with the model, which the caller frees)."""
        for p in self.params:
            p.grad = None
        self.params = []
        self.optimizer.state.clear()
