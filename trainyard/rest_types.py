"""Tinker's REST types (runs, checkpoints, sessions), with Tinker 0.38's fields, each built from the Trainyard message
in ONE function: trainyard.RestClient and the HTTP gateway (services/gateway/rest_routes.py) both answer through them,
so a field means the same over gRPC and over Tinker's wire. Exported by trainyard.types.

A training run is a Training API session (trainer.proto's Session); a checkpoint is a row of the scheduler's
CheckpointService. The `tinker_path` of a checkpoint is the caller's: "trainyard://state/<checkpoint id>" or
"trainyard://weights/<version id>" for the SDK (`checkpoint_path`), the gateway's "tinker://..." form for the gateway.
"""
from __future__ import annotations

import datetime as _dt
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainyard.v1 import scheduler_pb2, trainer_pb2

__all__ = [
    "Checkpoint", "CheckpointType", "CheckpointsListResponse", "Cursor", "ExternalWeightsUrlsResponse",
    "GetSessionResponse", "ListSessionsResponse", "ModelID", "TrainingRun", "TrainingRunsResponse",
    "WeightsInfoResponse", "WhoamiResponse", "checkpoint_path",
]

ModelID = str
CheckpointType = Literal["training", "sampler", "external"]
STATE_PREFIX = "trainyard://state/"
WEIGHTS_PREFIX = "trainyard://weights/"


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _time(ts) -> _dt.datetime | None:
    """A google.protobuf.Timestamp field as an aware datetime (None when unset)."""
    return ts.ToDatetime(tzinfo=_dt.timezone.utc) if ts.seconds or ts.nanos else None


def checkpoint_path(c: scheduler_pb2.Checkpoint) -> str:
    """Trainyard's path of a checkpoint: a sampler checkpoint's weight version, or the state itself."""
    return WEIGHTS_PREFIX + c.weight_version_id if c.weight_version_id else STATE_PREFIX + c.id


class Cursor(_Response):
    offset: int
    limit: int
    total_count: int


class Checkpoint(_Response):
    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: _dt.datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: _dt.datetime | None = None

    @classmethod
    def from_proto(cls, c: scheduler_pb2.Checkpoint, tinker_path: str, checkpoint_id: str) -> Checkpoint:
        """tinker_path, checkpoint_id: how the caller's protocol names it (the SDK: Trainyard's path and id)."""
        return cls(checkpoint_id=checkpoint_id, checkpoint_type="sampler" if c.weight_version_id else "training",
                   time=_time(c.created_at), tinker_path=tinker_path, size_bytes=c.size_bytes, public=c.public,
                   user_metadata=dict(c.user_metadata) or None, expires_at=_time(c.expires_at))


class CheckpointsListResponse(_Response):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(_Response):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: _dt.datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None

    @classmethod
    def from_proto(cls, s: trainer_pb2.Session, owner: str, last_checkpoint: Checkpoint | None,
                   last_sampler_checkpoint: Checkpoint | None) -> TrainingRun:
        """A session as a run; corrupted: it failed (its calls are refused until closed)."""
        lora = not s.full_parameter
        return cls(training_run_id=s.id, base_model=s.base_model, model_owner=owner, is_lora=lora,
                   corrupted=bool(s.error), lora_rank=s.lora_rank if lora else None,
                   last_request_time=_time(s.last_request_at) or _time(s.created_at),
                   last_checkpoint=last_checkpoint, last_sampler_checkpoint=last_sampler_checkpoint)


class TrainingRunsResponse(_Response):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfoResponse(_Response):
    """Tinker's fields but optimizer_config (always Adam here)."""

    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None

    @classmethod
    def from_proto(cls, c: scheduler_pb2.Checkpoint) -> WeightsInfoResponse:
        lora = c.kind == scheduler_pb2.CHECKPOINT_KIND_LORA_ADAPTER
        return cls(base_model=c.base_model, is_lora=lora, lora_rank=(c.lora_rank or None) if lora else None)


class GetSessionResponse(_Response):
    """A Tinker client session holds training runs and samplers; a Trainyard session is one run, and samplers are
    client-side, so training_run_ids is [the session] and sampler_ids is empty."""

    training_run_ids: list[ModelID]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None

    @classmethod
    def from_proto(cls, s: trainer_pb2.Session) -> GetSessionResponse:
        return cls(training_run_ids=[s.id], sampler_ids=[])


class ListSessionsResponse(_Response):
    sessions: list[str]


class ExternalWeightsUrlsResponse(_Response):
    urls: dict[str, str]
    expires: _dt.datetime


class WhoamiResponse(_Response):
    user_urn: str
    org_urn: str
    email: str | None = None

    @classmethod
    def from_account(cls, account_id: str) -> WhoamiResponse:
        """An account is both the user and the organization (Trainyard has no organizations, nor emails)."""
        return cls(user_urn=f"trainyard:account:{account_id}", org_urn=f"trainyard:account:{account_id}")
