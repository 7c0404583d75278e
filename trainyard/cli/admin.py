"""`trainyard admin`: operator commands that act on the database directly (run where the services' settings are)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from trainyard.cli.render import console, err_console


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
