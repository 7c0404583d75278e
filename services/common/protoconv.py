"""Small helpers shared by servicers to build protos."""
from __future__ import annotations

from datetime import datetime, timezone

from google.protobuf.timestamp_pb2 import Timestamp


def ts(dt: datetime | None) -> Timestamp | None:
    if dt is None:
        return None
    if dt.tzinfo is None:  # SQLite hands back naive datetimes; every stored time is UTC
        dt = dt.replace(tzinfo=timezone.utc)
    t = Timestamp()
    t.FromDatetime(dt)
    return t


def as_utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=timezone.utc)
    return dt


def opt(msg, name: str):
    """The value of an optional proto3 field, or None when it is unset."""
    return getattr(msg, name) if msg.HasField(name) else None
