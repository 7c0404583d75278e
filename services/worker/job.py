"""A managed job on a worker: claim the lease, run the job method's recipe, finish.

Ordering: claim (queued -> running, attempt n) -> on a retry, rewind the job's progress to its latest checkpoint ->
the recipe of job.method (services/worker/recipes/: it resumes from that checkpoint and writes metrics and
checkpoints through the ledger, each conditional on the lease) -> finish. A heartbeat thread renews the lease every
heartbeat_s and turns a cancellation request (or a lost lease) into a stop flag that the recipe checks every step, so
CancelJob takes effect within about heartbeat_s plus one step.

A job may train on a torchrun group rather than in this process (WorkerSettings.managed_nproc > 1: the recipe starts
one per attempt, services/worker/group.py). A rank that dies ends the group and the recipe raises GroupLost (an RFT
job's rollout process that dies: RolloutLost; both are AttemptLost): the attempt failed, but another may not, so the job is handed back (Ledger.abandon: its lease expires at once) and the
scheduler's reaper retries it from its latest checkpoint, exactly as when the worker itself is lost (bounded by
max_job_attempts).

Devices and credentials (docs/resources.md): the worker registers its machine's devices (WorkerSettings.worker_host,
cpu_slots) before it claims, and the claim allocates the job's trainer and rollout devices on this machine and
issues the attempt's job-scoped API key (JobContext.devices, JobContext.credential: what the job's background work
calls the platform with). A job that cannot start here now (its devices are not free, its account is at its device
quota) stays queued with the reason; the scheduler's reaper sends it again. The Celery task runs `run_queue`: the
first queued job in queue order that fits here, then the next, until none does.
"""
from __future__ import annotations

import dataclasses
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
from services.common.errors import AttemptLost
from services.common.resources import Inventory, detect_devices
from services.common.schema import Checkpoint, Job
from services.common.ledger import Claim, HeldDevice, Ledger, LeaseLost
from services.worker.settings import WorkerSettings

log = logging.getLogger("trainyard.worker")


class Heartbeat(threading.Thread):
    def __init__(self, ledger: Ledger, job_id: str, worker_id: str, interval_s: float, host: str = ""):
        super().__init__(daemon=True, name=f"heartbeat-{job_id}")
        self.ledger, self.job_id, self.worker_id, self.interval_s = ledger, job_id, worker_id, interval_s
        self.host = host  # the machine whose inventory each beat keeps live
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
                if self.host:
                    Inventory(self.ledger.db).heartbeat(self.host)
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
    devices: list[HeldDevice] = dataclasses.field(default_factory=list)  # trainer devices first, then rollout ones
    credential: str = ""  # the attempt's job-scoped API key, for the job's calls to the platform

    def role_devices(self, role: str) -> list[HeldDevice]:
        return [d for d in self.devices if d.role == role]


@dataclass
class RecipeOutcome:
    step: int
    stopped: bool  # True when the heartbeat's stop flag ended the run early
    output_checkpoint_id: str = ""


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def register_devices(db: Database, settings: WorkerSettings) -> None:
    """This machine's devices into the inventory (idempotent: each start and each job refreshes them)."""
    Inventory(db).register(settings.machine(), detect_devices(settings.cpu_slots))


def run_managed_job(job_id: str, settings: WorkerSettings) -> None:
    """Run this job here if it can start now (else it stays queued, with the reason)."""
    with logs.scope(job_id=job_id):  # the job's log records carry its id (and its account's, once claimed)
        db = Database(settings.database_url)
        try:
            register_devices(db, settings)
            ledger = Ledger(db)
            claim = ledger.claim_on(job_id, worker_id(), settings.machine(),
                                    default_max_devices=settings.max_devices_per_account)
            if claim is None:
                _not_started(ledger, job_id)
                return
            _run_claimed(claim, db, settings)
        finally:
            db.dispose()


def run_queue(job_id: str, settings: WorkerSettings) -> None:
    """The Celery task: start queued jobs here in queue order, one after another, while one fits; job_id (the
    message's) stays queued with its reason if it did not start (the scheduler sends it again)."""
    db = Database(settings.database_url)
    try:
        register_devices(db, settings)
        ledger = Ledger(db)
        while True:
            claim = ledger.claim_next(worker_id(), settings.machine(), default_max_devices=settings.max_devices_per_account)
            if claim is None:
                break
            with logs.scope(job_id=claim.job.id):
                _run_claimed(claim, db, settings)
        _not_started(ledger, job_id)
    finally:
        db.dispose()


def _not_started(ledger: Ledger, job_id: str) -> None:
    """A delivered job that did not start here: if still queued, it waits for the scheduler to send it again."""
    if ledger.requeue_undispatched(job_id):
        job = ledger.job(job_id)
        log.info("job %s waits: %s", job_id, job.wait_reason if job is not None else "")
    else:
        log.info("job %s is not queued; skipping this delivery", job_id)


def _run_claimed(claim: Claim, db: Database, settings: WorkerSettings) -> None:
    blobs = BlobStore(settings.blob_dir)
    ledger = Ledger(db)
    job, wid = claim.job, worker_id()
    logs.annotate(account_id=job.account_id)
    hb = Heartbeat(ledger, job.id, wid, settings.heartbeat_s, settings.machine())
    hb.start()
    # In the process's staging directory: a killed worker's scratch is swept at the next start-up.
    work = Path(tempfile.mkdtemp(prefix=f"{job.id}-", dir=blobs.staging_dir()))
    try:
        _use_devices(claim.devices)
        _run(job, ledger, blobs, db, wid, hb, work, settings, claim)
    finally:
        hb.done.set()
        shutil.rmtree(work, ignore_errors=True)


def _use_devices(devices: list[HeldDevice]) -> None:
    """Training in this process runs on the job's first trainer GPU (a CPU slot needs nothing)."""
    trainer = [d for d in devices if d.role == "trainer" and d.kind == "gpu"]
    if trainer:
        import torch

        torch.cuda.set_device(trainer[0].index)


def _run(job, ledger: Ledger, blobs: BlobStore, db: Database, worker_id: str, hb: Heartbeat, work: Path,
         settings: WorkerSettings, claim: Claim) -> None:
    from services.worker.recipes import recipe

    try:
        latest = ledger.latest_checkpoint(job.id)
        if job.attempts > 1:
            ledger.rewind(job.id, worker_id, latest.step if latest is not None else 0)
        log.info("job %s: attempt %d of %s on %s", job.id, job.attempts, job.method, job.base_model)
        outcome = recipe(job.method)(JobContext(job, ledger, blobs, db, worker_id, hb, work, latest, settings,
                                                claim.devices, claim.credential))
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
    except AttemptLost as exc:  # a rank or the job's rollout process died: hand the job back for a retry
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
