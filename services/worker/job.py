"""A managed job on a worker: claim the lease, run the job method's recipe, finish.

Ordering: claim (queued -> running, attempt n) -> on a retry, rewind the job's progress to its latest checkpoint ->
the recipe of job.method (services/worker/recipes/: it resumes from that checkpoint and writes metrics and
checkpoints through the ledger, each conditional on the lease) -> finish. A heartbeat thread renews the lease every
heartbeat_s and turns a cancellation request (or a lost lease) into a stop flag that the recipe checks every step, so
CancelJob takes effect within about heartbeat_s plus one step.

A job may train on a torchrun group rather than in this process (WorkerSettings.managed_nproc > 1: the recipe starts
one per attempt, services/worker/group.py). A rank that dies ends the group and the recipe raises GroupLost: the
attempt failed, but another may not, so the job is handed back (Ledger.abandon: its lease expires at once) and the
scheduler's reaper retries it from its latest checkpoint, exactly as when the worker itself is lost (bounded by
max_job_attempts).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

from services.common import logs
from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.schema import Checkpoint, Job
from services.common.ledger import Ledger, LeaseLost
from services.worker.group import GroupLost
from services.worker.settings import WorkerSettings

log = logging.getLogger("trainyard.worker")


class Heartbeat(threading.Thread):
    def __init__(self, ledger: Ledger, job_id: str, worker_id: str, interval_s: float):
        super().__init__(daemon=True, name=f"heartbeat-{job_id}")
        self.ledger, self.job_id, self.worker_id, self.interval_s = ledger, job_id, worker_id, interval_s
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.stop = threading.Event()  # set with either: what a recipe's training run checks
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                if self.ledger.heartbeat(self.job_id, self.worker_id):
                    self.cancel.set()
                    self.stop.set()
            except LeaseLost:
                self.lost.set()
                self.stop.set()
                return
            except Exception:  # noqa: BLE001 - a database blip must not kill the job; the next beat retries
                log.exception("heartbeat for %s failed", self.job_id)


@dataclass
class JobContext:
    """What a recipe gets: the claimed job, the stores, its lease and a scratch directory removed afterwards."""

    job: Job
    ledger: Ledger
    blobs: BlobStore
    db: Database
    worker_id: str
    heartbeat: Heartbeat
    work: Path
    latest_checkpoint: Checkpoint | None  # the job's latest checkpoint: a recipe resumes from it
    settings: WorkerSettings


@dataclass
class RecipeOutcome:
    step: int
    stopped: bool  # True when the heartbeat's stop flag ended the run early
    output_checkpoint_id: str = ""


def run_managed_job(job_id: str, settings: WorkerSettings) -> None:
    with logs.scope(job_id=job_id):  # the job's log records carry its id (and its account's, once claimed)
        _run_managed_job(job_id, settings)


def _run_managed_job(job_id: str, settings: WorkerSettings) -> None:
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
        logs.annotate(account_id=job.account_id)
        hb = Heartbeat(ledger, job_id, worker_id, settings.heartbeat_s)
        hb.start()
        # In the process's staging directory: a killed worker's scratch is swept at the next start-up.
        work = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=blobs.staging_dir()))
        try:
            _run(job, ledger, blobs, db, worker_id, hb, work, settings)
        finally:
            hb.done.set()
            shutil.rmtree(work, ignore_errors=True)
    finally:
        db.dispose()


def _run(job, ledger: Ledger, blobs: BlobStore, db: Database, worker_id: str, hb: Heartbeat, work: Path,
         settings: WorkerSettings) -> None:
    from services.worker.recipes import recipe

    try:
        latest = ledger.latest_checkpoint(job.id)
        if job.attempts > 1:
            ledger.rewind(job.id, worker_id, latest.step if latest is not None else 0)
        log.info("job %s: attempt %d of %s on %s", job.id, job.attempts, job.method, job.base_model)
        outcome = recipe(job.method)(JobContext(job, ledger, blobs, db, worker_id, hb, work, latest, settings))
        if hb.lost.is_set():
            log.warning("job %s: lease lost; another worker owns it now", job.id)
        elif outcome.stopped:
            ledger.finish(job.id, worker_id, "cancelled", message=f"cancelled at step {outcome.step}")
            log.info("job %s: cancelled at step %d", job.id, outcome.step)
        else:
            ledger.finish(job.id, worker_id, "succeeded", output_checkpoint_id=outcome.output_checkpoint_id,
                          message=f"succeeded after {outcome.step} steps")
            log.info("job %s: succeeded after %d steps", job.id, outcome.step)
    except LeaseLost:
        log.warning("job %s: lease lost; stopping without further writes", job.id)
    except GroupLost as exc:
        log.error("job %s: attempt %d failed, to be retried: %s", job.id, job.attempts, exc)
        hb.done.set()  # no beat may renew the lease after it is given up
        hb.join()
        try:
            ledger.abandon(job.id, worker_id, str(exc))
        except LeaseLost:
            pass
    except Exception as exc:  # noqa: BLE001 - any training failure ends the job with its message
        log.error("job %s failed:\n%s", job.id, traceback.format_exc())
        try:
            ledger.finish(job.id, worker_id, "failed", error=f"{type(exc).__name__}: {exc}")
        except LeaseLost:
            pass
