"""Lookups every service shares: which base models and deployments an account can see.

Resolution order for a name: the account's own model, then a shared one. Rows of other accounts are invisible.

Which directories may become models (`importable_dir`): only under the configured import roots, never inside the
platform's own data (blobs, the rollout's caches of other accounts' weights), and never a directory another account
imported (its import is its own). Every refusal is the same message, so a caller cannot probe which paths exist.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from services.common.errors import AlreadyExists, InvalidArgument, not_found
from services.common.schema import SHARED_SCOPE, Checkpoint, Deployment, Model, new_id, utcnow


def find_model(s: Session, account_id: str, name: str) -> Model | None:
    rows = s.scalars(select(Model).where(Model.name == name, or_(Model.scope == account_id,
                                                                 Model.scope == SHARED_SCOPE))).all()
    own = [m for m in rows if m.scope == account_id]
    return (own or rows or [None])[0]


def visible_models(s: Session, account_id: str) -> list[Model]:
    return list(s.scalars(select(Model).where(or_(Model.scope == account_id, Model.scope == SHARED_SCOPE))
                          .order_by(Model.name)).all())


def require_model(s: Session, account_id: str, name: str, *, field: str) -> Model:
    """The model for a request field; an unknown name is the caller's input error, listing what exists."""
    if not name:
        raise InvalidArgument("required: the name of a base model (see `trainyard models list`)", field=field)
    m = find_model(s, account_id, name)
    if m is None:
        names = ", ".join(x.name for x in visible_models(s, account_id)) or "none; import one with " \
                                                                              "`trainyard models import`"
        raise InvalidArgument(f"unknown base model '{name}' (available: {names})", field=field)
    return m


def register_model(s: Session, scope: str, name: str, path: str) -> Model:
    """Validate a Hugging Face-format directory and record it. Raises InvalidArgument naming the problem."""
    from models import ModelDirError, inspect_model_dir

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}", name or ""):
        raise InvalidArgument("use 1-128 letters, digits, '.', '_', '-' or '/', starting with a letter or digit",
                              field="name")
    try:
        info = inspect_model_dir(path)
    except ModelDirError as exc:
        raise InvalidArgument(str(exc), field="path") from None
    existing = s.scalar(select(Model).where(Model.scope == scope, Model.name == name))
    if existing is not None:
        if existing.path == str(path):
            return existing
        raise AlreadyExists(f"model '{name}' already exists (path {existing.path})")
    m = Model(id=new_id("mdl"), scope=scope, name=name, path=str(path), architecture=info.architecture,
              num_parameters=info.num_parameters, num_layers=info.num_layers, hidden_size=info.hidden_size,
              vocab_size=info.vocab_size, max_position_embeddings=info.max_position_embeddings,
              torch_dtype=info.torch_dtype or "", created_at=utcnow())
    s.add(m)
    s.flush()
    return m


def importable_dir(path: str, roots: list[Path] | None, private: list[Path]) -> Path:
    """The resolved directory at path if a client may import it: inside one of roots (None: anywhere, for the
    operator's own `trainyard admin import-model`; []: nowhere) and inside none of private (the data and blob
    directories). InvalidArgument on field "path" otherwise, the same whether the path is not allowed or does not
    exist."""
    if not path or not Path(path).is_absolute():
        raise InvalidArgument("required: the absolute path of a Hugging Face-format model directory on the servers",
                              field="path")
    if roots == []:
        raise InvalidArgument("this platform imports no model directories (model_import_roots is empty); use a "
                              "shared model, or ask the operator to list a models volume in model_import_roots",
                              field="path")
    resolved = Path(path).resolve()  # symlinks and '..' followed first, so neither leads out of a root
    allowed = (roots is None or any(resolved.is_relative_to(r) for r in roots)) and \
        not any(resolved.is_relative_to(p) for p in private) and resolved.is_dir()
    if not allowed:
        raise InvalidArgument(import_refusal(path, roots), field="path")
    return resolved


def import_refusal(path: str, roots: list[Path] | None) -> str:
    where = f" under {', '.join(str(r) for r in roots)}" if roots else ""
    return f"{path} is not a model directory this account can import (import from a directory{where} that holds one)"


def imported_elsewhere(s: Session, account_id: str, directory: Path) -> bool:
    """Whether another account imported this directory, one inside it or one holding it."""
    paths = s.scalars(select(Model.path).where(Model.scope != account_id, Model.scope != SHARED_SCOPE)).all()
    return any(directory.is_relative_to(p) or Path(p).is_relative_to(directory) for p in paths)


# A deployment's name: unique among the account's live deployments (services/scheduler/deployments.py).
DEPLOYMENT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def find_deployment(s: Session, account_id: str, ident: str) -> Deployment | None:
    """A live deployment by id or name."""
    return s.scalar(select(Deployment).where(
        Deployment.account_id == account_id, Deployment.deleted_at.is_(None),
        or_(Deployment.id == ident, Deployment.name == ident)))


def get_checkpoint(s: Session, account_id: str, checkpoint_id: str, *, expired_ok: bool = False) -> Checkpoint:
    """The account's own checkpoint, to read or change; an expired one is gone (NOT_FOUND) unless expired_ok (its
    deletion)."""
    c = s.get(Checkpoint, checkpoint_id) if checkpoint_id else None
    if c is None or c.account_id != account_id or (expired(c) and not expired_ok):
        raise not_found("checkpoint", checkpoint_id)
    return c


def readable_checkpoint(s: Session, account_id: str, checkpoint_id: str) -> Checkpoint:
    """A checkpoint the account may read (download, load as a state, sample): its own, or another account's while
    published; never an expired one. Everything else is NOT_FOUND, the same answer, so ids cannot be probed."""
    c = s.get(Checkpoint, checkpoint_id) if checkpoint_id else None
    if c is None or (c.account_id != account_id and not c.public) or expired(c):
        raise not_found("checkpoint", checkpoint_id)
    return c


def expired(c: Checkpoint, now: datetime | None = None) -> bool:
    if c.expires_at is None:
        return False
    at = c.expires_at if c.expires_at.tzinfo else c.expires_at.replace(tzinfo=timezone.utc)  # SQLite drops the zone
    return at <= (now or utcnow())


# A checkpoint's user_metadata and TTL (SaveState / SaveWeights, SetCheckpointTtl).
MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 128, 4096
MAX_TTL_S = 100 * 365 * 86400  # about a century: beyond it a TTL is a mistake, not a wish


def check_ttl(ttl_seconds: int | None, field: str) -> None:
    if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
        raise InvalidArgument(f"must be between 1 and {MAX_TTL_S} seconds, got {ttl_seconds}", field=field)


def check_user_metadata(metadata: dict[str, str], field: str) -> None:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"at most {MAX_METADATA_ENTRIES} entries, got {len(metadata)}", field=field)
    for key, value in metadata.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY:
            raise InvalidArgument(f"keys must have 1 to {MAX_METADATA_KEY} characters, got {len(key)}", field=field)
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidArgument(f"at most {MAX_METADATA_VALUE} characters, got {len(value)}",
                                  field=f"{field}[{key!r}]")
