"""Per-account quotas: one error shape for every limit, naming the setting that holds it.

The limits themselves are settings of the service that enforces them (each declared, with its default and meaning,
in that service's settings class); docs/limits.md lists them all.
"""
from __future__ import annotations

from services.common.errors import ResourceExhausted


def quota_reached(name: str, limit: int, detail: str) -> ResourceExhausted:
    """RESOURCE_EXHAUSTED: "quota max_sessions_per_account (64) reached: <detail> (the operator sets it with
    TRAINYARD_MAX_SESSIONS_PER_ACCOUNT)"."""
    return ResourceExhausted(f"quota {name} ({limit}) reached: {detail} (the operator sets it with "
                             f"TRAINYARD_{name.upper()})")


def check_quota(name: str, limit: int, used: int, detail: str, adding: int = 1) -> None:
    """Raise quota_reached when used + adding exceeds limit."""
    if used + adding > limit:
        raise quota_reached(name, limit, detail)
