"""Loop jobs: train -> evaluate the checkpoints -> deploy the best under a stable name -> continue training from it on
the next dataset; settings declared once (see trainyard.methods.spec).

A loop reuses the declarations of what it runs rather than repeating them: its training settings are the training
method's (DpoSettings, a superset of SftSettings: an SFT loop reads the fields SFT declares, and a DPO-only one set
for it is refused), carried in the nested `training` message, and its evaluation settings are an evaluation job's
(EvalSettings, in the nested `eval` message; a loop evaluates its own checkpoints, so checkpoint_id stays unset).
What is its own: the training method, the datasets (one per iteration), the deployment's name and how many
checkpoints of each iteration are evaluated. The job's dataset is the held-out rft set the checkpoints are scored on.

The worker's recipe (services/worker/recipes/loop.py) runs every iteration in its own process; docs/loop.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainyard.methods.dpo import DpoSettings
from trainyard.methods.evaluate import EvalSettings
from trainyard.methods.spec import setting

TRAINING_METHODS = ("sft", "dpo")  # methods a loop trains with (trainyard.methods.METHODS names)


@dataclass(frozen=True)
class LoopOwnSettings:
    """What a loop adds to the training and evaluation settings it reuses."""

    training_method: str = setting(
        "sft", label="Training method", choices=TRAINING_METHODS,
        help="How each iteration trains: its datasets are in that method's format")
    train_datasets: tuple[str, ...] = setting(
        (), label="Training datasets", flag="--train-dataset",
        help="Dataset ids, one per iteration (repeat the flag): iteration i trains on the i-th")
    deployment: str = setting(
        "", label="Deployment name",
        help="The deployment serving the best checkpoint so far: created by the first iteration, re-pointed by the "
             "next ones")
    checkpoints_per_iteration: int = setting(
        0, label="Checkpoints evaluated per iteration", ge=0, le=1000, unit="checkpoints",
        help="The last N checkpoints of each iteration are evaluated; 0: every one")


@dataclass(frozen=True)
class LoopSettings(LoopOwnSettings, EvalSettings, DpoSettings):
    """A loop's settings: its own, an evaluation's (nested `eval`) and the training method's (nested `training`)."""

    proto_nesting: ClassVar[dict[str, type]] = {"training.": DpoSettings, "eval.": EvalSettings}
