"""A managed job on a worker: claim the lease, run the training loop, persist progress, finish.

Ordering: claim (queued -> running, attempt n) -> materialize the latest checkpoint if any (resume) -> run_sft with
hooks that write metrics and checkpoints through the ledger (each conditional on the lease) -> finish. A heartbeat
thread renews the lease every heartbeat_s and turns a cancellation request (or a lost lease) into a stop flag that the
loop checks every step, so CancelJob takes effect within about heartbeat_s plus one step.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import traceback
from pathlib import Path

from services.common.blobstore import BlobStore, StoredFile
from services.common.db import Database
from services.common.schema import Dataset
from services.scheduler.ledger import Ledger, LeaseLost
from services.scheduler.settings import SchedulerSettings
from services.trainer.sft import SftCheckpoint, run_sft
from services.trainer.sft_config import SftHyperparams

log = logging.getLogger("trainyard.worker")


class Heartbeat(threading.Thread):
    def __init__(self, ledger: Ledger, job_id: str, worker_id: str, interval_s: float):
        super().__init__(daemon=True, name=f"heartbeat-{job_id}")
        self.ledger, self.job_id, self.worker_id, self.interval_s = ledger, job_id, worker_id, interval_s
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                if self.ledger.heartbeat(self.job_id, self.worker_id):
                    self.cancel.set()
            except LeaseLost:
                self.lost.set()
                return
            except Exception:  # noqa: BLE001 - a database blip must not kill the job; the next beat retries
                log.exception("heartbeat for %s failed", self.job_id)

    def should_stop(self) -> bool:
        return self.cancel.is_set() or self.lost.is_set()


class JobHooks:
    """SftHooks backed by the ledger and the object store."""

    def __init__(self, ledger: Ledger, blobs: BlobStore, job_id: str, worker_id: str, hb: Heartbeat):
        self.ledger, self.blobs, self.job_id, self.worker_id, self.hb = ledger, blobs, job_id, worker_id, hb
        self.final_checkpoint_id = ""

    def should_stop(self) -> bool:
        return self.hb.should_stop()

    def on_start(self, total_steps: int, info: dict) -> None:
        self.ledger.progress(self.job_id, self.worker_id, total_steps=total_steps)
        details = ", ".join(f"{k} {v}" for k, v in info.items())
        self.ledger.log(self.job_id, f"training: {total_steps} steps ({details})")

    def on_log(self, message: str, level: str = "info") -> None:
        self.ledger.log(self.job_id, message, level)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.ledger.progress(self.job_id, self.worker_id, step=step, metrics=metrics)

    def on_checkpoint(self, ckpt: SftCheckpoint, final: bool, metrics: dict[str, float]) -> None:
        files = [f.to_json() for f in self.blobs.put_tree(ckpt.adapter_dir)]
        state = [f.to_json() for f in self.blobs.put_tree(ckpt.state_dir)] if ckpt.state_dir else []
        row = self.ledger.add_checkpoint(self.job_id, self.worker_id, step=ckpt.step, files=files, state=state,
                                         final=final, metrics=metrics)
        if final:
            self.final_checkpoint_id = row.id


def run_managed_job(job_id: str, settings: SchedulerSettings) -> None:
    db = Database(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    ledger = Ledger(db)
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    try:
        claim = ledger.claim(job_id, worker_id)
        if claim is None:
            log.info("job %s is not queued; skipping this delivery", job_id)
            return
        job = claim.job
        hb = Heartbeat(ledger, job_id, worker_id, settings.heartbeat_s)
        hb.start()
        work = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=settings.data_dir))
        try:
            _run(job, ledger, blobs, db, worker_id, hb, work)
        finally:
            hb.done.set()
            shutil.rmtree(work, ignore_errors=True)
    finally:
        db.dispose()


def _run(job, ledger: Ledger, blobs: BlobStore, db: Database, worker_id: str, hb: Heartbeat, work: Path) -> None:
    hooks = JobHooks(ledger, blobs, job.id, worker_id, hb)
    try:
        with db.session() as s:
            dataset = s.get(Dataset, job.dataset_id)
        resume = None
        latest = ledger.latest_checkpoint(job.id)
        if job.attempts > 1:
            ledger.rewind(job.id, worker_id, latest.step if latest is not None else 0)
        if latest is not None:
            resume = SftCheckpoint(
                step=latest.step,
                adapter_dir=blobs.materialize([StoredFile.from_json(f) for f in latest.files], work / "resume-adapter"),
                state_dir=blobs.materialize([StoredFile.from_json(f) for f in latest.state], work / "resume-state"),
            )
            ledger.log(job.id, f"resuming from the checkpoint at step {latest.step} ({latest.id})")
        outcome = run_sft(Path(job.model_path), blobs.path(dataset.sha256), SftHyperparams.from_json(job.config),
                          hooks, resume=resume, base_model_name=job.base_model, work_dir=work)
        if hb.lost.is_set():
            log.warning("job %s: lease lost; another worker owns it now", job.id)
        elif outcome.stopped:
            ledger.finish(job.id, worker_id, "cancelled", message=f"cancelled at step {outcome.step}")
        else:
            ledger.finish(job.id, worker_id, "succeeded", output_checkpoint_id=hooks.final_checkpoint_id,
                          message=f"succeeded after {outcome.step} steps")
    except LeaseLost:
        log.warning("job %s: lease lost; stopping without further writes", job.id)
    except Exception as exc:  # noqa: BLE001 - any training failure ends the job with its message
        log.error("job %s failed:\n%s", job.id, traceback.format_exc())
        try:
            ledger.finish(job.id, worker_id, "failed", error=f"{type(exc).__name__}: {exc}")
        except LeaseLost:
            pass
