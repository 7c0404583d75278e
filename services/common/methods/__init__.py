"""Job methods on the server. Each method's settings are declared once, torch-free, in trainyard/methods/ (the SDK,
the CLI and the dashboard read the same declaration); here they gain what only the server can do: LoRA targets and
max_seq_len checked against the model directory, JSON for the job row (resolved.py). HYPERPARAMS maps a method's
name (trainyard.methods.METHODS) to the class the scheduler resolves a request into and the worker trains with."""
from __future__ import annotations

from services.common.methods.dpo import DpoHyperparams
from services.common.methods.evaluate import EvalHyperparams
from services.common.methods.loop import LoopHyperparams
from services.common.methods.rft import RftHyperparams
from services.common.methods.sft import SftHyperparams

HYPERPARAMS = {"sft": SftHyperparams, "dpo": DpoHyperparams, "rft": RftHyperparams, "eval": EvalHyperparams,
               "loop": LoopHyperparams}
