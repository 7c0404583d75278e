"""Checkpoints as their owner and readers see them: listing, reading, deleting, expiry and publishing.

Who may do what (services/common/registry.py): the owner reads and changes its checkpoints; another account reads a
published one (GetCheckpoint, DownloadCheckpoint, and elsewhere a session's from_state / LoadState and sampling its
weight version) and changes nothing; an expired checkpoint is no one's (NOT_FOUND) until the sweep removes it.

Deleting removes the row, then the blobs no other row names (under the blob store's exclusive lock, so a save in
flight that reuses one keeps it). A checkpoint still in use is not deleted: a live deployment serving it, an open
session whose recorded state it is (a restarted trainer restores the session from it), or a job not finished whose
configuration names it -- FAILED_PRECONDITION naming the user. The sweep (`sweep_expired`, every reaper interval)
deletes expired checkpoints the same way and leaves those in use for a later pass (they stay unreadable meanwhile).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

from sqlalchemy import String, cast, func, select, update

from services.common import blobrefs, registry
from services.common.blobstore import CHUNK, BlobStore
from services.common.db import Database
from services.common.ledger import TERMINAL
from services.common.errors import FailedPrecondition, InvalidArgument, not_found
from services.common.schema import Checkpoint, Deployment, Job, TrainingSession, utcnow

log = logging.getLogger("trainyard.scheduler.checkpoints")

MAX_PAGE = 1000


class CheckpointCore:
    def __init__(self, db: Database, blobs: BlobStore):
        self.db, self.blobs = db, blobs

    def list(self, account_id: str, job_id: str = "", session_id: str = "", limit: int = 0, offset: int = 0,
             weight_version_id: str = "") -> tuple[list[Checkpoint], int]:
        """(the page, how many match). limit 0: all of them oldest first; otherwise newest first from offset."""
        if not 0 <= limit <= MAX_PAGE:
            raise InvalidArgument(f"must be between 0 and {MAX_PAGE}", field="limit")
        if offset < 0:
            raise InvalidArgument("must not be negative", field="offset")
        now = utcnow()
        where = [Checkpoint.account_id == account_id, (Checkpoint.expires_at.is_(None)) | (Checkpoint.expires_at > now)]
        with self.db.session() as s:
            if job_id:
                job = s.get(Job, job_id)
                if job is None or job.account_id != account_id:
                    raise not_found("job", job_id)
                where.append(Checkpoint.job_id == job_id)
            if session_id:
                sess = s.get(TrainingSession, session_id)
                if sess is None or sess.account_id != account_id:
                    raise not_found("session", session_id)
                where.append(Checkpoint.session_id == session_id)
            if weight_version_id:
                where.append(Checkpoint.weight_version_id == weight_version_id)
            total = s.scalar(select(func.count()).select_from(Checkpoint).where(*where))
            q = select(Checkpoint).where(*where)
            if limit:
                q = q.order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc()).limit(limit).offset(offset)
            else:
                q = q.order_by(Checkpoint.created_at, Checkpoint.step)
            return list(s.scalars(q)), total

    def get(self, account_id: str, checkpoint_id: str) -> Checkpoint:
        """The account's own checkpoint or a published one."""
        with self.db.session() as s:
            return registry.readable_checkpoint(s, account_id, checkpoint_id)

    def lora_rank(self, ckpt: Checkpoint) -> int:
        """The LoRA rank of a Training API session's adapter checkpoint (0 otherwise)."""
        if not ckpt.session_id or ckpt.kind != "lora_adapter":
            return 0
        with self.db.session() as s:
            return s.scalar(select(TrainingSession.lora_rank).where(TrainingSession.id == ckpt.session_id)) or 0

    def chunks(self, account_id: str, checkpoint_id: str) -> Iterator[tuple[dict, int, bytes]]:
        """(file entry, offset, bytes) for every file of the checkpoint, in manifest order; DataLoss after the last
        chunk of a file whose bytes are not the ones its manifest names."""
        ckpt = self.get(account_id, checkpoint_id)
        for f in ckpt.files:
            offset = 0
            # Verified against the manifest as it streams: damaged bytes end the stream with DataLoss.
            for chunk in self.blobs.read_verified(f["sha256"], f"checkpoint {ckpt.id} file {f['path']}",
                                                  size=f["size_bytes"], chunk_size=CHUNK):
                yield f, offset, chunk
                offset += len(chunk)

    def set_ttl(self, account_id: str, checkpoint_id: str, ttl_seconds: int | None) -> Checkpoint:
        registry.check_ttl(ttl_seconds, "ttl_seconds")
        with self.db.session() as s:
            ckpt = registry.get_checkpoint(s, account_id, checkpoint_id)
            ckpt.expires_at = None if ttl_seconds is None else utcnow() + timedelta(seconds=ttl_seconds)
            return ckpt

    def set_public(self, account_id: str, checkpoint_id: str, public: bool) -> Checkpoint:
        with self.db.session() as s:
            ckpt = registry.get_checkpoint(s, account_id, checkpoint_id)
            ckpt.public = public
            return ckpt

    def delete(self, account_id: str, checkpoint_id: str) -> Checkpoint:
        with self.db.session() as s:
            ckpt = registry.get_checkpoint(s, account_id, checkpoint_id, expired_ok=True)
            user = _user(s, ckpt)
            if user:
                raise FailedPrecondition(f"checkpoint '{ckpt.id}' is in use by {user}; end that first")
            _forget_in_deleted_deployments(s, ckpt)
            s.delete(ckpt)
        self._release(ckpt)
        return ckpt

    def sweep_expired(self) -> int:
        """Delete every expired checkpoint not in use; how many went."""
        removed = []
        with self.db.session() as s:
            for ckpt in s.scalars(select(Checkpoint).where(Checkpoint.expires_at <= utcnow())):
                user = _user(s, ckpt)
                if user:
                    log.info("expired checkpoint %s stays while %s uses it", ckpt.id, user)
                    continue
                _forget_in_deleted_deployments(s, ckpt)
                s.delete(ckpt)
                removed.append(ckpt)
        for ckpt in removed:
            self._release(ckpt)
        return len(removed)

    def _release(self, ckpt: Checkpoint) -> None:
        self.blobs.release({f["sha256"] for f in [*ckpt.files, *(ckpt.state or [])]}, blobrefs.checker(self.db))


def _forget_in_deleted_deployments(s, ckpt: Checkpoint) -> None:
    """Deleted deployments are kept as history and may still name the checkpoint (a foreign key): they stop naming
    it when it goes. (Live ones refuse the deletion: _user.)"""
    s.execute(update(Deployment).where(Deployment.checkpoint_id == ckpt.id, Deployment.deleted_at.is_not(None))
              .values(checkpoint_id=None))


def _user(s, ckpt: Checkpoint) -> str:
    """What still needs the checkpoint ("deployment 'x'", "session sess_y", "job job_z"), or ""."""
    dep = s.scalar(select(Deployment).where(Deployment.checkpoint_id == ckpt.id, Deployment.deleted_at.is_(None)))
    if dep is not None:
        return f"deployment '{dep.name}'"
    sess = s.scalar(select(TrainingSession).where(TrainingSession.state_checkpoint_id == ckpt.id,
                                                  TrainingSession.closed_at.is_(None)))
    if sess is not None:  # another account's session (started from the published checkpoint) stays unnamed
        who = f"session {sess.id}" if sess.account_id == ckpt.account_id else "a session of another account"
        return f"open {who} (its recorded state; it needs the checkpoint until it saves a state of its own)"
    job = s.scalar(select(Job.id).where(Job.status.not_in(TERMINAL), cast(Job.config, String).contains(ckpt.id)))
    if job is not None:
        return f"job {job}"
    return ""
