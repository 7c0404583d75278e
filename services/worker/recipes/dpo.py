"""The managed DPO recipe: resume from the job's latest checkpoint if any, drive the DPO run (services/trainer/dpo.py,
on the training engine, LoRA or full-parameter) and record each of its events (recording.py) -- a full-parameter
job's checkpoints as kind "full" (a whole model directory).

One process only: a worker set up to train on a torchrun group (managed_nproc > 1) refuses a DPO job with a clear
error instead of running it on one rank of the group."""
from __future__ import annotations

from services.common.methods.dpo import DpoHyperparams
from services.trainer.dpo import run_dpo
from services.worker.job import JobContext, RecipeOutcome
from services.worker.recipes.recording import run_recorded


class GroupNotSupported(ValueError):
    """A DPO job given to a worker that trains on a torchrun group."""


def run(ctx: JobContext) -> RecipeOutcome:
    job, settings = ctx.job, ctx.settings
    if settings.managed_nproc != 1:
        raise GroupNotSupported(f"DPO jobs train in one process, but this worker is set up for managed_nproc="
                                f"{settings.managed_nproc} (TRAINYARD_MANAGED_NPROC); run DPO on a worker with 1")
    hp = DpoHyperparams.from_json(job.config)
    return run_recorded(
        ctx,
        lambda data_path, resume: run_dpo(job.model_path, data_path, hp, stop=ctx.heartbeat.stop, resume=resume,
                                          base_model_name=job.base_model, work_dir=ctx.work),
        checkpoint_kind="full" if hp.full_parameter else "lora_adapter")
