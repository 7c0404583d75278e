"""One recipe per job method: run(ctx: services.worker.job.JobContext) -> RecipeOutcome. DPO and RL recipes join
here."""
from __future__ import annotations

from collections.abc import Callable


def recipe(method: str) -> Callable:
    """The recipe of a job method (imported on use: a recipe pulls in the training engine)."""
    if method == "sft":
        from services.worker.recipes import sft
        return sft.run
    raise ValueError(f"no recipe for job method {method!r}")
