"""API keys and the caller's account.

A key is shown once at creation ("ty_" + 43 url-safe characters); the database keeps only its sha256, so a leaked
database does not leak usable keys. The interceptor authenticates every call and stores the Caller in a context
variable for the duration of the RPC; cores take the account id from it.

Job-scoped keys. When a worker starts a job it gets a key of the job's account scoped to that job (api_keys.job_id),
for the job's background work (its rollout and weight-sync calls); it is revoked when the attempt ends (finished,
handed back, or reaped). Such a key may only read the job's inputs (the job, its dataset, its base model, its
checkpoints), write and read the job's weights (weight lineages named after the job: "<job id>" or
"<job id>/<anything>"), sample the job's own deployments (a deployment of one of those lineages or of one of the
job's checkpoints), and create and delete a deployment of one of its lineages (an RFT job's rollout).
`KeyAuthenticator.authorize` checks every call of such a key against JOB_SCOPE before it runs; any other method, or
another object, is PERMISSION_DENIED.
"""
from __future__ import annotations

import contextvars
import hashlib
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update

from services.common import registry
from services.common.db import Database
from services.common.errors import AlreadyExists, InvalidArgument, PermissionDenied, Unauthenticated
from services.common.schema import Account, ApiKey, Checkpoint, Deployment, Job, WeightVersion, new_id, utcnow

KEY_PREFIX = "ty_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")  # whole names only (fullmatch: no trailing newline)


@dataclass(frozen=True)
class Caller:
    account_id: str
    account_name: str
    key_id: str
    # The raw key, so a service can call another service on the caller's behalf (e.g. scheduler -> rollout).
    api_key: str
    # A job-scoped key's job ("" for an account's ordinary keys).
    job_id: str = ""


_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("trainyard_caller", default=None)


def current_caller() -> Caller:
    caller = _caller.get()
    if caller is None:
        raise Unauthenticated("no authenticated caller for this call")
    return caller


def set_caller(caller: Caller | None) -> contextvars.Token:
    return _caller.set(caller)


def reset_caller(token: contextvars.Token) -> None:
    _caller.reset(token)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_from_metadata(metadata: tuple | list | None) -> str | None:
    for k, v in metadata or ():
        if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
            return v[7:].strip()
        if k == "x-api-key" and isinstance(v, str):
            return v.strip()
    return None


class KeyAuthenticator:
    def __init__(self, db: Database):
        self.db = db

    def authenticate(self, key: str | None) -> Caller:
        if not key:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>' in the call metadata")
        with self.db.session() as s:
            row = s.execute(
                select(ApiKey, Account).join(Account, Account.id == ApiKey.account_id)
                .where(ApiKey.key_hash == hash_key(key))
            ).first()
            if row is None or row.ApiKey.revoked_at is not None:
                raise Unauthenticated("invalid or revoked API key")
            return Caller(account_id=row.Account.id, account_name=row.Account.name, key_id=row.ApiKey.id, api_key=key,
                          job_id=row.ApiKey.job_id or "")

    def account_key(self, key: str | None) -> Caller:
        """authenticate, for surfaces a job-scoped key may not use at all (the OpenAI-compatible HTTP API)."""
        caller = self.authenticate(key)
        if caller.job_id:
            raise Unauthenticated(f"this API key is scoped to job {caller.job_id}; it only works on that job's calls")
        return caller

    def authorize(self, caller: Caller, method: str, request) -> None:
        """PERMISSION_DENIED unless the call is one a job-scoped key may make on its own job's objects (any call of an
        ordinary key passes). method: the gRPC method path; request: the request message (each message of a
        client stream)."""
        if not caller.job_id:
            return
        check = JOB_SCOPE.get(method)
        if check is None:
            raise PermissionDenied(f"this API key is scoped to job {caller.job_id}; it cannot call {method}")
        with self.db.session() as s:
            job = s.get(Job, caller.job_id)
            if job is None or not check(s, job, request):
                raise PermissionDenied(f"this API key is scoped to job {caller.job_id}; {method} on this object is "
                                       "outside that job")


def create_account(db: Database, name: str, key_name: str = "default") -> tuple[Account, ApiKey, str]:
    """Operator bootstrap (``trainyard admin create-account``): a new account and its first API key."""
    if not NAME_RE.fullmatch(name):
        raise InvalidArgument("use 1-128 letters, digits, '_', '.', '@' or '-', starting with a letter or digit",
                              field="name")
    with db.session() as s:
        if s.scalar(select(Account).where(Account.name == name)) is not None:
            raise AlreadyExists(f"account '{name}' already exists")
        account = Account(id=new_id("acct"), name=name, created_at=utcnow())
        s.add(account)
        s.flush()
        key, secret = _new_key(account.id, key_name)
        s.add(key)
    return account, key, secret


def issue_key(db: Database, account_id: str, name: str) -> tuple[ApiKey, str]:
    with db.session() as s:
        key, secret = _new_key(account_id, name)
        s.add(key)
    return key, secret


def _new_key(account_id: str, name: str, job_id: str | None = None) -> tuple[ApiKey, str]:
    secret = generate_key()
    key = ApiKey(id=new_id("key"), account_id=account_id, name=name, prefix=secret[:10],
                 key_hash=hash_key(secret), created_at=utcnow(), job_id=job_id)
    return key, secret


def issue_job_key(s, job: Job) -> str:
    """A key scoped to the job (in the caller's transaction); its secret."""
    key, secret = _new_key(job.account_id, f"job {job.id} (attempt {job.attempts})", job_id=job.id)
    s.add(key)
    return secret


def revoke_job_keys(s, job_id: str) -> int:
    return s.execute(update(ApiKey).where(ApiKey.job_id == job_id, ApiKey.revoked_at.is_(None))
                     .values(revoked_at=utcnow())).rowcount


# -- what a job-scoped key may do ---------------------------------------------------------------------------------
def job_lineage(job: Job, lineage: str) -> bool:
    """Whether a weight lineage is the job's own: "<job id>" or "<job id>/..."."""
    return lineage == job.id or lineage.startswith(job.id + "/")


def _checkpoint_of_job(s, job: Job, checkpoint_id: str) -> bool:
    ckpt = s.get(Checkpoint, checkpoint_id) if checkpoint_id else None
    return ckpt is not None and ckpt.job_id == job.id


def _version_of_job(s, job: Job, version_id: str) -> bool:
    v = s.get(WeightVersion, version_id) if version_id else None
    return v is not None and v.account_id == job.account_id and job_lineage(job, v.lineage)


def _deployment_of_job(s, job: Job, name: str) -> bool:
    d = s.scalar(select(Deployment).where(Deployment.account_id == job.account_id, Deployment.name == name,
                                          Deployment.deleted_at.is_(None)))
    if d is None:
        return False
    return (d.lineage is not None and job_lineage(job, d.lineage)) or (
        d.checkpoint_id is not None and _checkpoint_of_job(s, job, d.checkpoint_id))


def _deployment_id_of_job(s, job: Job, deployment_id: str) -> bool:
    d = s.get(Deployment, deployment_id) if deployment_id else None
    return d is not None and d.account_id == job.account_id and d.deleted_at is None and _deployment_of_job(
        s, job, d.name)


def _deploys_job_checkpoint(s, job: Job, r) -> bool:
    """CreateDeployment of one of the job's checkpoints (by checkpoint_id), or of one of its weight lineages."""
    if r.lineage:
        return not r.job_id and not r.checkpoint_id and job_lineage(job, r.lineage)
    return not r.job_id and _checkpoint_of_job(s, job, r.checkpoint_id)


def _lineage_deployment_of_job(s, job: Job, ident: str, *, deleted: bool = False) -> bool:
    """A deployment (by id, or by name among the live ones) that follows one of the job's lineages; deleted: a
    deleted one counts too (the rollout unloads a deployment after the scheduler marked it deleted)."""
    d = s.get(Deployment, ident) if ident else None
    if d is None and ident:
        d = registry.find_deployment(s, job.account_id, ident)
    return d is not None and d.account_id == job.account_id and (deleted or d.deleted_at is None) and \
        d.lineage is not None and job_lineage(job, d.lineage)


def _repoints_to_job_checkpoint(s, job: Job, r) -> bool:
    """RepointDeployment of a deployment that serves one of the job's checkpoints, to another of them."""
    d = registry.find_deployment(s, job.account_id, r.id) if r.id else None
    return d is not None and d.checkpoint_id is not None and _checkpoint_of_job(s, job, d.checkpoint_id) and \
        _checkpoint_of_job(s, job, r.checkpoint_id)


def _publish(s, job: Job, request) -> bool:
    return request.WhichOneof("part") != "header" or job_lineage(job, request.header.lineage)


_V1 = "/trainyard.v1."
JOB_SCOPE = {
    _V1 + "JobService/GetJob": lambda s, job, r: r.id == job.id,
    _V1 + "JobService/WatchJob": lambda s, job, r: r.id == job.id,
    _V1 + "JobService/ListJobMetrics": lambda s, job, r: r.id == job.id,
    _V1 + "JobService/ListJobLogs": lambda s, job, r: r.id == job.id,
    _V1 + "DatasetService/GetDataset": lambda s, job, r: r.id == job.dataset_id,
    _V1 + "DatasetService/PreviewDataset": lambda s, job, r: r.id == job.dataset_id,
    _V1 + "ModelService/GetModel": lambda s, job, r: r.name == job.base_model,
    _V1 + "CheckpointService/ListCheckpoints": lambda s, job, r: r.job_id == job.id,
    _V1 + "CheckpointService/GetCheckpoint": lambda s, job, r: _checkpoint_of_job(s, job, r.id),
    _V1 + "CheckpointService/DownloadCheckpoint": lambda s, job, r: _checkpoint_of_job(s, job, r.id),
    _V1 + "WeightSyncService/PublishVersion": _publish,
    _V1 + "WeightSyncService/GetVersion": lambda s, job, r: _version_of_job(s, job, r.id),
    _V1 + "WeightSyncService/FetchVersion": lambda s, job, r: _version_of_job(s, job, r.id) and (
        not r.base_version_id or _version_of_job(s, job, r.base_version_id)),
    _V1 + "WeightSyncService/ListVersions": lambda s, job, r: job_lineage(job, r.lineage),
    _V1 + "WeightSyncService/GetLineage": lambda s, job, r: job_lineage(job, r.lineage),
    _V1 + "WeightSyncService/WatchLineage": lambda s, job, r: job_lineage(job, r.lineage),
    _V1 + "RolloutService/Sample": lambda s, job, r: _deployment_of_job(s, job, r.model),
    _V1 + "RolloutService/SampleStream": lambda s, job, r: _deployment_of_job(s, job, r.model),
    # A loop job deploys its best checkpoint (services/worker/recipes/loop.py): it creates a deployment of one of
    # its checkpoints and re-points it to others, and the rollout loads it on its behalf.
    _V1 + "DeploymentService/CreateDeployment": _deploys_job_checkpoint,
    _V1 + "DeploymentService/RepointDeployment": _repoints_to_job_checkpoint,
    _V1 + "RolloutService/LoadDeployment": lambda s, job, r: _deployment_id_of_job(s, job, r.deployment_id),
    # An RFT job samples through a deployment of its lineage (services/trainer/rl/rollout_service.py) and deletes it
    # when it ends; the scheduler then unloads it from the rollout on the job's behalf.
    _V1 + "DeploymentService/DeleteDeployment": lambda s, job, r: _lineage_deployment_of_job(s, job, r.id),
    _V1 + "RolloutService/UnloadDeployment": lambda s, job, r: _lineage_deployment_of_job(
        s, job, r.deployment_id, deleted=True),
}
