"""The scheduler alone (its real build function and settings) on a database, with two accounts: what the evaluator
RPCs, the SDK, the CLI and the dashboard's Evaluators page need, without the training services."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from services.common.auth import create_account
from services.common.db import Database, migrate
from services.scheduler.app import build as build_scheduler
from services.scheduler.settings import SchedulerSettings


@contextlib.contextmanager
def scheduler_only(root: Path, database_url: str, accounts: tuple[str, ...], **settings) -> Iterator[tuple[str, dict]]:
    """(the scheduler's address, {account name: API key})."""
    migrate(database_url)
    db = Database(database_url)
    keys = {name: create_account(db, name)[2] for name in accounts}
    server = build_scheduler(SchedulerSettings(
        data_dir=root, database_url=database_url, host="127.0.0.1", scheduler_port=0, builtin_tiny_models=False,
        grpc_workers=4, shutdown_grace_s=0, **settings))
    server.start()
    try:
        yield f"127.0.0.1:{server.port}", keys
    finally:
        server.stop()
        db.dispose()
