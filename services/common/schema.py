"""Database tables (SQLAlchemy 2). Alembic migrations in services/common/migrations must match these.

Every user-owned row carries account_id; queries in the cores always filter on it, so another account's object is
simply "not found". Blobs (dataset files, checkpoint files) live in the object store; rows hold their sha256.
"""
from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True)}


class Account(Base):
    __tablename__ = "accounts"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    # A job-scoped key (services/common/auth.py, "Job-scoped keys"): issued to the worker running the job, good only
    # for that job's inputs, outputs, weights and deployment, and revoked when the job's attempt ends.
    job_id: Mapped[str | None] = mapped_column(String(32), index=True, default=None)


SHARED_SCOPE = "shared"


class Model(Base):
    """A registered base model directory. scope is an account id, or "shared" for models every account sees."""

    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("scope", "name", name="uq_models_scope_name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    scope: Mapped[str] = mapped_column(String(32), index=True)
    name: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(Text)
    architecture: Mapped[str] = mapped_column(String(64))
    num_parameters: Mapped[int] = mapped_column(BigInteger)
    num_layers: Mapped[int] = mapped_column(Integer)
    hidden_size: Mapped[int] = mapped_column(Integer)
    vocab_size: Mapped[int] = mapped_column(Integer)
    max_position_embeddings: Mapped[int] = mapped_column(Integer)
    torch_dtype: Mapped[str] = mapped_column(String(16), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Dataset(Base):
    __tablename__ = "datasets"
    __table_args__ = (
        # One live dataset per content and format per account (de-duplication); deleted rows do not count.
        Index("uq_datasets_account_sha_format", "account_id", "sha256", "format", unique=True,
              postgresql_where=text("deleted_at IS NULL"), sqlite_where=text("deleted_at IS NULL")),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    filename: Mapped[str] = mapped_column(String(512), default="")
    format: Mapped[str] = mapped_column(String(32))
    num_rows: Mapped[int] = mapped_column(BigInteger)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    display_name: Mapped[str] = mapped_column(String(256), default="")
    method: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(String(128))
    model_path: Mapped[str] = mapped_column(Text)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    # The full, defaults-filled configuration the worker runs (JSON of the method's config).
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str] = mapped_column(Text, default="")
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    total_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Lease: the worker running the job and when it last proved it is alive.
    worker_id: Mapped[str] = mapped_column(String(128), default="")
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    # When the job's current attempt was handed to the broker (None: not yet, e.g. the scheduler stopped in between).
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    output_checkpoint_id: Mapped[str] = mapped_column(String(32), default="")
    latest_metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Resources (services/common/resources.py): the devices the job asks for on one worker, its queue priority
    # (higher first) and, while it waits, why (a quota, free devices); "" once started.
    trainer_devices: Mapped[int] = mapped_column(Integer, default=1)
    rollout_devices: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    wait_reason: Mapped[str] = mapped_column(Text, default="")


class Device(Base):
    """One device of a worker machine's inventory (a GPU, or a CPU slot on a machine without GPUs), registered by
    its workers at start and kept alive by their heartbeats; job_id is the job holding it (None: free)."""

    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("host", "kind", "index", name="uq_devices_host_kind_index"),)
    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # "<host>/<kind><index>"
    host: Mapped[str] = mapped_column(String(160), index=True)
    kind: Mapped[str] = mapped_column(String(8))  # "gpu" | "cpu"
    index: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(128), default="")
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    job_id: Mapped[str | None] = mapped_column(String(32), index=True, default=None)
    role: Mapped[str] = mapped_column(String(16), default="")  # "trainer" | "rollout" while held
    account_id: Mapped[str | None] = mapped_column(String(32), index=True, default=None)  # the holding job's
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)


class AccountQuota(Base):
    """An operator's limits for one account (`trainyard admin set-quota`); None: the worker/scheduler default."""

    __tablename__ = "account_quotas"
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), primary_key=True)
    max_devices: Mapped[int | None] = mapped_column(Integer, default=None)
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer, default=None)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobMetric(Base):
    __tablename__ = "job_metrics"
    __table_args__ = (Index("ix_job_metrics_job_step", "job_id", "step"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobLog(Base):
    __tablename__ = "job_logs"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    level: Mapped[str] = mapped_column(String(16), default="info")
    message: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    """Files of one saved model state. files: the user-facing artifact (PEFT adapter); state: what resuming needs
    (optimizer, scheduler, RNG, data position). Each is a list of {path, sha256, size_bytes} in the object store."""

    __tablename__ = "checkpoints"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True, default=None)
    session_id: Mapped[str | None] = mapped_column(String(32), index=True, default=None)
    name: Mapped[str] = mapped_column(String(256), default="")
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    kind: Mapped[str] = mapped_column(String(16), default="lora_adapter")
    base_model: Mapped[str] = mapped_column(String(128))
    model_path: Mapped[str] = mapped_column(Text, default="")
    files: Mapped[list[Any]] = mapped_column(default=list)
    state: Mapped[list[Any]] = mapped_column(default=list)
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # A SaveWeights checkpoint: the weight version it published ("" for a training state or a job's checkpoint).
    weight_version_id: Mapped[str] = mapped_column(String(32), default="", index=True)
    # Readable (never writable) by every account while set (services/common/registry.py, readable_checkpoint).
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Unreadable from then on; the scheduler's sweep deletes it (services/scheduler/checkpoints.py).
    expires_at: Mapped[datetime | None] = mapped_column(default=None, index=True)


class Deployment(Base):
    __tablename__ = "deployments"
    __table_args__ = (
        Index("uq_deployments_account_name", "account_id", "name", unique=True,
              postgresql_where=text("deleted_at IS NULL"), sqlite_where=text("deleted_at IS NULL")),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    # What is served: a fixed checkpoint, or (lineage set, checkpoint_id None) the current version of a weight
    # lineage, hot-loaded as new versions are published.
    checkpoint_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"), default=None)
    lineage: Mapped[str | None] = mapped_column(String(128), default=None)
    base_model: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="deploying")
    error: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class TrainingSession(Base):
    __tablename__ = "training_sessions"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(128))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[Any]] = mapped_column(default=list)
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    # Full-parameter sessions train a copy of the base (lora_rank and lora_alpha are 0).
    full_parameter: Mapped[bool] = mapped_column(Boolean, default=False)
    # The SaveState path ("trainyard://state/<checkpoint id>") the session started from, or "".
    from_state: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(default=None)
    # The session's recorded state, which a restarted trainer restores it from (services/trainer/sessions.py): a
    # checkpoint holding the engine's state (None: the session as created -- a new adapter from its seed, or its
    # from_state), whether that checkpoint's optimizer state is part of it (False only for a from_state session
    # created without the optimizer and not recorded since), and the seq_id the session expects next from there.
    # state_next_seq_id 0 marks sessions a trainer held before states were recorded (revision 0005): not restored.
    state_checkpoint_id: Mapped[str | None] = mapped_column(String(32), default=None)
    state_with_optimizer: Mapped[bool] = mapped_column(Boolean, default=True)
    state_next_seq_id: Mapped[int] = mapped_column(BigInteger, default=1)
    # When the session last received a call (written at most once a minute per session; None before revision 0010).
    last_request_at: Mapped[datetime | None] = mapped_column(default=None)


class WeightVersion(Base):
    __tablename__ = "weight_versions"
    __table_args__ = (UniqueConstraint("account_id", "lineage", "version", name="uq_weight_versions_lineage_version"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    lineage: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(BigInteger)
    parent_id: Mapped[str] = mapped_column(String(32), default="")
    kind: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(String(128), default="")
    files: Mapped[list[Any]] = mapped_column(default=list)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # For sampling only (services/weightsync/store.py, "Ephemeral versions"): deleted once newer ephemeral versions
    # replace it, or its session closes; then deleted_at is set and files emptied (the row names it as replaced).
    ephemeral: Mapped[bool] = mapped_column(default=False)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class WeightLineage(Base):
    """A chain of weight versions (e.g. one Training API session) and the version consumers should serve now:
    the newest by default, an older retained one after a rollback."""

    __tablename__ = "weight_lineages"
    __table_args__ = (UniqueConstraint("account_id", "lineage", name="uq_weight_lineages_account_lineage"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    lineage: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(String(128), default="")
    current_version_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class WeightDelta(Base):
    """An encoded delta between two full-weight versions (services/weightsync/codec.py), computed on first request
    and kept in the object store."""

    __tablename__ = "weight_deltas"
    __table_args__ = (UniqueConstraint("base_version_id", "version_id", name="uq_weight_deltas_pair"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    base_version_id: Mapped[str] = mapped_column(ForeignKey("weight_versions.id"))
    version_id: Mapped[str] = mapped_column(ForeignKey("weight_versions.id"), index=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Evaluator(Base):
    """One version of an uploaded evaluator (services/evaluators/): a reward function or a multi-turn environment.
    Uploading a name the account already has adds version n+1; the bytes (evaluator.py, or a .zip / .tar.gz package)
    are one blob in the object store, verified against sha256 whenever they are read."""

    __tablename__ = "evaluators"
    __table_args__ = (UniqueConstraint("account_id", "name", "version", name="uq_evaluators_account_name_version"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # "reward_fn" | "environment"
    filename: Mapped[str] = mapped_column(String(256), default="")
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
