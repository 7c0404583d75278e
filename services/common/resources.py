"""Resources: the device inventory of the worker machines, what a job asks for, the queue's order, the per-account
quotas and the allocation of devices to a starting job (docs/resources.md).

Inventory. Each worker registers its machine's devices when it starts (`register`): the GPUs torch sees (their
names and memory), or WorkerSettings.cpu_slots CPU slots on a machine without GPUs. A machine is its worker_host;
several worker processes of one machine share its devices. Their heartbeats keep the machine live; a machine silent
for the scheduler's worker_lost_after_s takes no new jobs and does not count when a request is checked.

Requests. A job holds trainer devices (training) and rollout devices (sampling) on one machine. Unset, they are the
method's defaults (trainyard.methods.Method: SFT 1 + 0). CreateJob refuses a request the largest live machine
cannot hold (INVALID_ARGUMENT naming spec.resources.<field>).

Queue order. Queued jobs go by priority (higher first, -10..10), then fairness between accounts (the account holding
fewer devices now goes first), then age. A worker with free devices starts the first job in that order that it can
hold (`Allocation.claim_next`): a job whose account is at its device quota waits and lets the next one go; a job
that needs more devices than are free now, but that this machine could hold, makes the jobs behind it wait too (no
back-filling past it), so big jobs are not starved by small ones.

Quotas. max_devices (devices held at once by the account's running jobs) and max_queued_jobs (jobs queued at once),
per account from `account_quotas` (`trainyard admin set-quota`), else the settings max_devices_per_account and
max_queued_jobs_per_account (0: no limit). A job over the device quota waits, queued, with the reason in its
wait_reason and its log; CreateJob over the queued-jobs quota is refused (RESOURCE_EXHAUSTED).

Atomicity. Claims are serialized: on Postgres by a transaction-scoped advisory lock, with the machine's free device
rows taken FOR UPDATE SKIP LOCKED; on SQLite by its single writer (the first statement writes). So two workers never
take the same device or both pass one account's quota. Devices are released when the job ends (finish, a failed
attempt handed back, the reaper's requeue of a lost worker's job).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, func, select, text, update

from services.common.db import Database
from services.common.errors import InvalidArgument, Violation
from services.common.schema import AccountQuota, Account, Device, Job, JobLog, utcnow
from trainyard.methods import METHODS, PRIORITY_MAX, PRIORITY_MIN

_CLAIM_LOCK = 0x7472_6169_6E79  # the advisory lock key that serializes device claims on Postgres


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "gpu" | "cpu"
    index: int
    name: str
    memory_bytes: int = 0


def detect_devices(cpu_slots: int) -> list[DeviceInfo]:
    """This machine's GPUs as torch sees them (CUDA_VISIBLE_DEVICES applies), else cpu_slots CPU slots."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(DeviceInfo("gpu", i, props.name, int(props.total_memory)))
        return out
    return [DeviceInfo("cpu", i, f"cpu slot {i} of {os.cpu_count() or 1} cores") for i in range(cpu_slots)]


def device_id(host: str, kind: str, index: int) -> str:
    return f"{host}/{kind}{index}"


# -- inventory -------------------------------------------------------------------------------------------------
class Inventory:
    def __init__(self, db: Database):
        self.db = db

    def register(self, host: str, devices: list[DeviceInfo]) -> None:
        """The machine's devices as they are now: new ones added, known ones refreshed (a held device stays held),
        free ones that are gone removed."""
        now = utcnow()
        ids = {device_id(host, d.kind, d.index): d for d in devices}
        with self.db.session() as s:
            rows = {r.id: r for r in s.scalars(select(Device).where(Device.host == host).with_for_update())}
            for did, d in ids.items():
                row = rows.get(did)
                if row is None:
                    s.add(Device(id=did, host=host, kind=d.kind, index=d.index, name=d.name[:128],
                                 memory_bytes=d.memory_bytes, registered_at=now, heartbeat_at=now, role=""))
                else:
                    row.name, row.memory_bytes, row.heartbeat_at = d.name[:128], d.memory_bytes, now
            gone = [r.id for did, r in rows.items() if did not in ids and r.job_id is None]
            if gone:
                s.execute(delete(Device).where(Device.id.in_(gone)))

    def heartbeat(self, host: str) -> None:
        with self.db.session() as s:
            s.execute(update(Device).where(Device.host == host).values(heartbeat_at=utcnow()))

    def devices(self) -> list[Device]:
        with self.db.session() as s:
            return list(s.scalars(select(Device).order_by(Device.host, Device.kind, Device.index)))

    def largest(self, live_within_s: float) -> tuple[str, int] | None:
        """(host, device count) of the live machine with the most devices; None when no machine is live."""
        cutoff = utcnow() - timedelta(seconds=live_within_s)
        with self.db.session() as s:
            row = s.execute(select(Device.host, func.count()).where(Device.heartbeat_at >= cutoff)
                            .group_by(Device.host).order_by(func.count().desc(), Device.host).limit(1)).first()
        return (row[0], int(row[1])) if row else None


# -- requests --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResourceRequest:
    trainer_devices: int
    rollout_devices: int
    priority: int

    @property
    def devices(self) -> int:
        return self.trainer_devices + self.rollout_devices


def resolve_request(method: str, trainer_devices: int | None, rollout_devices: int | None,
                    priority: int) -> tuple[ResourceRequest, list[Violation]]:
    """The request with the method's defaults filled in, and every value that does not fit (naming its field)."""
    m = METHODS[method]
    t = m.trainer_devices if trainer_devices is None else trainer_devices
    r = m.rollout_devices if rollout_devices is None else rollout_devices
    problems = []
    if not 0 <= t <= 64:
        problems.append(Violation("spec.resources.trainer_devices", f"must be between 0 and 64, got {t}"))
    if not 0 <= r <= 64:
        problems.append(Violation("spec.resources.rollout_devices", f"must be between 0 and 64, got {r}"))
    if not problems and t + r == 0:
        problems.append(Violation("spec.resources.trainer_devices", "a job needs at least one device: trainer or "
                                                                    "rollout"))
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        problems.append(Violation("spec.priority", f"must be between {PRIORITY_MIN} and {PRIORITY_MAX}, "
                                                   f"got {priority}"))
    return ResourceRequest(t, r, priority), problems


def check_fits(req: ResourceRequest, largest: tuple[str, int] | None) -> None:
    """INVALID_ARGUMENT when no live machine can hold the request (nothing is checked while none is live)."""
    if largest is None or req.devices <= largest[1]:
        return
    field = "spec.resources.rollout_devices" if req.rollout_devices else "spec.resources.trainer_devices"
    raise InvalidArgument(f"the job asks for {req.trainer_devices} trainer + {req.rollout_devices} rollout devices "
                          f"on one worker; the largest worker ({largest[0]}) has {largest[1]}", field=field)


# -- quotas ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    max_devices: int  # 0 = no limit
    max_queued_jobs: int  # 0 = no limit


def account_limits(s, account_id: str, default_max_devices: int, default_max_queued_jobs: int) -> Limits:
    q = s.get(AccountQuota, account_id)
    return Limits(default_max_devices if q is None or q.max_devices is None else q.max_devices,
                  default_max_queued_jobs if q is None or q.max_queued_jobs is None else q.max_queued_jobs)


def set_quota(db: Database, account_name: str, *, max_devices: int | None, max_queued_jobs: int | None,
              clear: bool = False) -> AccountQuota:
    """An operator's per-account limits (None leaves one as it is; clear: back to the defaults)."""
    for field, value in (("max_devices", max_devices), ("max_queued_jobs", max_queued_jobs)):
        if value is not None and value < 0:
            raise InvalidArgument(f"must be >= 0 (0 = no limit), got {value}", field=field)
    with db.session() as s:
        account = s.scalar(select(Account).where(Account.name == account_name))
        if account is None:
            raise InvalidArgument(f"no account named '{account_name}'", field="account")
        row = s.get(AccountQuota, account.id)
        if row is None:
            row = AccountQuota(account_id=account.id)
            s.add(row)
        if clear:
            row.max_devices = row.max_queued_jobs = None
        if max_devices is not None:
            row.max_devices = max_devices
        if max_queued_jobs is not None:
            row.max_queued_jobs = max_queued_jobs
        row.updated_at = utcnow()
        s.flush()
        s.expunge(row)
        return row


def devices_held(s, account_id: str) -> int:
    return int(s.scalar(select(func.count()).select_from(Device).where(Device.account_id == account_id)) or 0)


# -- allocation ------------------------------------------------------------------------------------------------
def queue_order(jobs: list[Job], held: dict[str, int], last_start: dict[str, datetime] | None = None) -> list[Job]:
    """Queued jobs in the order they start: priority (higher first); then fairness between accounts -- the account
    holding fewer devices now, then the one whose last job started longest ago (never: first); then age. Each job
    placed counts for its account as held and just started, so accounts take turns."""
    pending = sorted(jobs, key=lambda j: (-j.priority, j.created_at, j.id))
    counted, started = dict(held), dict(last_start or {})
    out, turn = [], 0
    while pending:
        top = pending[0].priority
        same = [j for j in pending if j.priority == top]
        pick = min(same, key=lambda j: (counted.get(j.account_id, 0), started.get(j.account_id, _NEVER),
                                        j.created_at, j.id))
        out.append(pick)
        pending.remove(pick)
        counted[pick.account_id] = counted.get(pick.account_id, 0) + pick.trainer_devices + pick.rollout_devices
        turn += 1
        started[pick.account_id] = _LATER + timedelta(microseconds=turn)
    return out


def last_starts(s, account_ids: set[str]) -> dict[str, datetime]:
    """When each account's latest job started (accounts with none left out)."""
    if not account_ids:
        return {}
    rows = s.execute(select(Job.account_id, func.max(Job.started_at)).where(Job.account_id.in_(account_ids),
                                                                             Job.started_at.is_not(None))
                     .group_by(Job.account_id)).all()
    return {a: aware(t) for a, t in rows if t is not None}


def aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)  # SQLite returns naive UTC


_NEVER = datetime(1970, 1, 1, tzinfo=timezone.utc)
_LATER = datetime(9999, 1, 1, tzinfo=timezone.utc)  # placed in this pass: after every real start


def serialize_claims(s) -> None:
    """Make this transaction the only one allocating devices until it ends."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _CLAIM_LOCK})
    else:  # SQLite: the first write takes the database's single write lock for the rest of the transaction
        s.execute(update(Device).where(Device.id == "").values(role=""))


def free_devices(s, host: str) -> list[Device]:
    return list(s.scalars(select(Device).where(Device.host == host, Device.job_id.is_(None))
                          .order_by(Device.kind, Device.index).with_for_update(skip_locked=True)))


def note_wait(s, job: Job, reason: str) -> None:
    """Record why a queued job waits (its log gets a line when the reason changes)."""
    if job.wait_reason != reason:
        job.wait_reason = reason
        s.add(JobLog(job_id=job.id, level="info", message=f"waiting: {reason}", created_at=utcnow()))


def assign(s, job: Job, devices: list[Device]) -> list[Device]:
    """Give the first trainer_devices of devices to the job as trainer devices, the next as rollout devices."""
    taken = devices[:job.trainer_devices + job.rollout_devices]
    for i, d in enumerate(taken):
        d.job_id, d.account_id = job.id, job.account_id
        d.role = "trainer" if i < job.trainer_devices else "rollout"
    s.flush()
    return taken


def release(s, job_id: str) -> int:
    """Free every device the job holds; the number freed."""
    return s.execute(update(Device).where(Device.job_id == job_id)
                     .values(job_id=None, account_id=None, role="")).rowcount
