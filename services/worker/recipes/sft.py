"""The managed SFT recipe: resume from the job's latest checkpoint if any, run the LoRA SFT loop
(services/trainer/sft.py, on the training engine) with hooks that write metrics and checkpoints through the ledger
(each conditional on the lease)."""
from __future__ import annotations

from pathlib import Path

from services.common.blobstore import StoredFile
from services.common.schema import Dataset
from services.trainer.sft import SftCheckpoint, run_sft
from services.common.methods.sft import SftHyperparams
from services.worker.job import JobContext, RecipeOutcome


class JobHooks:
    """SftHooks backed by the ledger and the object store."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.final_checkpoint_id = ""

    def should_stop(self) -> bool:
        return self.ctx.heartbeat.should_stop()

    def on_start(self, total_steps: int, info: dict) -> None:
        self.ctx.ledger.progress(self.ctx.job.id, self.ctx.worker_id, total_steps=total_steps)
        details = ", ".join(f"{k} {v}" for k, v in info.items())
        self.ctx.ledger.log(self.ctx.job.id, f"training: {total_steps} steps ({details})")

    def on_log(self, message: str, level: str = "info") -> None:
        self.ctx.ledger.log(self.ctx.job.id, message, level)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.ctx.ledger.progress(self.ctx.job.id, self.ctx.worker_id, step=step, metrics=metrics)

    def on_checkpoint(self, ckpt: SftCheckpoint, final: bool, metrics: dict[str, float]) -> None:
        blobs = self.ctx.blobs
        files = [f.to_json() for f in blobs.put_tree(ckpt.weights_dir)]
        state = [f.to_json() for f in blobs.put_tree(ckpt.state_dir)]
        row = self.ctx.ledger.add_checkpoint(self.ctx.job.id, self.ctx.worker_id, step=ckpt.step, files=files,
                                             state=state, final=final, metrics=metrics)
        if final:
            self.final_checkpoint_id = row.id


def run(ctx: JobContext) -> RecipeOutcome:
    job, blobs = ctx.job, ctx.blobs
    hooks = JobHooks(ctx)
    with ctx.db.session() as s:
        dataset = s.get(Dataset, job.dataset_id)
    resume = None
    latest = ctx.latest_checkpoint
    if latest is not None:
        resume = SftCheckpoint(step=latest.step, root=ctx.work / "resume")
        blobs.materialize([StoredFile.from_json(f) for f in latest.files], resume.weights_dir)
        blobs.materialize([StoredFile.from_json(f) for f in latest.state], resume.state_dir)
        ctx.ledger.log(job.id, f"resuming from the checkpoint at step {latest.step} ({latest.id})")
    outcome = run_sft(Path(job.model_path), blobs.path(dataset.sha256), SftHyperparams.from_json(job.config), hooks,
                      resume=resume, base_model_name=job.base_model, work_dir=ctx.work)
    return RecipeOutcome(step=outcome.step, stopped=outcome.stopped, output_checkpoint_id=hooks.final_checkpoint_id)
