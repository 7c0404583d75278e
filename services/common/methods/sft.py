"""Hyperparameters of a managed SFT job: defaults, bounds and the messages a user sees when one is wrong.

The scheduler validates a request with ``SftHyperparams.from_request`` (violations name the request field, e.g.
"spec.sft.learning_rate") and stores ``to_json()``; the worker rebuilds the same object with ``from_json``.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from models.lora_targets import DEFAULT_TARGETS, check_targets_for_config
from models.model_dir import ModelDirError, read_config
from services.common.errors import InvalidArgument, Violation

LR_SCHEDULERS = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class SftHyperparams:
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    learning_rate: float = 1e-4
    epochs: int = 1
    max_steps: int = 0  # 0: derived from epochs
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"
    weight_decay: float = 0.0
    max_seq_len: int = 2048
    eval_fraction: float = 0.1
    eval_every: int = 0  # 0: at each checkpoint
    checkpoint_every: int = 50
    seed: int = 0
    max_grad_norm: float = 1.0  # 0: no clipping

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SftHyperparams":
        d = dict(d)
        d["target_modules"] = tuple(d.get("target_modules", DEFAULT_TARGETS))
        return cls(**d)

    @classmethod
    def from_request(cls, given: dict[str, Any], *, prefix: str = "spec.sft.") -> "SftHyperparams":
        """Fill defaults for the keys not given and check every value; raises InvalidArgument naming each field."""
        v: list[Violation] = []

        def check(name: str, ok: bool, reason: str) -> None:
            if not ok:
                v.append(Violation(field=prefix + name, reason=reason))

        d = {k: val for k, val in given.items() if val is not None}
        lora, lora_problems = lora_settings(d.get("lora_rank"), d.get("lora_alpha"), d.get("lora_dropout"),
                                            d.get("target_modules"), prefix=prefix + "lora.")
        v.extend(lora_problems)
        d.update(lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                 target_modules=lora["target_modules"])
        lr = d.get("learning_rate", cls.learning_rate)
        check("learning_rate", lr > 0 and lr < 1, f"must be > 0 and < 1, got {lr}")
        for name, lo, hi in (("epochs", 1, 1000), ("batch_size", 1, 1024), ("gradient_accumulation_steps", 1, 1024),
                             ("checkpoint_every", 1, 10**7), ("max_seq_len", 16, 1 << 20)):
            val = d.get(name, getattr(cls, name))
            check(name, lo <= val <= hi, f"must be between {lo} and {hi}, got {val}")
        for name in ("max_steps", "warmup_steps", "eval_every"):
            val = d.get(name, 0)
            check(name, 0 <= val <= 10**7, f"must be >= 0, got {val}")
        sched = d.get("lr_scheduler", "cosine")
        check("lr_scheduler", sched in LR_SCHEDULERS, f"must be one of {', '.join(LR_SCHEDULERS)}, got {sched!r}")
        wd = d.get("weight_decay", 0.0)
        check("weight_decay", 0 <= wd < 1, f"must be in [0, 1), got {wd}")
        ef = d.get("eval_fraction", cls.eval_fraction)
        check("eval_fraction", 0 <= ef < 0.5, f"must be in [0, 0.5), got {ef}")
        gn = d.get("max_grad_norm", cls.max_grad_norm)
        check("max_grad_norm", gn >= 0, f"must be >= 0 (0 disables clipping), got {gn}")
        if v:
            raise InvalidArgument(violations=v)
        return cls(**d)


def lora_settings(rank: int | None, alpha: float | None, dropout: float | None, targets, *,
                  prefix: str) -> tuple[dict[str, Any], list[Violation]]:
    """LoRA settings of a request with defaults filled (rank 16, alpha 2 x rank, dropout 0, every projection),
    and the problems found, each naming prefix + field (e.g. "spec.sft.lora.rank")."""
    v: list[Violation] = []
    rank = 16 if rank is None else rank
    if not 1 <= rank <= 1024:
        v.append(Violation(field=prefix + "rank", reason=f"must be between 1 and 1024, got {rank}"))
    alpha = (float(2 * rank) if rank >= 1 else 32.0) if alpha is None else alpha
    if alpha <= 0:
        v.append(Violation(field=prefix + "alpha", reason=f"must be > 0, got {alpha}"))
    dropout = 0.0 if dropout is None else dropout
    if not 0 <= dropout < 1:
        v.append(Violation(field=prefix + "dropout", reason=f"must be in [0, 1), got {dropout}"))
    targets = tuple(targets or DEFAULT_TARGETS)
    malformed = [t for t in targets if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", t)]
    if malformed:  # whether each name exists is checked against the model's architecture (lora_target_problem)
        v.append(Violation(field=prefix + "target_modules", reason=f"not module names: {malformed}"))
    return {"rank": rank, "alpha": float(alpha), "dropout": dropout, "target_modules": targets}, v


def lora_target_problem(model_dir: str, targets: tuple[str, ...]) -> str | None:
    """Why these LoRA targets do not fit the model in model_dir (None when they do): the model's module names from
    its config.json (models.lora_targets), so no weights are read and no torch is needed."""
    try:
        check_targets_for_config(read_config(model_dir), targets)
    except (ModelDirError, ValueError) as exc:
        return str(exc)
    return None
