"""`trainyard up` / `trainyard status` / `trainyard down`: the whole platform on this machine, kept running.

`up` starts every service of docker-compose.yml as a local process (trainyard/localstack.py: scheduler, worker,
trainer, rollout, weightsync and the rest), on the embedded defaults (SQLite and a filesystem broker under the home
directory) or on the Postgres and Redis the caller names. Unlike `trainyard demo`, nothing is deleted: the home
directory keeps the database, the object store and an account "local" whose API key is created on the first `up`.
Each service gets the port the compose file publishes where that port is free (so the addresses stay the same from
one `up` to the next), else another free one.

The processes run in sessions of their own, so a closed terminal does not reach them. Without --detach `up` stays in
the foreground and stops them on Ctrl-C (or SIGTERM / SIGHUP); with --detach it returns once every service is
healthy. Either way the home directory's stack.json records what runs (pid, process group, ports, URLs) and the
account's key (the file is readable by its owner only), which is what `status` checks and `down` stops.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "stack.json"
ACCOUNT = "local"


def default_home() -> Path:
    """TRAINYARD_HOME, else ~/.trainyard."""
    return Path(os.environ.get("TRAINYARD_HOME") or Path.home() / ".trainyard")


@dataclass
class ServiceState:
    name: str
    pid: int
    address: str  # host:port of its main port ("" for the worker, which serves none)
    log: str


@dataclass
class StackState:
    home: str
    database_url: str | None
    broker_url: str | None
    api_key: str
    ports: dict[str, int]
    services: list[ServiceState] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def path(self) -> Path:
        return Path(self.home) / STATE_FILE

    def save(self) -> Path:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the account's API key
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        return self.path

    @classmethod
    def load(cls, home: Path) -> StackState | None:
        path = home / STATE_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        raw["services"] = [ServiceState(**s) for s in raw.get("services", [])]
        return cls(**raw)

    def urls(self) -> dict[str, str]:
        """What a person opens or points a client at."""
        out = {s.name: s.address for s in self.services if s.address}
        for name in ("dashboard", "gateway"):  # the gateway's URL is the tinker SDK's base_url (docs/gateway.md)
            if name in out:
                out[name] = f"http://{out[name]}"
        rollout_http = self.ports.get("rollout:8000")
        if rollout_http and "rollout" in out:
            out["openai"] = f"http://127.0.0.1:{rollout_http}/v1"
        return out


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all there is
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _stack(state_home: Path, database_url: str | None, broker_url: str | None, ports: dict[str, int] | None = None):
    from trainyard.localstack import Stack

    return Stack(state_home, database_url=database_url, broker_url=broker_url, ports=dict(ports or {}),
                 published_ports=True)


def running(home: Path) -> StackState | None:
    """The recorded stack if any of its processes still runs."""
    state = StackState.load(home)
    if state is None or not any(alive(s.pid) for s in state.services):
        return None
    return state


def _account_key(stack, state: StackState | None) -> str:
    """The key of the account "local": kept from an earlier `up`, else created now (the database was just
    migrated by Stack.up)."""
    if state is not None and state.api_key:
        return state.api_key
    from sqlalchemy import select

    from services.common.auth import create_account, issue_key
    from services.common.db import Database
    from services.common.schema import Account

    # The services' own default when no database is named: SQLite under their data directory.
    url = stack.database_url or f"sqlite:///{stack.data_dir / 'trainyard.db'}"
    db = Database(url)
    try:
        with db.session() as s:
            account = s.scalar(select(Account).where(Account.name == ACCOUNT))
            account_id = account.id if account is not None else None
        if account_id is None:
            _, _, key = create_account(db, ACCOUNT)
        else:  # the record was lost, the database kept: a new key for the same account
            _, key = issue_key(db, account_id, "trainyard-up")
    finally:
        db.dispose()
    return key


def up(home: Path, *, database_url: str | None = None, broker_url: str | None = None,
       services: tuple[str, ...] = (), extra_env: dict[str, str] | None = None, on_status=None) -> StackState:
    """Start the stack under home (or return the one already running there), record it and return the record."""
    home = home.absolute()
    home.mkdir(parents=True, exist_ok=True)
    current = running(home)
    if current is not None:
        return _restart_stopped(current, extra_env, on_status or (lambda _msg: None))
    previous = StackState.load(home)
    if previous is not None and (previous.database_url, previous.broker_url) != (database_url, broker_url):
        previous = None  # another database: the recorded key belongs to the old one
    stack = _stack(home, database_url, broker_url, previous.ports if previous else None)
    stack.extra_env.update({"TRAINYARD_TORCH_THREADS": "1", **(extra_env or {})})
    say = on_status or (lambda _msg: None)
    names = services or tuple(n for n in stack.services if n not in ("postgres", "redis", "migrate"))
    say("migrating the database")
    stack.run_once("migrate")
    key = _account_key(stack, previous)
    state = StackState(home=str(home), database_url=database_url, broker_url=broker_url, api_key=key,
                       ports=dict(stack.ports), started_at=time.time())
    try:
        for name in names:
            say(f"starting {name}")
            stack.start(name)
            proc = stack.procs[name]
            state.services.append(ServiceState(name, proc.popen.pid, stack.url(name) if name != "worker" else "",
                                               str(proc.log_path)))
            state.save()  # a crash or Ctrl-C from here on still leaves `down` what to stop
        for name in names:
            say(f"waiting for {name}")
            stack.wait_ready(name, timeout_s=180)
    except BaseException:
        stack.down()
        state.services = []
        state.save()
        raise
    return state


def _restart_stopped(state: StackState, extra_env: dict[str, str] | None, say) -> StackState:
    """A recorded stack that still runs, with the services that stopped since (a crash, a kill) started again on
    their recorded ports; the others are left as they are."""
    stopped = [s for s in state.services if not alive(s.pid)]
    if not stopped:
        return state
    stack = _stack(Path(state.home), state.database_url, state.broker_url, state.ports)
    stack.extra_env.update({"TRAINYARD_TORCH_THREADS": "1", **(extra_env or {})})
    for s in stopped:
        say(f"restarting {s.name} (it had stopped)")
        stack.start(s.name)
        proc = stack.procs[s.name]
        s.pid, s.log = proc.popen.pid, str(proc.log_path)
        state.save()
    for s in stopped:
        say(f"waiting for {s.name}")
        stack.wait_ready(s.name, timeout_s=180)
    return state


def status(home: Path) -> list[tuple[str, str, str]]:
    """(service, "healthy" | "unhealthy" | "stopped", address) for each recorded service."""
    state = StackState.load(home.absolute())
    if state is None:
        return []
    stack = _stack(Path(state.home), state.database_url, state.broker_url, state.ports)
    rows = []
    for s in state.services:
        if not alive(s.pid):
            rows.append((s.name, "stopped", s.address))
            continue
        try:
            ok = stack.healthcheck(s.name, timeout_s=30).returncode == 0
        except (subprocess.TimeoutExpired, KeyError, ValueError):
            ok = False
        rows.append((s.name, "healthy" if ok else "unhealthy", s.address))
    return rows


def down(home: Path, timeout_s: float = 60.0, on_status=None) -> list[str]:
    """SIGTERM each recorded service's process group (last started first), SIGKILL what outlives timeout_s; the
    data stays. Returns the services stopped."""
    home = home.absolute()
    state = StackState.load(home)
    if state is None:
        return []
    say = on_status or (lambda _msg: None)
    stopped = []
    for s in reversed(state.services):
        if not alive(s.pid):
            continue
        say(f"stopping {s.name}")
        _signal_group(s.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive(s.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if alive(s.pid):
            _signal_group(s.pid, signal.SIGKILL)
        stopped.append(s.name)
    state.services = []
    state.save()
    return stopped


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each service leads its own session (Stack.start), its children with it
    except ProcessLookupError:
        pass


_STOP: list[int] = []


def catch_stop_signals() -> None:
    """From now on Ctrl-C, SIGTERM and SIGHUP (the terminal closing) ask wait_foreground to stop the stack, also when
    they arrive while it is still starting."""
    def handler(signum, _frame):
        _STOP.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def wait_foreground(home: Path, on_status=None) -> None:
    """Stay until Ctrl-C, SIGTERM or SIGHUP, then stop the stack."""
    catch_stop_signals()
    state = StackState.load(home.absolute())
    try:
        while not _STOP:
            if state is not None and not any(alive(s.pid) for s in state.services):
                break
            time.sleep(0.5)
    finally:
        down(home, on_status=on_status)
    sys.stdout.flush()
