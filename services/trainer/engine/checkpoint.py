"""The engine's checkpoint: one format for every path that trains (managed jobs, Training API SaveState / LoadState).

    <root>/weights/   the trained weights as anyone reads them: a LoRA adapter exactly as peft writes it
                      (adapter_config.json, adapter_model.safetensors), or, for full-parameter training, the Hugging
                      Face model directory (config.json, *.safetensors)
    <root>/state/     engine_state.json: format, base model, LoRA config (rank, alpha, dropout, targets) or null,
                      seed, optimizer steps and the driver's progress (a managed SFT job: its step, data position,
                      settings and metrics; a session: its seq counter); optimizer.pt: the AdamW state_dict;
                      rng.pt: the torch RNG state (LoRA dropout draws from it); gradients.pt, only when gradients
                      were pending (a Training API session saved between ForwardBackward and OptimStep): the
                      accumulated gradients, one entry per trainable parameter in the optimizer's order (None
                      where a parameter has none)

A checkpoint row stores weights/ as its files and state/ as its state, so its weights alone are deployable and its
state makes it resumable; a managed job's checkpoint can be continued in a Training API session, and a session's
state resumed exactly. Weights are stored in float32 as they are and the optimizer and RNG state with torch.save, so
loading them gives the same bits and training continues exactly as if it had never stopped.

Restoring checks everything (the format, the LoRA layout, every tensor's name and shape, the optimizer's layout)
before it copies anything, so a checkpoint that does not fit changes nothing (CheckpointMismatch says what differs).
Pending gradients are restored only where the caller asks (a session restored after a trainer restart); LoadState
and CreateSession(from_state) start without them, as documented in trainer.proto.

A sharded (multi-rank) engine writes the same layout (parallel/sharded_checkpoint.py): weights/ gathered from the
shards by rank 0 (the same files as the single-process engine's), engine_state.json with "parallel" (the layout it
ran with), rank 0's rng.pt, and instead of optimizer.pt / gradients.pt its trainable parameters, AdamW state and
pending gradients under state/dcp/ (torch.distributed.checkpoint: whole tensors stored as the ranks' chunks, so any
layout or one process loads them). Either engine restores either kind; whoever stores the checkpoint stores the
directory as it finds it.
States written before this format (a managed job's trainer_state.json + rng_state.pt, a session's
session_state.json) are read as well.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from models import load_pretrained, save_pretrained
from models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraConfig, lora_state_dict, save_peft_adapter

FORMAT = "trainyard.engine_state.v1"
STATE_FILE = "engine_state.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
GRADIENTS_FILE = "gradients.pt"
DCP_DIR = "dcp"  # a sharded engine's trainable state (parallel/sharded_checkpoint.py), instead of the .pt files
WEIGHTS_DIR, STATE_DIR = "weights", "state"
# Earlier layouts of the same information, still read: a managed SFT job's and a Training API session's.
_LEGACY_SFT_FILE, _LEGACY_SFT_RNG = "trainer_state.json", "rng_state.pt"
_LEGACY_SESSION_FILE, _LEGACY_SESSION_FORMAT = "session_state.json", "trainyard.session_state.v1"
STATE_MARKERS = (STATE_FILE, _LEGACY_SFT_FILE, _LEGACY_SESSION_FILE)


class CheckpointMismatch(ValueError):
    """The checkpoint is not a training state, or does not fit the engine (the message says what differs)."""


@dataclass
class EngineCheckpoint:
    base_model: str
    lora: LoraConfig | None  # None: full-parameter
    seed: int
    optim_steps: int
    weights_dir: Path
    state_dir: Path
    progress: dict = field(default_factory=dict)  # the driver's own counters (see the module docstring)
    rng_file: str = RNG_FILE
    parallel: dict | None = None  # the sharded engine's layout (ParallelDims' degrees and world_size); None: one

    @property
    def has_dcp(self) -> bool:
        """Whether the training state is a distributed checkpoint (state/dcp/, a sharded engine's)."""
        return (self.state_dir / DCP_DIR / ".metadata").is_file()

    @property
    def full_parameter(self) -> bool:
        return self.lora is None

    @property
    def has_optimizer(self) -> bool:
        return (self.state_dir / OPTIMIZER_FILE).is_file() or self.has_dcp

    @property
    def has_rng(self) -> bool:
        return (self.state_dir / self.rng_file).is_file()

    @property
    def has_gradients(self) -> bool:
        return (self.state_dir / GRADIENTS_FILE).is_file()


def is_training_state(state_paths) -> bool:
    """Whether a checkpoint row's state files (their relative paths) hold a training state."""
    return any(p in STATE_MARKERS for p in state_paths)


def write_weights(model: nn.Module, lora: LoraConfig | None, out: Path, *, base_model: str,
                  adapter: str = "default") -> None:
    """The trained weights: the PEFT adapter `adapter` (lora) or the whole model as a Hugging Face directory."""
    if lora is None:
        save_pretrained(model, out)
    else:
        save_peft_adapter(model, lora, out, base_model_name_or_path=base_model, adapter_name=adapter)


def write_state(out: Path, *, base_model: str, lora: LoraConfig | None, seed: int, optim_steps: int,
                optimizer: torch.optim.Optimizer | None, rng: dict, progress: dict,
                gradients: list[torch.Tensor | None] | None = None, parallel: dict | None = None) -> None:
    """gradients: the pending gradients of the optimizer's parameters, in its order (None: there are none).
    optimizer None: a sharded engine, whose optimizer and gradients are in state/dcp/; parallel: its layout."""
    out.mkdir(parents=True, exist_ok=True)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
    torch.save(rng, out / RNG_FILE)
    if gradients is not None:
        torch.save(gradients, out / GRADIENTS_FILE)
    meta = {"format": FORMAT, "base_model": base_model, "seed": seed, "optim_steps": optim_steps,
            "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                               "target_modules": list(lora.target_modules)},
            "progress": progress, "parallel": parallel}
    (out / STATE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_checkpoint(root: Path) -> EngineCheckpoint:
    """The checkpoint laid out under root (weights/, state/); CheckpointMismatch if it holds no training state."""
    weights, state = root / WEIGHTS_DIR, root / STATE_DIR
    try:
        if (state / STATE_FILE).is_file():
            return _current(json.loads((state / STATE_FILE).read_text()), weights, state)
        if (state / _LEGACY_SESSION_FILE).is_file():
            return _legacy_session(json.loads((state / _LEGACY_SESSION_FILE).read_text()), weights, state)
        if (state / _LEGACY_SFT_FILE).is_file():
            return _legacy_sft(json.loads((state / _LEGACY_SFT_FILE).read_text()), weights, state)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointMismatch(f"the training state is malformed: {exc!r}") from None
    raise CheckpointMismatch(f"not a training state (no {STATE_FILE})")


def _lora(d: dict | None) -> LoraConfig | None:
    if d is None:
        return None
    return LoraConfig(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d.get("dropout", 0.0)),
                      target_modules=tuple(d["target_modules"]))


def _current(meta: dict, weights: Path, state: Path) -> EngineCheckpoint:
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"{STATE_FILE} format is not {FORMAT!r}")
    return EngineCheckpoint(base_model=str(meta["base_model"]), lora=_lora(meta["lora"]), seed=int(meta["seed"]),
                            optim_steps=int(meta["optim_steps"]), weights_dir=weights, state_dir=state,
                            progress=dict(meta.get("progress") or {}), parallel=meta.get("parallel"))


def _legacy_session(meta: dict, weights: Path, state: Path) -> EngineCheckpoint:
    if meta.get("format") != _LEGACY_SESSION_FORMAT:
        raise CheckpointMismatch(f"{_LEGACY_SESSION_FILE} format is not {_LEGACY_SESSION_FORMAT!r}")
    return EngineCheckpoint(base_model=str(meta["base_model"]),
                            lora=None if meta["full_parameter"] else _lora(meta["lora"]), seed=int(meta["seed"]),
                            optim_steps=int(meta["optim_steps"]), weights_dir=weights, state_dir=state,
                            progress={"next_seq_id": int(meta["next_seq_id"])})


def _legacy_sft(meta: dict, weights: Path, state: Path) -> EngineCheckpoint:
    hp = meta["hyperparams"]
    base = json.loads((weights / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path", "")
    lora = _lora({"rank": hp["lora_rank"], "alpha": hp["lora_alpha"], "dropout": hp["lora_dropout"],
                  "target_modules": hp["target_modules"]})
    progress = {k: meta[k] for k in ("step", "total_steps", "epoch", "train_examples", "eval_examples",
                                     "hyperparams", "metrics") if k in meta}
    return EngineCheckpoint(base_model=str(base), lora=lora, seed=int(hp["seed"]), optim_steps=int(meta["step"]),
                            weights_dir=weights, state_dir=state, progress=progress, rng_file=_LEGACY_SFT_RNG)


# -- restoring: every check first, then the copies --------------------------------------------------------------
def lora_tensors(ckpt: EngineCheckpoint, model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The saved adapter's tensors, checked against adapter `adapter` of model (names and shapes)."""
    try:
        tensors = load_file(str(ckpt.weights_dir / ADAPTER_WEIGHTS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointMismatch(f"the saved adapter cannot be read: {exc}") from None
    return _checked(tensors, lora_state_dict(model, adapter))


def full_tensors(ckpt: EngineCheckpoint, model: nn.Module) -> dict[str, torch.Tensor]:
    """The saved model's tensors (our names), checked against model's state_dict."""
    param = next(model.parameters())
    try:
        loaded = load_pretrained(ckpt.weights_dir, dtype=param.dtype, device=param.device)
    except ValueError as exc:
        raise CheckpointMismatch(str(exc)) from None
    return _checked(loaded.state_dict(), model.state_dict())


def _checked(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    missing, unexpected = sorted(targets.keys() - tensors.keys()), sorted(tensors.keys() - targets.keys())
    if missing or unexpected:
        raise CheckpointMismatch(f"the saved weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [f"{k}: saved {list(tensors[k].shape)} vs this run's {list(v.shape)}" for k, v in targets.items()
           if tensors[k].shape != v.shape]
    if bad:
        raise CheckpointMismatch(f"the saved weights have other shapes: {'; '.join(bad[:5])}")
    return tensors


def optimizer_state(ckpt: EngineCheckpoint, params: list[nn.Parameter], device: torch.device) -> dict:
    """The saved AdamW state_dict, checked against the parameters it will drive (count and shapes)."""
    try:
        state = torch.load(ckpt.state_dir / OPTIMIZER_FILE, map_location=device, weights_only=True)
        indices = [i for g in state["param_groups"] for i in g["params"]]
    except (OSError, RuntimeError, KeyError, TypeError) as exc:
        raise CheckpointMismatch(f"the saved optimizer state cannot be read: {exc}") from None
    if len(indices) != len(params):
        raise CheckpointMismatch(f"the saved optimizer holds {len(indices)} parameters, this run {len(params)}")
    for i, p in zip(indices, params):
        for name, value in state["state"].get(i, {}).items():
            if value.dim() and value.shape != p.shape:
                raise CheckpointMismatch(f"the saved optimizer's {name} of parameter {i} has shape "
                                         f"{list(value.shape)}, this run's parameter {list(p.shape)}")
    return state


def gradient_tensors(ckpt: EngineCheckpoint, params: list[nn.Parameter],
                     device: torch.device) -> list[torch.Tensor | None]:
    """The saved pending gradients, checked against the parameters they belong to (count, shapes, dtypes)."""
    try:
        grads = torch.load(ckpt.state_dir / GRADIENTS_FILE, map_location=device, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointMismatch(f"the saved gradients cannot be read: {exc}") from None
    if not isinstance(grads, list) or len(grads) != len(params):
        raise CheckpointMismatch(f"the saved gradients do not match this run's {len(params)} parameters")
    for i, (g, p) in enumerate(zip(grads, params)):
        if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype):
            raise CheckpointMismatch(f"the saved gradient of parameter {i} does not fit it ({list(p.shape)}, "
                                     f"{p.dtype})")
    return grads


def rng_state(ckpt: EngineCheckpoint) -> dict:
    try:
        rng = torch.load(ckpt.state_dir / ckpt.rng_file, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointMismatch(f"the saved RNG state cannot be read: {exc}") from None
    if not isinstance(rng, dict) or "cpu" not in rng:
        raise CheckpointMismatch("the saved RNG state is malformed")
    return rng


def copy_into(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(tensors[key])
