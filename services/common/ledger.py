"""The job state machine, shared by the scheduler (create, cancel, reap) and the workers (claim, progress, finish).

    queued --claim--> running --finish--> succeeded | failed | cancelled
      ^                  |
      +----- reap -------+   (heartbeat older than worker_lost_after_s: retried, resumes from its last checkpoint)

A running job is leased to one worker (worker_id). Every write a worker makes is conditional on still holding the
lease, so a worker that was presumed lost (and whose job was handed to another) cannot overwrite the new attempt.
Each transition is one transaction; timestamps are UTC.

A worker starts a job with `claim_next` (the first queued job in queue order that its machine can hold now) or
`claim_on` (one given job): the claim allocates the job's devices and issues its job-scoped API key in the same
transaction (services/common/resources.py, services/common/auth.py). Every end of an attempt -- finish, abandon, the
reaper's requeue -- releases the devices and revokes the key in the transaction that ends it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, func, select, update

from services.common import resources
from services.common.auth import issue_job_key, revoke_job_keys
from services.common.db import Database
from services.common.schema import Checkpoint, Device, Job, JobLog, JobMetric, new_id, utcnow

TERMINAL = ("succeeded", "failed", "cancelled")
LEASE_EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc)  # a heartbeat older than any worker_lost_after_s
STATUSES = ("queued", "running", *TERMINAL)


class LeaseLost(Exception):
    """The job is no longer this worker's: it was cancelled, reaped or finished elsewhere."""


@dataclass(frozen=True)
class HeldDevice:
    id: str
    kind: str  # "gpu" | "cpu"
    index: int
    role: str  # "trainer" | "rollout"


@dataclass
class Claim:
    job: Job
    attempt: int
    devices: list[HeldDevice] = field(default_factory=list)  # trainer devices first, then rollout devices
    credential: str = ""  # the job-scoped API key of this attempt ("" for a claim without devices)


def _end_attempt(s, job_id: str) -> None:
    """What every end of an attempt does: its devices go back to the pool, its job-scoped key stops working."""
    resources.release(s, job_id)
    revoke_job_keys(s, job_id)


class Ledger:
    def __init__(self, db: Database):
        self.db = db

    # -- scheduler side ------------------------------------------------------------------------------------------
    def log(self, job_id: str, message: str, level: str = "info") -> None:
        with self.db.session() as s:
            s.add(JobLog(job_id=job_id, level=level, message=message, created_at=utcnow()))

    def count_by_status(self) -> dict[str, int]:
        """Jobs of every account by status (every status present, 0 when none)."""
        with self.db.session() as s:
            counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        return {status: counts.get(status, 0) for status in STATUSES}

    def reap(self, lost_after_s: float, max_attempts: int) -> list[str]:
        """Requeue running jobs whose worker stopped heartbeating. Returns the ids to dispatch again."""
        cutoff = utcnow() - timedelta(seconds=lost_after_s)
        requeue = []
        with self.db.session() as s:
            stale = s.scalars(select(Job).where(Job.status == "running", Job.heartbeat_at < cutoff)
                              .with_for_update(skip_locked=True)).all()
            for job in stale:
                now = utcnow()
                _end_attempt(s, job.id)
                lost = job.worker_id
                job.worker_id = ""
                job.updated_at = now
                if job.cancel_requested:
                    job.status, job.finished_at = "cancelled", now
                    msg = f"worker {lost} stopped responding; the job was cancelled"
                elif job.attempts >= max_attempts:
                    job.status, job.finished_at = "failed", now
                    job.error = f"worker lost {job.attempts} times (limit {max_attempts}); giving up"
                    msg = job.error
                else:
                    job.status, job.dispatched_at = "queued", None
                    msg = (f"worker {lost} stopped responding; retrying (attempt {job.attempts + 1} of "
                           f"{max_attempts}) from the last checkpoint")
                    requeue.append(job.id)
                s.add(JobLog(job_id=job.id, level="warning", message=msg, created_at=now))
        return requeue

    def undispatched(self, older_than_s: float) -> list[str]:
        """Queued jobs whose attempt never reached the broker (the scheduler stopped between commit and send)."""
        cutoff = utcnow() - timedelta(seconds=older_than_s)
        with self.db.session() as s:
            return list(s.scalars(select(Job.id).where(Job.status == "queued", Job.dispatched_at.is_(None),
                                                       Job.updated_at < cutoff)))

    def requeue_undispatched(self, job_id: str) -> bool:
        """A delivered job that a worker did not start: if still queued, its message is spent, so the reaper's next
        pass sends it again (undispatched). Whether it is still queued."""
        with self.db.session() as s:
            return s.execute(update(Job).where(Job.id == job_id, Job.status == "queued")
                             .values(dispatched_at=None)).rowcount == 1

    def mark_dispatched(self, job_id: str) -> None:
        with self.db.session() as s:
            s.execute(update(Job).where(Job.id == job_id, Job.status == "queued").values(dispatched_at=utcnow()))

    # -- worker side ---------------------------------------------------------------------------------------------
    def claim(self, job_id: str, worker_id: str) -> Claim | None:
        """Take a queued job without allocating devices or issuing a key (tools and tests; workers use claim_next /
        claim_on). None when it is not queued (already running elsewhere, finished or cancelled)."""
        now = utcnow()
        with self.db.session() as s:
            res = s.execute(update(Job).where(Job.id == job_id, Job.status == "queued", Job.cancel_requested.is_(False))
                            .values(status="running", worker_id=worker_id, heartbeat_at=now, updated_at=now,
                                    attempts=Job.attempts + 1))
            if res.rowcount != 1:
                return None
            job = s.get(Job, job_id)
            if job.started_at is None:
                job.started_at = now
            s.add(JobLog(job_id=job_id, level="info", created_at=now,
                         message=f"started on worker {worker_id} (attempt {job.attempts})"))
            return Claim(job=job, attempt=job.attempts)

    def claim_next(self, worker_id: str, host: str, *, default_max_devices: int = 0,
                   only: str | None = None) -> Claim | None:
        """Start the first queued job, in queue order, that this machine (host) can hold now, or only that job: its
        devices allocated and its job-scoped key issued, in one transaction serialized with every other claim.
        Jobs looked at that must wait get the reason (wait_reason, a log line when it changes). None: nothing to
        start here now. default_max_devices: the account device quota where no operator set one (0: none)."""
        now = utcnow()
        with self.db.session() as s:
            resources.serialize_claims(s)
            free = resources.free_devices(s, host)
            total = int(s.scalar(select(func.count()).select_from(Device).where(Device.host == host)) or 0)
            q = select(Job).where(Job.status == "queued", Job.cancel_requested.is_(False))
            if only is not None:
                q = q.where(Job.id == only)
            queued = list(s.scalars(q))
            held = dict(s.execute(select(Device.account_id, func.count()).where(Device.account_id.is_not(None))
                                  .group_by(Device.account_id)).all())
            last = resources.last_starts(s, {j.account_id for j in queued})
            for job in resources.queue_order(queued, held, last):
                need = job.trainer_devices + job.rollout_devices
                if need > total:  # never on this machine; a bigger one may take it
                    if only is not None:
                        resources.note_wait(s, job, f"needs {need} devices on one worker; worker {host} has {total}")
                    continue
                limits = resources.account_limits(s, job.account_id, default_max_devices, 0)
                using = held.get(job.account_id, 0)
                if limits.max_devices and using + need > limits.max_devices:
                    resources.note_wait(s, job, f"quota max_devices ({limits.max_devices}) reached: the account's "
                                                f"running jobs hold {using} devices and this job needs {need}")
                    continue
                if need > len(free):
                    resources.note_wait(s, job, f"waiting for {need} free devices on one worker (worker {host} has "
                                                f"{len(free)} of {total} free)")
                    break
                res = s.execute(update(Job).where(Job.id == job.id, Job.status == "queued",
                                                  Job.cancel_requested.is_(False))
                                .values(status="running", worker_id=worker_id, heartbeat_at=now, updated_at=now,
                                        attempts=Job.attempts + 1, wait_reason="")
                                .execution_options(synchronize_session=False))
                if res.rowcount != 1:
                    continue
                s.refresh(job)
                if job.started_at is None:
                    job.started_at = now
                taken = resources.assign(s, job, free)
                held_devices = [HeldDevice(d.id, d.kind, d.index, d.role) for d in taken]
                s.add(JobLog(job_id=job.id, level="info", created_at=now,
                             message=f"started on worker {worker_id} (attempt {job.attempts}) with "
                                     + ", ".join(f"{d.kind}{d.index} ({d.role})" for d in held_devices)))
                credential = issue_job_key(s, job)
                return Claim(job=job, attempt=job.attempts, devices=held_devices, credential=credential)
            return None

    def claim_on(self, job_id: str, worker_id: str, host: str, *, default_max_devices: int = 0) -> Claim | None:
        """claim_next for one job: None when it is not queued or must wait (its wait_reason says why)."""
        return self.claim_next(worker_id, host, default_max_devices=default_max_devices, only=job_id)

    def _owned(self, s, job_id: str, worker_id: str) -> Job:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.status != "running" or job.worker_id != worker_id:
            raise LeaseLost(job_id)
        return job

    def heartbeat(self, job_id: str, worker_id: str) -> bool:
        """Renew the lease; returns whether cancellation was requested. Raises LeaseLost."""
        now = utcnow()
        with self.db.session() as s:
            res = s.execute(update(Job).where(Job.id == job_id, Job.status == "running", Job.worker_id == worker_id)
                            .values(heartbeat_at=now))
            if res.rowcount != 1:
                raise LeaseLost(job_id)
            return bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))

    def progress(self, job_id: str, worker_id: str, *, step: int | None = None, total_steps: int | None = None,
                 metrics: dict[str, float] | None = None) -> None:
        now = utcnow()
        with self.db.session() as s:
            job = self._owned(s, job_id, worker_id)
            if step is not None:
                job.step = step
            if total_steps is not None:
                job.total_steps = total_steps
            if metrics:
                job.latest_metrics = {**(job.latest_metrics or {}), **metrics}
                s.add(JobMetric(job_id=job_id, step=job.step if step is None else step, data=metrics,
                                created_at=now))
            job.updated_at = now
            job.heartbeat_at = now

    def rewind(self, job_id: str, worker_id: str, step: int) -> None:
        """A new attempt restarts at step (its resume checkpoint, or 0): metrics of later steps from the lost attempt
        are dropped, so every step keeps exactly one value (the one of the attempt that finished it)."""
        with self.db.session() as s:
            job = self._owned(s, job_id, worker_id)
            dropped = s.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > step)).rowcount
            job.step = step
            job.updated_at = utcnow()
            if dropped:
                s.add(JobLog(job_id=job_id, level="info", created_at=utcnow(),
                             message=f"discarded {dropped} metric points after step {step} from the lost attempt"))

    def add_checkpoint(self, job_id: str, worker_id: str, *, step: int, files: list[dict], state: list[dict],
                       final: bool, metrics: dict[str, float], kind: str = "lora_adapter") -> Checkpoint:
        now = utcnow()
        with self.db.session() as s:
            job = self._owned(s, job_id, worker_id)
            ckpt = Checkpoint(id=new_id("ckpt"), account_id=job.account_id, job_id=job_id, step=step, kind=kind,
                              base_model=job.base_model, model_path=job.model_path, files=files, state=state,
                              final=final, metrics=metrics, created_at=now, name=f"{job.id}-step{step}")
            s.add(ckpt)
            s.add(JobLog(job_id=job_id, level="info", created_at=now,
                         message=f"{'final ' if final else ''}checkpoint saved at step {step} ({ckpt.id})"))
            job.updated_at = now
            return ckpt

    def abandon(self, job_id: str, worker_id: str, reason: str) -> None:
        """This worker's attempt failed in a way another attempt may not (its training group lost a rank): the lease
        expires at once, so the reaper's next pass treats the job as a lost worker's -- retried from its latest
        checkpoint, or failed after max_job_attempts, or cancelled if that was asked. Raises LeaseLost."""
        with self.db.session() as s:
            job = self._owned(s, job_id, worker_id)
            _end_attempt(s, job_id)
            job.heartbeat_at = LEASE_EXPIRED
            job.updated_at = utcnow()
            s.add(JobLog(job_id=job_id, level="error", created_at=utcnow(),
                         message=f"attempt {job.attempts} failed: {reason}; handed back for a retry from the last "
                                 "checkpoint"))

    def latest_checkpoint(self, job_id: str) -> Checkpoint | None:
        with self.db.session() as s:
            return s.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id)
                            .order_by(Checkpoint.step.desc(), Checkpoint.created_at.desc()).limit(1))

    def finish(self, job_id: str, worker_id: str, status: str, *, error: str = "",
               output_checkpoint_id: str = "", message: str = "") -> None:
        assert status in TERMINAL
        now = utcnow()
        with self.db.session() as s:
            job = self._owned(s, job_id, worker_id)
            job.status, job.finished_at, job.updated_at = status, now, now
            _end_attempt(s, job_id)
            job.error = error
            job.worker_id = ""
            if output_checkpoint_id:
                job.output_checkpoint_id = output_checkpoint_id
            s.add(JobLog(job_id=job_id, level="error" if status == "failed" else "info", created_at=now,
                         message=message or (f"{status}: {error}" if error else status)))

    def job(self, job_id: str) -> Job | None:
        with self.db.session() as s:
            return s.get(Job, job_id)

    def set_fields(self, job_id: str, **fields: Any) -> None:
        with self.db.session() as s:
            s.execute(update(Job).where(Job.id == job_id).values(**fields, updated_at=utcnow()))
