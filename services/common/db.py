"""Engine, sessions and migrations.

Postgres (psycopg 3) is the real store; SQLite is the embedded quickstart default. Several processes share one
SQLite file, so it runs in WAL mode with a busy timeout; each unit of work is one short transaction.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def normalize_url(url: str) -> str:
    """Use psycopg 3 for plain postgresql:// URLs."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def make_engine(url: str) -> Engine:
    """hide_parameters: a database error's text keeps its SQL but not the bound values (API key hashes, users'
    names and paths), so logging it leaks nothing of an account's data."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, hide_parameters=True)


class Database:
    """Owns an engine and hands out transactional sessions: ``with db.session() as s: ...`` commits on success."""

    def __init__(self, url: str):
        self.url = normalize_url(url)
        self.engine = make_engine(self.url)
        self._factory = sessionmaker(self.engine, expire_on_commit=False)

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        with self._factory() as s, s.begin():
            yield s

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at url to revision (a fresh database goes straight to head)."""
    from alembic import command

    if url.startswith("sqlite"):
        make_engine(url).dispose()  # creates the parent directory
    command.upgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
