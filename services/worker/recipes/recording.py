"""What every managed recipe does around its training run: lay out the job's dataset and its latest checkpoint
(verified against their sha256), then record each event of the run (services/trainer/sft.py's Log, Started, Metrics,
Checkpoint, Finished) through the ledger (each write conditional on the lease) and the object store."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from services.common import blobrefs
from services.common.blobstore import StoredFile
from services.common.schema import Checkpoint as CheckpointRow
from services.common.schema import Dataset
from services.trainer.sft import Checkpoint, Finished, Log, Metrics, SftCheckpoint, SftEvent, Started
from services.worker.job import JobContext, RecipeOutcome

Events = Callable[[Path, SftCheckpoint | None], Iterator[SftEvent]]  # (dataset path, resume) -> the run's events


def run_recorded(ctx: JobContext, events: Events, *, checkpoint_kind: str = "lora_adapter",
                 dataset_id: str = "", resume_from: CheckpointRow | None | bool = True,
                 step_offset: int = 0) -> RecipeOutcome:
    """Run events(dataset path, the checkpoint to resume from or None) and record everything it yields; the
    checkpoints are stored as checkpoint_kind ("lora_adapter", or "full" for a whole model directory).
    A loop job (recipes/loop.py) runs several trainings in one job: dataset_id (default: the job's), the checkpoint
    row to resume from (default True: the job's latest; None: none) and step_offset (the job's steps before this
    run: the run's step s is recorded as step_offset + s, so the job's steps keep increasing)."""
    job, blobs, ledger = ctx.job, ctx.blobs, ctx.ledger
    with ctx.db.session() as s:
        dataset = s.get(Dataset, dataset_id or job.dataset_id)
    # Every stored file is laid out verified against the sha256 its row names: damage fails the job with DataLoss
    # naming the object, instead of training on it.
    data_path = blobs.materialize([StoredFile("dataset.jsonl", dataset.sha256, dataset.size_bytes)],
                                  ctx.work / "data" / dataset.id, what=f"dataset {dataset.id}") / "dataset.jsonl"
    resume = None
    latest = ctx.latest_checkpoint if resume_from is True else resume_from
    if latest is not None and latest.final:
        # The lost attempt stored the final checkpoint (its metrics, as every step's, came before it) and died before
        # the job was marked finished: the run is done. Running it again would record the last step's metrics twice
        # and store a second final checkpoint.
        ledger.log(job.id, f"the checkpoint at step {latest.step} ({latest.id}) is the run's final one; finishing")
        return RecipeOutcome(step=latest.step, stopped=False, output_checkpoint_id=latest.id)
    if latest is not None:
        resume = laid_out(ctx, latest, ctx.work / "resume", step=latest.step - step_offset)
        ledger.log(job.id, f"resuming from the checkpoint at step {latest.step} ({latest.id})")
    final_checkpoint_id, finished = "", None
    for event in events(data_path, resume):
        match event:
            case Log(message, level):
                ledger.log(job.id, message, level)
            case Started(total_steps, info):
                ledger.progress(job.id, ctx.worker_id, total_steps=step_offset + total_steps)
                details = ", ".join(f"{k} {v}" for k, v in info.items())
                ledger.log(job.id, f"training: {total_steps} steps ({details})")
            case Metrics(step, metrics):
                ledger.progress(job.id, ctx.worker_id, step=step_offset + step, metrics=metrics)
            case Checkpoint(ckpt, final, metrics):
                with blobs.saving(blobrefs.checker(ctx.db)) as save:  # a lost lease takes the new blobs back
                    files = [f.to_json() for f in save.put_tree(ckpt.weights_dir)]
                    state = [f.to_json() for f in save.put_tree(ckpt.state_dir)]
                    row = ledger.add_checkpoint(job.id, ctx.worker_id, step=step_offset + ckpt.step, files=files,
                                                state=state,
                                                final=final, metrics=metrics, kind=checkpoint_kind)
                if final:
                    final_checkpoint_id = row.id
            case Finished():
                finished = event
    assert finished is not None, "a training run always ends with Finished"
    return RecipeOutcome(step=step_offset + finished.step, stopped=finished.stopped,
                         output_checkpoint_id=final_checkpoint_id)


def laid_out(ctx: JobContext, row: CheckpointRow, root: Path, *, step: int) -> SftCheckpoint:
    """A stored checkpoint's weights and state laid out under root (verified), as the trainer reads one."""
    ckpt = SftCheckpoint(step=step, root=root)
    ctx.blobs.materialize([StoredFile.from_json(f) for f in row.files], ckpt.weights_dir, what=f"checkpoint {row.id}")
    ctx.blobs.materialize([StoredFile.from_json(f) for f in row.state], ckpt.state_dir,
                          what=f"checkpoint {row.id} state")
    return ckpt
