"""API keys and the caller's account.

A key is shown once at creation ("ty_" + 43 url-safe characters); the database keeps only its sha256, so a leaked
database does not leak usable keys. The interceptor authenticates every call and stores the Caller in a context
variable for the duration of the RPC; cores take the account id from it.
"""
from __future__ import annotations

import contextvars
import hashlib
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select

from services.common.db import Database
from services.common.errors import AlreadyExists, InvalidArgument, Unauthenticated
from services.common.schema import Account, ApiKey, new_id, utcnow

KEY_PREFIX = "ty_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")  # whole names only (fullmatch: no trailing newline)


@dataclass(frozen=True)
class Caller:
    account_id: str
    account_name: str
    key_id: str
    # The raw key, so a service can call another service on the caller's behalf (e.g. scheduler -> rollout).
    api_key: str


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
            return Caller(account_id=row.Account.id, account_name=row.Account.name, key_id=row.ApiKey.id, api_key=key)


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


def _new_key(account_id: str, name: str) -> tuple[ApiKey, str]:
    secret = generate_key()
    key = ApiKey(id=new_id("key"), account_id=account_id, name=name, prefix=secret[:10],
                 key_hash=hash_key(secret), created_at=utcnow())
    return key, secret
