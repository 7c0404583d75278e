"""Accounts, API keys and base models as seen by their owner (checkpoints: checkpoints.py)."""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from services.common import auth, registry
from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.errors import FailedPrecondition, InvalidArgument, not_found
from services.common.schema import Account, ApiKey, Model, utcnow


class AccountCore:
    """model_import_roots: where ImportModel may read model directories (empty: nowhere); private_dirs: the
    platform's data and blob directories, never importable even inside a root."""

    def __init__(self, db: Database, blobs: BlobStore, model_import_roots: list[Path], private_dirs: list[Path]):
        self.db = db
        self.blobs = blobs
        self.model_import_roots = [Path(r).resolve() for r in model_import_roots]
        self.private_dirs = [Path(p).resolve() for p in private_dirs]

    # -- accounts and keys ---------------------------------------------------------------------------------------
    def account(self, account_id: str) -> Account:
        with self.db.session() as s:
            return s.get(Account, account_id)

    def create_key(self, account_id: str, name: str) -> tuple[ApiKey, str]:
        if len(name) > 128:
            raise InvalidArgument("at most 128 characters", field="name")
        return auth.issue_key(self.db, account_id, name or "unnamed")

    def list_keys(self, account_id: str) -> list[ApiKey]:
        with self.db.session() as s:
            return list(s.scalars(select(ApiKey).where(ApiKey.account_id == account_id).order_by(ApiKey.created_at)))

    def revoke_key(self, account_id: str, caller_key_id: str, key_id: str) -> ApiKey:
        with self.db.session() as s:
            key = s.get(ApiKey, key_id) if key_id else None
            if key is None or key.account_id != account_id:
                raise not_found("API key", key_id)
            if key.id == caller_key_id:
                raise FailedPrecondition("this call is authenticated with the key it would revoke; "
                                         "revoke it with another key")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            return key

    # -- models --------------------------------------------------------------------------------------------------
    def import_model(self, account_id: str, name: str, path: str) -> Model:
        """The account's own model (registry.importable_dir says which directories qualify)."""
        resolved = registry.importable_dir(path, self.model_import_roots, self.private_dirs)
        with self.db.session() as s:
            if registry.imported_elsewhere(s, account_id, resolved):
                raise InvalidArgument(registry.import_refusal(path, self.model_import_roots), field="path")
            return registry.register_model(s, account_id, name, str(resolved))

    def list_models(self, account_id: str) -> list[Model]:
        with self.db.session() as s:
            return registry.visible_models(s, account_id)

    def get_model(self, account_id: str, name: str) -> Model:
        with self.db.session() as s:
            m = registry.find_model(s, account_id, name) if name else None
            if m is None:
                raise not_found("model", name)
            return m
