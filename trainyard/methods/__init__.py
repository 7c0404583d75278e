"""Managed job methods, each declared once: its settings (a dataclass, trainyard.methods.spec), the JobSpec field
that carries them, the dataset formats it trains on and the worker recipe that runs it.

Everything that differs by method reads this table: the scheduler's checks and conversions, the worker's recipe
lookup, the SDK's keywords, the CLI's flags and the dashboard's form. A new method (DPO, RFT) is one settings
declaration, one entry here and one recipe. Torch-free and server-free: the SDK imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.methods.dpo import DpoSettings
from trainyard.methods.evaluate import EvalSettings
from trainyard.methods.lora import LORA_DEFAULTS, LoraSettings
from trainyard.methods.loop import LoopSettings
from trainyard.methods.rft import RftSettings
from trainyard.methods.sft import SftSettings
from trainyard.methods.spec import Field, Problem, declared, resolve
from trainyard.v1 import scheduler_pb2 as pb


@dataclass(frozen=True)
class Method:
    name: str  # the jobs table's method, the CLI's --method, services/worker/recipes/<recipe>.py
    title: str
    proto: int  # the JobMethod enum value
    config: str  # the JobSpec oneof field that holds the settings
    settings: type  # the declared settings dataclass
    dataset_formats: tuple[str, ...]
    recipe: str
    # The devices a job of this method holds on one worker unless its spec.resources says otherwise
    # (docs/resources.md): trainer devices train, rollout devices sample (RFT: 1 + 1).
    trainer_devices: int = 1
    rollout_devices: int = 0
    trains: bool = True  # False: the job trains nothing (an evaluation), so PlanJob has nothing to plan

    @property
    def prefix(self) -> str:
        """Request fields of this method's settings start with it, e.g. 'spec.sft.'."""
        return f"spec.{self.config}."

    def fields(self) -> tuple[Field, ...]:
        return declared(self.settings)


# A job's queue priority (JobSpec.priority): higher starts first; 0 unless set.
PRIORITY_MIN, PRIORITY_MAX = -10, 10

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sft", "Supervised fine-tuning (LoRA)", pb.JOB_METHOD_SFT, "sft", SftSettings,
           ("sft_chat", "sft_prompt_completion"), "sft"),
    Method("dpo", "Direct preference optimization (LoRA or full-parameter)", pb.JOB_METHOD_DPO, "dpo", DpoSettings,
           ("dpo",), "dpo"),
    # The trainer in the worker process, the rollout engine in a process of the job's own (services/trainer/rl/).
    Method("rft", "Reinforcement fine-tuning (LoRA or full-parameter)", pb.JOB_METHOD_RFT, "rft", RftSettings,
           ("rft",), "rft", trainer_devices=1, rollout_devices=1),
    # Samples in the worker process (the rollout engine): one rollout device, no training.
    Method("eval", "Evaluation of a checkpoint with an evaluator", pb.JOB_METHOD_EVAL, "eval", EvalSettings,
           ("rft",), "evaluate", trainer_devices=0, rollout_devices=1, trains=False),
    # Trains and samples in the worker process, one iteration after another (docs/loop.md); its dataset is the
    # held-out rft set, the training datasets are in its settings. PlanJob does not plan a loop.
    Method("loop", "Loop: train, evaluate, deploy the best, continue on new data", pb.JOB_METHOD_LOOP, "loop",
           LoopSettings, ("rft",), "loop", trainer_devices=1, rollout_devices=1, trains=False),
)}
BY_PROTO = {m.proto: m for m in METHODS.values()}


def method(name: str) -> Method:
    """The method of a name; ValueError listing the known ones."""
    if name not in METHODS:
        raise ValueError(f"unknown job method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["BY_PROTO", "DpoSettings", "EvalSettings", "LORA_DEFAULTS", "METHODS", "PRIORITY_MAX", "PRIORITY_MIN",
           "LoopSettings", "LoraSettings", "Method", "Problem", "RftSettings", "SftSettings", "method", "resolve"]
