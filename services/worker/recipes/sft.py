"""The managed SFT recipe: resume from the job's latest checkpoint if any, drive the LoRA SFT run
(services/trainer/sft.py, on the training engine) and record each of its events (recording.py).

The run is in this process (managed_nproc 1), or on a torchrun group of managed_nproc ranks laid out by
managed_parallel (services/worker/group.py: rank 0's events come back as the same events, recorded alike)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from services.common.methods.sft import SftHyperparams
from services.trainer.engine.parallel.dims import KNOBS
from services.trainer.sft import SftCheckpoint, SftEvent, run_sft
from services.trainer.sft_group import GroupSpec
from services.worker.group import group_events
from services.worker.job import JobContext, RecipeOutcome
from services.worker.recipes.recording import run_recorded


def run(ctx: JobContext) -> RecipeOutcome:
    return run_recorded(ctx, lambda data_path, resume: _events(ctx, data_path, resume))


def _events(ctx: JobContext, data_path: Path, resume: SftCheckpoint | None) -> Iterator[SftEvent]:
    """The run's events: run_sft in this process, or on a torchrun group (managed_nproc > 1)."""
    job, settings = ctx.job, ctx.settings
    hp = SftHyperparams.from_json(job.config)
    if settings.managed_nproc == 1:
        return run_sft(Path(job.model_path), data_path, hp, stop=ctx.heartbeat.stop, resume=resume,
                       base_model_name=job.base_model, work_dir=ctx.work)
    dims = settings.managed_dims()
    spec = GroupSpec(model_dir=job.model_path, dataset_path=str(data_path), hyperparams=hp.to_json(),
                     base_model_name=job.base_model, work_dir=str(ctx.work), group_dir=str(ctx.work / "group"),
                     parallel={"field_prefix": dims.field_prefix, **{k: getattr(dims, k) for k in KNOBS}},
                     resume_step=resume.step if resume else 0, resume_root=str(resume.root) if resume else "",
                     torch_threads=settings.torch_threads)
    ctx.ledger.log(job.id, f"training on {settings.managed_nproc} ranks ({dims.describe()})")
    gpus = [d.index for d in ctx.role_devices("trainer") if d.kind == "gpu"]
    return group_events(spec, settings.managed_nproc, stop=ctx.heartbeat.stop, poll_s=settings.managed_poll_s,
                        gpus=gpus)
