"""The managed SFT recipe: resume from the job's latest checkpoint if any, drive the LoRA SFT run
(services/trainer/sft.py, on the training engine) and record each of its events through the ledger (each write
conditional on the lease) and the object store."""
from __future__ import annotations

from pathlib import Path

from services.common.blobstore import StoredFile
from services.common.methods.sft import SftHyperparams
from services.common.schema import Dataset
from services.trainer.sft import Checkpoint, Finished, Log, Metrics, SftCheckpoint, Started, run_sft
from services.worker.job import JobContext, RecipeOutcome


def run(ctx: JobContext) -> RecipeOutcome:
    job, blobs, ledger = ctx.job, ctx.blobs, ctx.ledger
    with ctx.db.session() as s:
        dataset = s.get(Dataset, job.dataset_id)
    resume = None
    latest = ctx.latest_checkpoint
    if latest is not None:
        resume = SftCheckpoint(step=latest.step, root=ctx.work / "resume")
        blobs.materialize([StoredFile.from_json(f) for f in latest.files], resume.weights_dir)
        blobs.materialize([StoredFile.from_json(f) for f in latest.state], resume.state_dir)
        ledger.log(job.id, f"resuming from the checkpoint at step {latest.step} ({latest.id})")
    final_checkpoint_id, finished = "", None
    events = run_sft(Path(job.model_path), blobs.path(dataset.sha256), SftHyperparams.from_json(job.config),
                     stop=ctx.heartbeat.stop, resume=resume, base_model_name=job.base_model, work_dir=ctx.work)
    for event in events:
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
                files = [f.to_json() for f in blobs.put_tree(ckpt.weights_dir)]
                state = [f.to_json() for f in blobs.put_tree(ckpt.state_dir)]
                row = ledger.add_checkpoint(job.id, ctx.worker_id, step=ckpt.step, files=files, state=state,
                                            final=final, metrics=metrics)
                if final:
                    final_checkpoint_id = row.id
            case Finished():
                finished = event
    assert finished is not None, "run_sft always ends with Finished"
    return RecipeOutcome(step=finished.step, stopped=finished.stopped, output_checkpoint_id=final_checkpoint_id)
