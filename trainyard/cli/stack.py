"""`trainyard up`, `trainyard status`, `trainyard down`: the platform as local processes (trainyard/up.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.table import Table

from trainyard.cli.render import console, err_console
from trainyard.config import ClientConfig, config_path

HOME_HELP = "Where the stack keeps its database, objects, logs and stack.json (TRAINYARD_HOME, default ~/.trainyard)."


def _home(home: str | None) -> Path:
    from trainyard.up import default_home

    return Path(home) if home else default_home()


@click.command()
@click.option("--home", envvar="TRAINYARD_HOME", type=click.Path(file_okay=False), default=None, help=HOME_HELP)
@click.option("--database-url", envvar="TRAINYARD_DATABASE_URL", default=None,
              help="SQLAlchemy URL of a Postgres database, or the services' setting TRAINYARD_DATABASE_URL "
                   "(default: embedded SQLite under --home).")
@click.option("--broker-url", envvar="TRAINYARD_BROKER_URL", default=None,
              help="Redis URL for the job queue, or the services' setting TRAINYARD_BROKER_URL (default: embedded, "
                   "under --home).")
@click.option("--detach", "-d", is_flag=True, help="Return once the services are healthy; they keep running after "
                                                     "the terminal closes, until `trainyard down`.")
@click.option("--service", "services", multiple=True,
              help="Start only this service (repeatable; default every service of docker-compose.yml).")
@click.option("--login/--no-login", "login", default=None,
              help="Save the addresses and key for the CLI and SDK (`trainyard login`'s file). Default: only when "
                   "no login is saved yet.")
def up(home, database_url, broker_url, detach, services, login):
    """Start the whole platform on this machine and print its addresses and an API key."""
    from trainyard.localstack import compose_services
    from trainyard.up import alive, catch_stop_signals, running, up as start, wait_foreground

    home = _home(home)
    known = [n for n in compose_services() if n not in ("postgres", "redis", "migrate")]
    unknown = sorted(set(services) - set(known))
    if unknown:
        err_console.print(f"[bold red]error[/] --service: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        sys.exit(2)
    already = running(home)
    if not detach and already is None:
        catch_stop_signals()  # a Ctrl-C while starting stops the stack once it is up, not halfway
    stopped = [s.name for s in already.services if not alive(s.pid)] if already is not None else []
    try:
        with console.status("starting") as spinner:
            # Already running: start() only restarts the services that have stopped since.
            state = start(home, database_url=database_url, broker_url=broker_url, services=tuple(services),
                          on_status=lambda msg: spinner.update(msg))
    except (RuntimeError, TimeoutError, OSError) as exc:
        err_console.print(f"[bold red]error[/] the stack did not start: {exc}")
        err_console.print(f"logs: {home / 'logs'}")
        sys.exit(1)
    if already is not None:
        console.print(f"already running under {home} (`trainyard status`, `trainyard down`)"
                      + (f"; restarted {', '.join(stopped)}, which had stopped" if stopped else ""))
    _print_state(state)
    if login or (login is None and not config_path().is_file()):
        urls = state.urls()
        cfg = ClientConfig(url=urls.get("scheduler", ""), rollout_url=urls.get("rollout", ""), api_key=state.api_key,
                           trainer_url=urls.get("trainer", ""))
        console.print(f"saved the addresses and key to {cfg.save()} (the CLI and SDK use them)")
    if detach or already is not None:
        return
    console.print("running in the foreground: Ctrl-C stops every service (`trainyard up --detach` returns instead)")
    with console.status("running") as spinner:
        wait_foreground(home, on_status=lambda msg: spinner.update(msg))
    console.print("stopped")


def _print_state(state) -> None:
    table = Table("service", "address", show_header=True)
    for name, address in state.urls().items():
        table.add_row(name, address)
    console.print(table)
    console.print(f"API key (account \"local\"): [bold]{state.api_key}[/]")
    urls = state.urls()
    exports = {"TRAINYARD_URL": urls.get("scheduler"), "TRAINYARD_TRAINER_URL": urls.get("trainer"),
               "TRAINYARD_ROLLOUT_URL": urls.get("rollout"), "TRAINYARD_API_KEY": state.api_key}
    console.print("\n".join(f"export {k}={v}" for k, v in exports.items() if v), highlight=False, soft_wrap=True)


@click.command()
@click.option("--home", envvar="TRAINYARD_HOME", type=click.Path(file_okay=False), default=None, help=HOME_HELP)
def status(home):
    """Each service of the local stack: healthy, unhealthy or stopped. Exit 0 when all are healthy, 3 when none
    runs, 1 otherwise."""
    from trainyard.up import status as check

    rows = check(_home(home))
    if not rows:
        console.print(f"nothing runs under {_home(home)} (`trainyard up` starts it)")
        sys.exit(3)
    table = Table("service", "state", "address")
    colour = {"healthy": "green", "unhealthy": "yellow", "stopped": "red"}
    for name, state, address in rows:
        table.add_row(name, f"[{colour[state]}]{state}[/]", address)
    console.print(table)
    states = {state for _, state, _ in rows}
    sys.exit(0 if states == {"healthy"} else 3 if states == {"stopped"} else 1)


@click.command()
@click.option("--home", envvar="TRAINYARD_HOME", type=click.Path(file_okay=False), default=None, help=HOME_HELP)
@click.option("--timeout", "timeout_s", type=float, default=60.0, show_default=True,
              help="Seconds each service gets to finish its work before it is killed.")
def down(home, timeout_s):
    """Stop the local stack (its data stays under --home)."""
    from trainyard.up import down as stop

    with console.status("stopping") as spinner:
        stopped = stop(_home(home), timeout_s=timeout_s, on_status=lambda msg: spinner.update(msg))
    console.print(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
