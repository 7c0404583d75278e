"""The release gate for a model family: it must memorize a small fixed set of sequences.

A family whose forward, backward or parameter wiring is subtly wrong (a transposed head, a detached router, a rope
applied twice) still trains, just worse; driving a fixed set of 8 short sequences to a mean token loss below 0.05
within a fixed step budget catches that before anything is scaled up. `trainyard validate MODEL_DIR` runs it on any
model directory; the tests run it on the tiny model of every family.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.model_dir import inspect_model_dir
from models.lora import LoraConfig
from models.tokenizer import load_tokenizer
from services.trainer.engine import AdamW, TrainingEngine

SEQUENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Seven times six is forty-two, and nine times nine is eighty-one.",
    "The library opens at nine in the morning and closes at six.",
    "Light travels faster than sound, so we see lightning before thunder.",
    "Every spring the river floods the valley and feeds the orchards.",
)
DEFAULTS = {"lora": {"lr": 5e-3, "steps": 300}, "full": {"lr": 1e-3, "steps": 300}}
FULL_MODE_MAX_PARAMETERS = 2_000_000_000


@dataclass
class MemorizationResult:
    architecture: str
    mode: str
    passed: bool
    target: float
    steps: int
    final_loss: float
    seconds: float
    losses: list[float] = field(default_factory=list)


def memorization_batch(tokenizer, max_len: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, T] and targets [B, T] (-100 on padding and on each row's last position)."""
    rows = [tokenizer.encode(s, add_special_tokens=False)[:max_len] for s in SEQUENCES]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    targets = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        targets[i, : len(r) - 1] = torch.tensor(r[1:])
    return ids, targets


def memorization_check(
    model_dir: str | Path,
    *,
    mode: str = "auto",
    steps: int | None = None,
    lr: float | None = None,
    target: float = 0.05,
    lora_rank: int = 32,
    seed: int = 0,
    device: str | torch.device | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> MemorizationResult:
    """Train on SEQUENCES until the mean token loss is below target or the step budget is spent.

    mode "full": every parameter (the gate for model code: each parameter's gradient must be right); "lora": an
    adapter of lora_rank on the family's default targets (attention, MLPs, experts), for models too large to train
    fully on the machine at hand; "auto": full up to FULL_MODE_MAX_PARAMETERS, else lora. Trains through the engine
    (services/trainer/engine/: its device and dtype rule, chunked logprob head, AdamW step with clipping at 1.0)."""
    if mode == "auto":
        mode = "full" if inspect_model_dir(model_dir).num_parameters <= FULL_MODE_MAX_PARAMETERS else "lora"
    if mode not in DEFAULTS:
        raise ValueError(f"mode must be one of auto, {', '.join(DEFAULTS)}, got {mode!r}")
    steps = steps or DEFAULTS[mode]["steps"]
    lr = lr or DEFAULTS[mode]["lr"]
    torch.manual_seed(seed)
    lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank) if mode == "lora" else None
    settings = AdamW(learning_rate=lr, grad_clip_norm=1.0)
    engine = TrainingEngine.load(model_dir, lora=lora, seed=seed, optimizer=settings, device=device)
    ids, targets = memorization_batch(load_tokenizer(model_dir))
    num_targets = int((targets != -100).sum())
    losses: list[float] = []
    start = time.monotonic()
    for step in range(1, steps + 1):
        loss = engine.nll_sum(ids, targets) / num_targets
        loss.backward()
        engine.step(settings)
        losses.append(loss.item())  # .item() syncs: once per step, for the stop test
        if on_step is not None:
            on_step(step, losses[-1])
        if losses[-1] < target:
            break
    return MemorizationResult(architecture=engine.model.args.architecture, mode=mode, passed=losses[-1] < target,
                              target=target, steps=len(losses), final_loss=losses[-1],
                              seconds=time.monotonic() - start, losses=losses)
