"""One recipe per job method: run(ctx: services.worker.job.JobContext) -> RecipeOutcome. DPO and RL recipes join
here; which module runs a method is its `recipe` in trainyard.methods.METHODS."""
from __future__ import annotations

import importlib
from collections.abc import Callable

from trainyard.methods import METHODS


def recipe(method: str) -> Callable:
    """The recipe of a job method (imported on use: a recipe pulls in the training engine)."""
    if method not in METHODS:
        raise ValueError(f"no recipe for job method {method!r}")
    return importlib.import_module(f"services.worker.recipes.{METHODS[method].recipe}").run
