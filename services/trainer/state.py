"""SaveState / LoadState files: what a Training API session needs to continue exactly where it stopped.

Layout of a saved state (a checkpoint row: `files` = weights/, `state` = state/, both in the blob store):
    weights/   LoRA: the PEFT adapter (adapter_config.json, adapter_model.safetensors), deployable as it is;
               full-parameter: the Hugging Face model directory (config.json, *.safetensors)
    state/     session_state.json: format, base model, LoRA config (rank, alpha, targets), seed, optimizer step
               and seq counters; optimizer.pt: the AdamW state_dict (moments and per-parameter step counts)

Weights are stored in float32 as they are and the optimizer state with torch.save, so loading them gives the same
bits and training continues exactly as if it had never stopped. Every check (format, LoRA layout, tensor names and
shapes, optimizer layout) runs before anything is copied into a session, so a state that does not fit changes
nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from models import load_pretrained, save_pretrained
from models.lora import ADAPTER_WEIGHTS, LoraConfig, lora_state_dict, save_peft_adapter

STATE_FILE = "session_state.json"
OPTIMIZER_FILE = "optimizer.pt"
FORMAT = "trainyard.session_state.v1"


class StateMismatch(ValueError):
    """The saved state does not fit (the message says what differs)."""


@dataclass
class SavedState:
    base_model: str
    full_parameter: bool
    lora: LoraConfig | None
    seed: int
    optim_steps: int
    next_seq_id: int
    weights_dir: Path
    state_dir: Path

    @property
    def has_optimizer(self) -> bool:
        return (self.state_dir / OPTIMIZER_FILE).is_file()


def write_state(out: Path, *, model: nn.Module, adapter: str | None, lora: LoraConfig | None, base_model: str,
                seed: int, optimizer: torch.optim.Optimizer, optim_steps: int, next_seq_id: int) -> None:
    weights_dir, state_dir = out / "weights", out / "state"
    if lora is None:
        save_pretrained(model, weights_dir)
    else:
        save_peft_adapter(model, lora, weights_dir, base_model_name_or_path=base_model, adapter_name=adapter)
    state_dir.mkdir(parents=True)
    torch.save(optimizer.state_dict(), state_dir / OPTIMIZER_FILE)
    meta = {"format": FORMAT, "base_model": base_model, "full_parameter": lora is None, "seed": seed,
            "optim_steps": optim_steps, "next_seq_id": next_seq_id,
            "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                               "target_modules": list(lora.target_modules)}}
    (state_dir / STATE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_state(root: Path) -> SavedState:
    """The state laid out under root (weights/, state/); StateMismatch if it is not a session state."""
    path = root / "state" / STATE_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StateMismatch(f"not a Training API session state (no readable {STATE_FILE}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateMismatch(f"not a Training API session state ({STATE_FILE} format is not {FORMAT!r})")
    try:
        lora = meta["lora"]
        return SavedState(
            base_model=str(meta["base_model"]), full_parameter=bool(meta["full_parameter"]),
            lora=None if lora is None else LoraConfig(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                                                      target_modules=tuple(lora["target_modules"])),
            seed=int(meta["seed"]), optim_steps=int(meta["optim_steps"]), next_seq_id=int(meta["next_seq_id"]),
            weights_dir=root / "weights", state_dir=root / "state")
    except (KeyError, TypeError, ValueError) as exc:
        raise StateMismatch(f"{STATE_FILE} is malformed: {exc!r}") from None


def lora_tensors(saved: SavedState, model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The saved adapter tensors, checked against the adapter `adapter` of model (names and shapes)."""
    tensors = load_file(str(saved.weights_dir / ADAPTER_WEIGHTS))
    return _checked(tensors, lora_state_dict(model, adapter))


def full_tensors(saved: SavedState, model: nn.Module) -> dict[str, torch.Tensor]:
    """The saved model's tensors (our names), checked against model's state_dict."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    try:
        loaded = load_pretrained(saved.weights_dir, dtype=dtype, device=device)
    except ValueError as exc:
        raise StateMismatch(str(exc)) from None
    return _checked(loaded.state_dict(), model.state_dict())


def _checked(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    missing, unexpected = sorted(targets.keys() - tensors.keys()), sorted(tensors.keys() - targets.keys())
    if missing or unexpected:
        raise StateMismatch(f"the saved weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [f"{k}: saved {list(tensors[k].shape)} vs session {list(v.shape)}" for k, v in targets.items()
           if tensors[k].shape != v.shape]
    if bad:
        raise StateMismatch(f"the saved weights have other shapes: {'; '.join(bad[:5])}")
    return tensors


def copy_into(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(tensors[key])


def optimizer_state(saved: SavedState, params: list[nn.Parameter], device: torch.device) -> dict:
    """The saved AdamW state_dict, checked against the session's parameters (count and shapes)."""
    state = torch.load(saved.state_dir / OPTIMIZER_FILE, map_location=device, weights_only=True)
    groups = state.get("param_groups", [])
    indices = [i for g in groups for i in g["params"]]
    if len(indices) != len(params):
        raise StateMismatch(f"the saved optimizer holds {len(indices)} parameters, the session {len(params)}")
    for i, p in zip(indices, params):
        for name, value in state["state"].get(i, {}).items():
            if value.dim() and value.shape != p.shape:
                raise StateMismatch(f"the saved optimizer's {name} of parameter {i} has shape {list(value.shape)}, "
                                    f"the session's parameter {list(p.shape)}")
    return state
