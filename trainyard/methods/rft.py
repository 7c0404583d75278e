"""Managed reinforcement fine-tuning (RFT): its settings, declared once (see trainyard.methods.spec).

The worker's recipe (services/worker/recipes/rft.py) runs the RL loop of services/trainer/rl/ with them; docs/rft.md
describes sync and async mode, staleness, partial rollouts, truncated importance sampling and router replay.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainyard.methods.evaluate import EvalSettings
from trainyard.methods.lora import LoraSettings, TrainingModeSettings
from trainyard.methods.sft import MAX_STEPS, LoopSettings
from trainyard.methods.spec import setting

LOSSES = ("grpo", "dapo", "gspo", "cispo", "dro", "dr_grpo")


def _shared(name: str, owner: type = LoopSettings) -> Any:
    """Another method's declaration of a setting RFT has too (one flag, one default, one help, as the CLI needs):
    the supervised loop's, or the evaluation job's sampling and evaluator."""
    f = owner.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, metadata=f.metadata)


@dataclass(frozen=True)
class RftSettings(TrainingModeSettings, LoraSettings):
    """GRPO-style RL: groups of samples per prompt from the current policy, scored by an evaluator, trained with one
    of the trainer's policy-gradient losses; in sync or async mode (bounded staleness)."""

    learning_rate: float = _shared("learning_rate")
    steps: int = setting(100, label="Steps", ge=1, le=MAX_STEPS, unit="steps",
                         help="Optimizer steps (each publishes a new policy version)")
    prompts_per_step: int = setting(8, label="Prompts per step", ge=1, le=4096, help="Prompts sampled for each step")
    group_size: int = setting(8, label="Group size", ge=2, le=64, unit="samples",
                              help="Samples per prompt; advantages are normalized within a prompt's group")
    max_tokens: int = _shared("max_tokens", EvalSettings)
    temperature: float = _shared("temperature", EvalSettings)  # 0 (greedy) makes every group constant: no signal
    loss: str = setting("grpo", label="Loss", choices=LOSSES,
                        help="Policy-gradient loss (the trainer's fused losses)")
    kl_coef: float = setting(0.0, label="KL coefficient", ge=0, le=100,
                             help="Weight of the k3 KL penalty to the base policy, added to the loss; 0: off")
    clip_low: float | None = setting(None, label="Clip low", ge=0, le=1, advanced=True,
                                     help="Lower bound on the importance ratio; unset: the loss's default")
    clip_high: float | None = setting(None, label="Clip high", ge=1, le=100, advanced=True,
                                      help="Upper bound on the importance ratio; unset: the loss's default")
    dynamic_sampling: bool | None = setting(
        None, label="Dynamic sampling",
        help="Drop groups whose rewards are all equal (no signal); unset: on for dapo, off otherwise")
    mode: str = setting("sync", label="Mode", choices=("sync", "async"),
                        help="sync: sample, then train, in turn; async: sampling overlaps training")
    max_staleness: int = setting(1, label="Max staleness", ge=1, le=64, unit="versions",
                                 help="Async: policy versions a sample may lag the trainer by; older ones are dropped")
    tis: str = setting("off", label="Truncated importance sampling", choices=("off", "token", "sequence"),
                       advanced=True, help="Correct the rollout/trainer mismatch with a capped importance weight")
    tis_cap: float = setting(2.0, label="TIS cap", ge=1, le=1000, advanced=True,
                             help="Cap of the truncated importance sampling weight")
    partial_rollouts: bool = setting(
        True, label="Partial rollouts", advanced=True,
        help="Async: samples in flight at a weight update continue on the new version instead of restarting")
    router_replay: bool = setting(False, label="Router replay", advanced=True,
                                  help="MoE models: replay the rollout's expert routes in the trainer's forward")
    evaluator: str = _shared("evaluator", EvalSettings)  # here also a built-in reward, "builtin:<name>"
    max_turns: int = setting(1, label="Max turns", ge=1, le=64, unit="turns",
                             help="Environment evaluators: actions per episode (each up to max_tokens), observations "
                                  "between them; 1 for a reward_fn")
    checkpoint_every: int = _shared("checkpoint_every")
    seed: int = _shared("seed")
    max_grad_norm: float = _shared("max_grad_norm")
    weight_decay: float = _shared("weight_decay")
