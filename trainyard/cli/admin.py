"""`trainyard admin`: operator commands that act on the database directly (run where the services' settings are)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from trainyard.cli.render import console, err_console, human_bytes


@click.group()
def admin():
    """Operator commands that act on the database directly (run where the services' settings are)."""


@admin.command("migrate")
def admin_migrate():
    """Upgrade the database to the latest schema."""
    from services.common.migrate import main

    main()


@admin.command("create-account")
@click.argument("name")
@click.option("--quiet", is_flag=True, help="Print only the API key.")
def admin_create_account(name, quiet):
    """Create an account and print its first API key (shown only once)."""
    from services.common.auth import create_account
    from services.common.config import TrainyardSettings
    from services.common.db import Database, migrate
    from services.common.errors import TrainyardError as DomainError

    settings = TrainyardSettings()
    settings.ensure_dirs()
    migrate(settings.database_url)
    db = Database(settings.database_url)
    try:
        account, _key, secret = create_account(db, name)
    except DomainError as exc:
        err_console.print(f"[bold red]error[/] {exc.message}")
        sys.exit(1)
    finally:
        db.dispose()
    if quiet:
        click.echo(secret)
    else:
        console.print(f"created account [bold]{account.name}[/] ({account.id})")
        console.print("API key (store it now; it is not shown again):")
        click.echo(secret)


@admin.command("import-model")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--name", help="Defaults to the directory name.")
def admin_import_model(path, name):
    """Register a model directory that every account can use (anywhere but the platform's own data directories,
    which hold the accounts' weights)."""
    from services.common.config import TrainyardSettings
    from services.common.db import Database
    from services.common.errors import TrainyardError as DomainError
    from services.common.registry import importable_dir, register_model
    from services.common.schema import SHARED_SCOPE

    settings = TrainyardSettings()
    db = Database(settings.database_url)
    try:
        p = importable_dir(str(Path(path).absolute()), None, [settings.data_dir, settings.blob_dir])
        with db.session() as s:
            m = register_model(s, SHARED_SCOPE, name or p.name, str(p))
            console.print(f"shared model [bold]{m.name}[/]: {m.architecture}, {m.num_parameters:,} parameters")
    except DomainError as exc:
        err_console.print(f"[bold red]error[/] {exc.message}")
        sys.exit(1)
    finally:
        db.dispose()


@admin.command("fsck")
@click.option("--quarantine", is_flag=True,
              help="Move damaged blobs and orphans to <blob_dir>/quarantine/ (with a note each); nothing is deleted.")
def admin_fsck(quarantine):
    """Check every blob of the object store against its sha256 name and against the rows naming blobs.

    Reports damaged blobs (bytes that do not hash to the name), blobs no row names (orphans) and rows naming blobs
    the store does not hold. Exits 1 when stored data is damaged or missing, 0 otherwise (orphans lose nothing).
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from services.common import fsck
    from services.common.blobstore import BlobStore
    from services.common.config import TrainyardSettings
    from services.common.db import Database

    settings = TrainyardSettings()
    store = BlobStore(settings.blob_dir)
    db = Database(settings.database_url)
    try:
        files = fsck.blob_files(store)
        with Progress(TextColumn("checking blobs"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task("hash", total=sum(p.stat().st_size for p in files))
            report = fsck.check(store, db, quarantine=quarantine, files=files,
                                progress=lambda n: bar.advance(task, n))
    finally:
        db.dispose()
    for f in report.findings:  # one plain line each, for grep
        named = f"; named by {', '.join(f.rows[:3])}" + (f" and {len(f.rows) - 3} more" if len(f.rows) > 3 else "") \
            if f.rows else ""
        click.echo(f"{f.kind:8} {f.name}: {f.detail}{named}")
    click.echo(f"{report.blobs} blobs, {human_bytes(report.bytes)}: {len(report.of('damaged'))} damaged, "
               f"{len(report.of('missing'))} missing, {len(report.of('orphan'))} orphans")
    if report.quarantined:
        click.echo(f"moved {len(report.quarantined)} to {store.quarantine_dir}")
    if report.damage:
        sys.exit(1)


@admin.command("set-quota")
@click.argument("account")
@click.option("--max-devices", type=int, default=None,
              help="Devices the account's running jobs may hold at once (0 = no limit); a job over it waits, queued.")
@click.option("--max-queued-jobs", type=int, default=None,
              help="Jobs the account may have queued at once (0 = no limit); CreateJob refuses one more.")
@click.option("--clear", is_flag=True, help="Back to the defaults (TRAINYARD_MAX_DEVICES_PER_ACCOUNT, "
                                            "TRAINYARD_MAX_QUEUED_JOBS_PER_ACCOUNT).")
def admin_set_quota(account, max_devices, max_queued_jobs, clear):
    """Set an account's device and queue quotas (options left out stay as they are)."""
    from services.common.config import TrainyardSettings
    from services.common.db import Database
    from services.common.errors import TrainyardError as DomainError
    from services.common.resources import set_quota

    db = Database(TrainyardSettings().database_url)
    try:
        q = set_quota(db, account, max_devices=max_devices, max_queued_jobs=max_queued_jobs, clear=clear)
    except DomainError as exc:
        err_console.print(f"[bold red]error[/] {exc.message}")
        sys.exit(1)
    finally:
        db.dispose()
    show = lambda n: "default" if n is None else ("no limit" if n == 0 else str(n))  # noqa: E731
    console.print(f"account [bold]{account}[/]: max_devices {show(q.max_devices)}, "
                  f"max_queued_jobs {show(q.max_queued_jobs)}")
