"""Managed jobs as the user sees them: plan and create (validate, store queued, dispatch), read, watch, cancel,
resume."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy import func, select

from services.common import registry
from services.common.db import Database
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable, not_found
from services.common.methods import HYPERPARAMS
from services.common.methods.resolved import Resolved, model_violations
from services.common.schema import Dataset, Job, JobLog, JobMetric, Model, new_id, utcnow
from services.common.ledger import TERMINAL, Ledger
from services.common.quotas import quota_reached
from services.common.resources import Inventory, ResourceRequest, account_limits, check_fits, resolve_request
from services.scheduler.planner import Planner
from trainyard.methods import METHODS, Method, SftSettings


@dataclass
class NewJob:
    method: str
    base_model: str
    dataset_id: str
    display_name: str
    config: dict  # the method's settings as given (unset ones left out or None), validated here
    # Resources (docs/resources.md): devices on one worker (None: the method's default) and the queue priority.
    trainer_devices: int | None = None
    rollout_devices: int | None = None
    priority: int = 0


@dataclass
class CheckedJob:
    """A request that passed every CreateJob check: what a job row (or a plan) is made from."""

    method: Method
    model: Model
    dataset: Dataset
    settings: Resolved
    resources: ResourceRequest


@dataclass
class WatchItem:
    kind: str  # "job" | "metric" | "log"
    row: object


class JobCore:
    def __init__(self, db: Database, ledger: Ledger, dispatch: Callable[[str], None], poll_s: float,
                 stopping: threading.Event, planner: Planner | None = None, *, live_within_s: float = 30.0,
                 max_queued_jobs_per_account: int = 0, max_devices_per_account: int = 0):
        """live_within_s: a worker machine heard from within it counts when a request is checked against the
        inventory; the two quotas: the defaults where an operator set none (0: no limit)."""
        self.live_within_s = live_within_s
        self.max_queued_jobs_per_account = max_queued_jobs_per_account
        self.max_devices_per_account = max_devices_per_account
        self.db = db
        self.ledger = ledger
        self.dispatch = dispatch
        self.poll_s = poll_s
        self.stopping = stopping
        self.planner = planner

    def check(self, account_id: str, req: NewJob) -> CheckedJob:
        """CreateJob's checks (PlanJob runs the same): the method, the model, the dataset and its format, then the
        settings against their declaration and against the model; one INVALID_ARGUMENT with every violation."""
        method = METHODS.get(req.method)
        if method is None:
            raise InvalidArgument(f"must be one of {', '.join('JOB_METHOD_' + m.upper() for m in METHODS)}",
                                  field="spec.method")
        with self.db.session() as s:
            model = registry.require_model(s, account_id, req.base_model, field="spec.base_model")
            if not req.dataset_id:
                raise InvalidArgument("required: the id of an uploaded dataset", field="spec.dataset_id")
            ds = s.get(Dataset, req.dataset_id)
            if ds is None or ds.account_id != account_id or ds.deleted_at is not None:
                raise not_found("dataset", req.dataset_id)
        if ds.format not in method.dataset_formats:
            raise InvalidArgument(f"dataset '{ds.id}' is in {ds.format} format; {method.name} needs "
                                  f"{' or '.join(method.dataset_formats)} rows", field="spec.dataset_id")
        settings, problems = HYPERPARAMS[method.name].check_request(req.config, prefix=method.prefix)
        with self.db.session() as s:
            problems += settings.job_violations(s, account_id, model.name)
        wrong = {v.field for v in problems}  # a value already reported is checked against the model no further
        problems += [v for v in model_violations(settings, model.path, model.max_position_embeddings,
                                                 prefix=method.prefix) if v.field not in wrong]
        resources, resource_problems = resolve_request(method.name, req.trainer_devices, req.rollout_devices,
                                                       req.priority)
        problems += resource_problems
        if problems:
            raise InvalidArgument(violations=problems)
        check_fits(resources, Inventory(self.db).largest(self.live_within_s))
        return CheckedJob(method, model, ds, settings, resources)

    def plan(self, account_id: str, req: NewJob) -> tuple[CheckedJob, dict]:
        """The checked request and its plan (services/scheduler/planner.py); nothing is stored."""
        checked = self.check(account_id, req)
        if not checked.method.trains:
            raise InvalidArgument(f"PlanJob plans training jobs; a {checked.method.name} job trains nothing",
                                  field="spec.method")
        return checked, self.planner.plan(checked.method.name, checked.model.path, checked.dataset.sha256,
                                          checked.settings.to_json(), what=f"dataset {checked.dataset.id}")

    def token_stats(self, account_id: str, dataset_id: str, base_model: str, max_seq_len: int) -> tuple[Model, dict]:
        """(the model, the planner's token statistics of the dataset's rows under its tokenizer); max_seq_len 0: SFT's
        default, at most the model's context."""
        with self.db.session() as s:
            model = registry.require_model(s, account_id, base_model, field="base_model")
            if not dataset_id:
                raise InvalidArgument("required: the id of an uploaded dataset", field="dataset_id")
            ds = s.get(Dataset, dataset_id)
            if ds is None or ds.account_id != account_id or ds.deleted_at is not None:
                raise not_found("dataset", dataset_id)
        context = model.max_position_embeddings
        if max_seq_len < 0 or (context and max_seq_len > context):
            raise InvalidArgument(f"must be between 1 and the model's context ({context}), or 0 for the default; got "
                                  f"{max_seq_len}", field="max_seq_len")
        limit = max_seq_len or min(SftSettings.max_seq_len, context or SftSettings.max_seq_len)
        return model, self.planner.plan("token_stats", model.path, ds.sha256, {"format": ds.format,
                                                                               "max_seq_len": limit},
                                        what=f"dataset {ds.id}")

    def create(self, account_id: str, req: NewJob) -> Job:
        checked = self.check(account_id, req)
        r = checked.resources
        with self.db.session() as s:
            self._check_queue_quota(s, account_id)
            job = Job(id=new_id("job"), account_id=account_id, display_name=req.display_name[:256],
                      method=checked.method.name, base_model=checked.model.name, model_path=checked.model.path,
                      dataset_id=checked.dataset.id, config=checked.settings.to_json(), status="queued",
                      created_at=utcnow(), updated_at=utcnow(), trainer_devices=r.trainer_devices,
                      rollout_devices=r.rollout_devices, priority=r.priority, wait_reason="")
            s.add(job)
            s.add(JobLog(job_id=job.id, level="info", message="queued", created_at=utcnow()))
        self._dispatch(job.id)
        return job

    def resume(self, account_id: str, job_id: str) -> Job:
        """ResumeJob: a failed or cancelled job is queued again in place. Its next attempt resumes from the job's
        latest checkpoint exactly as after a lost worker (services/worker/job.py rewinds the progress and metrics
        to that checkpoint's step), or starts afresh if the job has none."""
        latest = self.ledger.latest_checkpoint(job_id) if job_id else None
        with self.db.session() as s:
            job = s.get(Job, job_id, with_for_update=True) if job_id else None
            if job is None or job.account_id != account_id:
                raise not_found("job", job_id)
            if job.status not in ("failed", "cancelled"):
                raise FailedPrecondition(f"job '{job_id}' is {job.status}; only a failed or cancelled job can be "
                                         "resumed")
            self._check_queue_quota(s, account_id)
            job.status, job.finished_at, job.error, job.cancel_requested = "queued", None, "", False
            job.dispatched_at, job.wait_reason, job.updated_at = None, "", utcnow()
            # max_job_attempts counts the attempts since the resume; a job that ran before keeps 1, so its next
            # attempt (2) rewinds its progress to the checkpoint as a retry does.
            job.attempts = min(job.attempts, 1)
            where = (f"from the checkpoint at step {latest.step} ({latest.id})" if latest is not None
                     else "from the start (it has no checkpoint)")
            s.add(JobLog(job_id=job.id, level="info", message=f"resumed: queued again, to continue {where}",
                         created_at=utcnow()))
        self._dispatch(job_id)
        return self.get(account_id, job_id)

    def _check_queue_quota(self, s, account_id: str) -> None:
        limit = account_limits(s, account_id, self.max_devices_per_account,
                               self.max_queued_jobs_per_account).max_queued_jobs
        if limit:
            queued = s.scalar(select(func.count()).select_from(Job).where(Job.account_id == account_id,
                                                                          Job.status == "queued"))
            if queued + 1 > limit:
                raise quota_reached("max_queued_jobs_per_account", limit,
                                    f"the account has {queued} jobs queued; wait for some to start, or cancel some")

    def _dispatch(self, job_id: str) -> None:
        try:
            self.dispatch(job_id)
            self.ledger.mark_dispatched(job_id)
        except Exception as exc:  # noqa: BLE001 - the broker's own error types vary by transport
            self.ledger.set_fields(job_id, status="failed", finished_at=utcnow(),
                                   error=f"could not hand the job to a worker: {exc}")
            raise Unavailable(f"job {job_id} could not be queued: the job broker is unreachable ({exc})") from exc

    def get(self, account_id: str, job_id: str) -> Job:
        with self.db.session() as s:
            job = s.get(Job, job_id) if job_id else None
            if job is None or job.account_id != account_id:
                raise not_found("job", job_id)
            return job

    def list(self, account_id: str, status: str | None, offset: int, limit: int) -> tuple[list[Job], int | None]:
        q = select(Job).where(Job.account_id == account_id)
        if status:
            q = q.where(Job.status == status)
        with self.db.session() as s:
            rows = list(s.scalars(q.order_by(Job.created_at.desc(), Job.id).offset(offset).limit(limit + 1)))
        return rows[:limit], (offset + limit if len(rows) > limit else None)

    def metrics(self, account_id: str, job_id: str) -> list[JobMetric]:
        self.get(account_id, job_id)
        with self.db.session() as s:
            return list(s.scalars(select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.id)))

    def logs(self, account_id: str, job_id: str, after_id: int, limit: int) -> list[JobLog]:
        if not 0 <= limit <= 10000:
            raise InvalidArgument(f"must be between 0 and 10000 (0 = 1000), got {limit}", field="limit")
        self.get(account_id, job_id)
        with self.db.session() as s:
            return list(s.scalars(select(JobLog).where(JobLog.job_id == job_id, JobLog.id > after_id)
                                  .order_by(JobLog.id).limit(limit or 1000)))

    def cancel(self, account_id: str, job_id: str) -> Job:
        with self.db.session() as s:
            job = s.get(Job, job_id, with_for_update=True) if job_id else None
            if job is None or job.account_id != account_id:
                raise not_found("job", job_id)
            if job.status in ("succeeded", "failed"):
                raise FailedPrecondition(f"job '{job_id}' already {job.status}; nothing to cancel")
            if job.status == "queued":
                job.status, job.finished_at = "cancelled", utcnow()
                s.add(JobLog(job_id=job.id, level="info", message="cancelled before it started", created_at=utcnow()))
            elif job.status == "running" and not job.cancel_requested:
                s.add(JobLog(job_id=job.id, level="info", message="cancellation requested", created_at=utcnow()))
            job.cancel_requested = True
            job.updated_at = utcnow()
            return job

    def watch(self, account_id: str, job_id: str, from_step: int, is_active: Callable[[], bool]) -> Iterator[WatchItem]:
        """The job, its metrics from from_step and its log, then live changes until the job ends.

        Polls the database (every poll_s), so it follows workers in other processes with nothing but the database
        in common. Ends when the job is terminal and everything up to then was sent, the client goes away, or the
        server shuts down (the client reconnects with from_step).
        """
        if from_step < 0:
            raise InvalidArgument(f"must be >= 0, got {from_step}", field="from_step")
        job = self.get(account_id, job_id)
        yield WatchItem("job", job)
        last_metric = last_log = 0
        last_seen = (job.status, job.step, job.updated_at, job.cancel_requested)
        while True:
            with self.db.session() as s:
                job = s.get(Job, job_id)  # first: every row written before a terminal status is then visible below
                metrics = s.scalars(select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.id > last_metric,
                                                            JobMetric.step >= from_step).order_by(JobMetric.id)).all()
                logs = s.scalars(select(JobLog).where(JobLog.job_id == job_id, JobLog.id > last_log)
                                 .order_by(JobLog.id)).all()
            for m in metrics:
                last_metric = m.id
                yield WatchItem("metric", m)
            for entry in logs:
                last_log = entry.id
                yield WatchItem("log", entry)
            seen = (job.status, job.step, job.updated_at, job.cancel_requested)
            if seen != last_seen:
                last_seen = seen
                yield WatchItem("job", job)
            if job.status in TERMINAL and not metrics and not logs:
                return
            if not is_active() or self.stopping.wait(self.poll_s):
                if self.stopping.is_set():
                    raise Unavailable("the scheduler is shutting down; watch again to continue")
                return
