"""Deployments: a checkpoint (or the current version of a weight lineage, hot-loaded as it moves) served by the
rollout service under a name of the account's choosing.

Create: validate -> row (deploying) -> rollout.LoadDeployment on the caller's behalf -> ready | failed.
Re-point (a loop job's best checkpoint so far, docs/loop.md): the live checkpoint deployment of that name, same id
and name, switched to another checkpoint of its base model: the row switches in one update (each Sample resolves the
row once, so a request is served wholly by the old checkpoint or wholly by the new one), then rollout.LoadDeployment
loads the new checkpoint (requests arriving before it is in load it on first use) and unloads the old one once the
requests running on it finish. A load that fails switches the row back.
Delete: row marked deleted first (the rollout re-checks the row on every Sample, so a deleted deployment is never
served even if the unload call below does not reach the rollout), then rollout.UnloadDeployment.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from services.common import registry
from services.common.db import Database
from services.common.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    not_found,
)
from services.common.quotas import check_quota
from services.common.methods.evaluate import RESULT_KIND
from services.common.schema import Account, Checkpoint, Deployment, Job, WeightLineage, new_id, utcnow

log = logging.getLogger("trainyard.deployments")
NAME_RE = registry.DEPLOYMENT_NAME_RE

# The rollout's refusals keep their meaning (DATA_LOSS: the deployment's stored files failed verification);
# anything else (unreachable, internal) is reported as unavailable.
ROLLOUT_ERRORS = {grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition, grpc.StatusCode.NOT_FOUND: NotFound,
                  grpc.StatusCode.INVALID_ARGUMENT: FailedPrecondition, grpc.StatusCode.DATA_LOSS: DataLoss}

# (api_key, deployment_id) -> None; raises grpc.RpcError when the rollout refuses or cannot be reached.
LoadFn = Callable[[str, str], None]


class DeploymentCore:
    def __init__(self, db: Database, load: LoadFn, unload: LoadFn, max_per_account: int = 32):
        self.db = db
        self.load = load
        self.unload = unload
        self.max_per_account = max_per_account

    def create(self, account_id: str, api_key: str, name: str, checkpoint_id: str, job_id: str,
               lineage: str = "") -> Deployment:
        if not NAME_RE.fullmatch(name or ""):
            raise InvalidArgument("use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
                                  field="name")
        if sum(map(bool, (checkpoint_id, job_id, lineage))) != 1:
            raise InvalidArgument("give exactly one of checkpoint_id, job_id and lineage", field="checkpoint_id")
        with self.db.session() as s:
            s.get(Account, account_id, with_for_update=True)  # one account's creates count one at a time
            live = s.scalar(select(func.count()).select_from(Deployment).where(
                Deployment.account_id == account_id, Deployment.deleted_at.is_(None),
                Deployment.status.in_(("deploying", "ready"))))
            check_quota("max_deployments_per_account", self.max_per_account, live,
                        "the account has that many live deployments; delete one first")
            if lineage:
                followed = s.scalar(select(WeightLineage).where(WeightLineage.account_id == account_id,
                                                                WeightLineage.lineage == lineage))
                if followed is None:
                    raise not_found("lineage", lineage)
                source = {"lineage": lineage, "checkpoint_id": None, "base_model": followed.base_model}
            else:
                ckpt = self._resolve_checkpoint(s, account_id, checkpoint_id, job_id)
                source = {"checkpoint_id": ckpt.id, "base_model": ckpt.base_model}
            existing = registry.find_deployment(s, account_id, name)
            if existing is not None and existing.status == "failed":
                existing.status, existing.deleted_at = "deleted", utcnow()  # a failed attempt frees its name
                s.flush()
            elif existing is not None:
                raise AlreadyExists(f"a deployment named '{name}' already exists; delete it or choose another name")
            dep = Deployment(id=new_id("dep"), account_id=account_id, name=name, status="deploying",
                             created_at=utcnow(), updated_at=utcnow(), **source)
            s.add(dep)
            try:
                s.flush()
            except IntegrityError:
                raise AlreadyExists(f"a deployment named '{name}' already exists") from None
        try:
            self.load(api_key, dep.id)
        except grpc.RpcError as exc:
            error = f"the rollout service could not load it: {exc.details()}"
            self._set(dep.id, status="failed", error=error)
            raise ROLLOUT_ERRORS.get(exc.code(), Unavailable)(f"deployment '{name}' failed: {error}") from None
        with self.db.session() as s:
            dep = s.get(Deployment, dep.id, with_for_update=True)
            if dep.deleted_at is None:
                dep.status, dep.error, dep.updated_at = "ready", "", utcnow()
                return dep
        self._unload_quietly(api_key, dep.id)  # deleted while it was loading: do not leave it loaded
        return dep

    def repoint(self, account_id: str, api_key: str, name: str, checkpoint_id: str) -> Deployment:
        """Serve another checkpoint under a live checkpoint deployment (its id and name kept); see the module
        docstring. FailedPrecondition for a lineage deployment, one not ready, or a checkpoint of another model."""
        with self.db.session() as s:
            found = registry.find_deployment(s, account_id, name) if name else None
            if found is None:
                raise not_found("deployment", name)
            dep = s.get(Deployment, found.id, with_for_update=True)  # one re-point of a deployment at a time
            if dep.lineage or dep.status != "ready":
                what = "a lineage deployment" if dep.lineage else dep.status
                raise FailedPrecondition(f"deployment '{dep.name}' is {what}; only a ready checkpoint deployment can "
                                         "be re-pointed")
            ckpt = self._resolve_checkpoint(s, account_id, checkpoint_id, "")
            if ckpt.base_model != dep.base_model:
                raise FailedPrecondition(f"checkpoint '{ckpt.id}' is of model '{ckpt.base_model}'; deployment "
                                         f"'{dep.name}' serves '{dep.base_model}'")
            old = dep.checkpoint_id
            if old == ckpt.id:
                return dep
            dep.checkpoint_id, dep.updated_at = ckpt.id, utcnow()
        try:
            self.load(api_key, dep.id)
        except grpc.RpcError as exc:
            with self.db.session() as s:
                row = s.get(Deployment, dep.id, with_for_update=True)
                if row.checkpoint_id == ckpt.id and row.deleted_at is None:
                    row.checkpoint_id, row.updated_at = old, utcnow()
            raise ROLLOUT_ERRORS.get(exc.code(), Unavailable)(
                f"deployment '{dep.name}' still serves {old}: the rollout service could not load {ckpt.id}: "
                f"{exc.details()}") from None
        log.info("deployment %s (%s) re-pointed from %s to %s", dep.id, dep.name, old, ckpt.id)
        return self.get(account_id, dep.id)

    def _resolve_checkpoint(self, s, account_id: str, checkpoint_id: str, job_id: str) -> Checkpoint:
        if job_id:
            job = s.get(Job, job_id)
            if job is None or job.account_id != account_id:
                raise not_found("job", job_id)
            if job.status != "succeeded" or not job.output_checkpoint_id:
                raise FailedPrecondition(f"job '{job_id}' is {job.status}; only a succeeded job can be deployed "
                                         "(or deploy one of its checkpoints by checkpoint_id)")
            checkpoint_id = job.output_checkpoint_id
        ckpt = registry.get_checkpoint(s, account_id, checkpoint_id)
        if ckpt.kind == RESULT_KIND:
            raise FailedPrecondition(f"checkpoint '{ckpt.id}' holds an evaluation's results, not weights; deploy the "
                                     "checkpoint it evaluated")
        return ckpt

    def _set(self, dep_id: str, **fields) -> Deployment:
        with self.db.session() as s:
            dep = s.get(Deployment, dep_id)
            for k, v in fields.items():
                setattr(dep, k, v)
            dep.updated_at = utcnow()
            return dep

    def get(self, account_id: str, ident: str) -> Deployment:
        with self.db.session() as s:
            dep = registry.find_deployment(s, account_id, ident) if ident else None
            if dep is None:
                raise not_found("deployment", ident)
            return dep

    def list(self, account_id: str, include_deleted: bool) -> list[Deployment]:
        q = select(Deployment).where(Deployment.account_id == account_id)
        if not include_deleted:
            q = q.where(Deployment.deleted_at.is_(None))
        with self.db.session() as s:
            return list(s.scalars(q.order_by(Deployment.created_at.desc())))

    def job_of(self, dep: Deployment) -> str:
        if dep.checkpoint_id is None:
            return ""
        with self.db.session() as s:
            return s.scalar(select(Checkpoint.job_id).where(Checkpoint.id == dep.checkpoint_id)) or ""

    def delete(self, account_id: str, api_key: str, ident: str) -> Deployment:
        dep = self.get(account_id, ident)
        dep = self._set(dep.id, status="deleted", deleted_at=utcnow())
        self._unload_quietly(api_key, dep.id)
        return dep

    def _unload_quietly(self, api_key: str, dep_id: str) -> None:
        try:
            self.unload(api_key, dep_id)
        except grpc.RpcError as exc:  # the row is already deleted, so the rollout will not serve it anyway
            log.warning("rollout did not unload %s: %s", dep_id, exc.details())
