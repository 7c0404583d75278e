"""The managed SFT recipe: resume from the job's latest checkpoint if any, drive the LoRA SFT run
(services/trainer/sft.py, on the training engine) and record each of its events through the ledger (each write
conditional on the lease) and the object store.

The run is in this process (managed_nproc 1), or on a torchrun group of managed_nproc ranks laid out by
managed_parallel (services/worker/group.py: rank 0's events come back as the same events, recorded alike)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from services.common import blobrefs
from services.common.blobstore import StoredFile
from services.common.methods.sft import SftHyperparams
from services.common.schema import Dataset
from services.trainer.engine.parallel.dims import KNOBS
from services.trainer.sft import Checkpoint, Finished, Log, Metrics, SftCheckpoint, SftEvent, Started, run_sft
from services.trainer.sft_group import GroupSpec
from services.worker.group import group_events
from services.worker.job import JobContext, RecipeOutcome


def run(ctx: JobContext) -> RecipeOutcome:
    job, blobs, ledger = ctx.job, ctx.blobs, ctx.ledger
    with ctx.db.session() as s:
        dataset = s.get(Dataset, job.dataset_id)
    # Every stored file is laid out verified against the sha256 its row names: damage fails the job with DataLoss
    # naming the object, instead of training on it.
    data_path = blobs.materialize([StoredFile("dataset.jsonl", dataset.sha256, dataset.size_bytes)],
                                  ctx.work / "data", what=f"dataset {dataset.id}") / "dataset.jsonl"
    resume = None
    latest = ctx.latest_checkpoint
    if latest is not None:
        resume = SftCheckpoint(step=latest.step, root=ctx.work / "resume")
        blobs.materialize([StoredFile.from_json(f) for f in latest.files], resume.weights_dir,
                          what=f"checkpoint {latest.id}")
        blobs.materialize([StoredFile.from_json(f) for f in latest.state], resume.state_dir,
                          what=f"checkpoint {latest.id} state")
        ledger.log(job.id, f"resuming from the checkpoint at step {latest.step} ({latest.id})")
    final_checkpoint_id, finished = "", None
    for event in _events(ctx, data_path, resume):
        match event:
            case Log(message, level):
                ledger.log(job.id, message, level)
            case Started(total_steps, info):
                ledger.progress(job.id, ctx.worker_id, total_steps=total_steps)
                details = ", ".join(f"{k} {v}" for k, v in info.items())
                ledger.log(job.id, f"training: {total_steps} steps ({details})")
            case Metrics(step, metrics):
                ledger.progress(job.id, ctx.worker_id, step=step, metrics=metrics)
            case Checkpoint(ckpt, final, metrics):
                with blobs.saving(blobrefs.checker(ctx.db)) as save:  # a lost lease takes the new blobs back
                    files = [f.to_json() for f in save.put_tree(ckpt.weights_dir)]
                    state = [f.to_json() for f in save.put_tree(ckpt.state_dir)]
                    row = ledger.add_checkpoint(job.id, ctx.worker_id, step=ckpt.step, files=files, state=state,
                                                final=final, metrics=metrics)
                if final:
                    final_checkpoint_id = row.id
            case Finished():
                finished = event
    assert finished is not None, "run_sft always ends with Finished"
    return RecipeOutcome(step=finished.step, stopped=finished.stopped, output_checkpoint_id=final_checkpoint_id)


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
                     parallel={"field_prefix": dims.field_prefix, **{k: getattr(dims, k) for k in KNOBS}}, resume_step=resume.step if resume else 0,
                     resume_root=str(resume.root) if resume else "", torch_threads=settings.torch_threads)
    ctx.ledger.log(job.id, f"training on {settings.managed_nproc} ranks ({dims.describe()})")
    gpus = [d.index for d in ctx.role_devices("trainer") if d.kind == "gpu"]
    return group_events(spec, settings.managed_nproc, stop=ctx.heartbeat.stop, poll_s=settings.managed_poll_s,
                        gpus=gpus)
