"""`trainyard up` / `status` / `down` as a user runs them: the stack outlives the command and a closed terminal
(--detach), the foreground form stops it on Ctrl-C, and the account, key and data survive a restart."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from trainyard.localstack import ROOT
from trainyard.up import alive as _alive

pytestmark = pytest.mark.integration


@pytest.fixture()
def home(tmp_path):
    path = tmp_path / "home"
    yield path
    subprocess.run([sys.executable, "-m", "trainyard.cli.main", "down", "--home", str(path), "--timeout", "20"],
                   cwd=ROOT, capture_output=True, timeout=300)


def _env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    return {**env, "TRAINYARD_CLIENT_CONFIG": str(tmp_path / "client.json"), "COLUMNS": "200"}


def _cli(tmp_path, *args, timeout=600, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainyard.cli.main", *args], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout, **popen)


def _state(home) -> dict:
    return json.loads((home / "stack.json").read_text())


def _whoami(tmp_path, state: dict) -> str:
    scheduler = next(s["address"] for s in state["services"] if s["name"] == "scheduler")
    out = _cli(tmp_path, "--url", scheduler, "--api-key", state["api_key"], "whoami", timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_detached_stack_survives_the_terminal_and_keeps_its_account(tmp_path, home):
    # The terminal: `up --detach` runs in a session of its own, which then gets SIGHUP as when a terminal closes.
    proc = subprocess.Popen([sys.executable, "-m", "trainyard.cli.main", "up", "--detach", "--home", str(home),
                             "--service", "scheduler", "--service", "weightsync"],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    state = _state(home)
    assert "API key (account \"local\")" in out and state["api_key"] in out
    assert f"export TRAINYARD_API_KEY={state['api_key']}" in out
    assert "saved the addresses and key" in out  # no login was saved yet: this one is
    assert json.loads((tmp_path / "client.json").read_text())["api_key"] == state["api_key"]
    assert oct((home / "stack.json").stat().st_mode & 0o777) == "0o600"  # it holds the key
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGHUP)  # the command's session is gone; the services' are their own
    time.sleep(1)

    status = _cli(tmp_path, "status", "--home", str(home))
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.count("healthy") == 2 and "scheduler" in status.stdout
    assert "local (acct_" in _whoami(tmp_path, state)

    again = _cli(tmp_path, "up", "--detach", "--home", str(home))
    assert again.returncode == 0 and "already running" in again.stdout and "restarted" not in again.stdout

    # A service that died (a crash, a kill) is started again by the next `up`, on its address; the others stay.
    weightsync = next(s for s in state["services"] if s["name"] == "weightsync")
    scheduler_pid = next(s["pid"] for s in state["services"] if s["name"] == "scheduler")
    os.killpg(weightsync["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(weightsync["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "stopped" in _cli(tmp_path, "status", "--home", str(home)).stdout
    revived = _cli(tmp_path, "up", "--detach", "--home", str(home))
    assert revived.returncode == 0, revived.stdout + revived.stderr
    assert "restarted weightsync, which had stopped" in revived.stdout
    status = _cli(tmp_path, "status", "--home", str(home))
    assert status.returncode == 0 and status.stdout.count("healthy") == 2, status.stdout
    now = {s["name"]: s for s in _state(home)["services"]}
    assert now["scheduler"]["pid"] == scheduler_pid and now["weightsync"]["address"] == weightsync["address"]
    state = _state(home)

    down = _cli(tmp_path, "down", "--home", str(home))
    assert down.returncode == 0 and "stopped weightsync, scheduler" in down.stdout, down.stdout + down.stderr
    assert not any(_alive(s["pid"]) for s in state["services"])
    stopped = _cli(tmp_path, "status", "--home", str(home))
    assert stopped.returncode == 3 and "nothing runs" in stopped.stdout

    # Up again on the same home: the same database, account and key.
    restart = _cli(tmp_path, "up", "--detach", "--home", str(home), "--service", "scheduler")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert _state(home)["api_key"] == state["api_key"]
    assert _whoami(tmp_path, _state(home)).split()[1] == _whoami(tmp_path, state).split()[1]


def test_foreground_stack_stops_on_ctrl_c(tmp_path, home):
    proc = subprocess.Popen([sys.executable, "-m", "trainyard.cli.main", "up", "--home", str(home), "--no-login",
                             "--service", "weightsync"], cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if _cli(tmp_path, "status", "--home", str(home), timeout=60).returncode == 0:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(1)
    else:
        pytest.fail("the stack did not become healthy")
    pids = [s["pid"] for s in _state(home)["services"]]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped" in out and not (tmp_path / "client.json").exists()  # --no-login
    assert not any(_alive(pid) for pid in pids)
    assert _cli(tmp_path, "status", "--home", str(home)).returncode == 3


def test_bad_service_name_is_named(tmp_path, home):
    out = _cli(tmp_path, "up", "--home", str(home), "--service", "schedular")
    assert out.returncode == 2 and "--service: unknown schedular" in out.stderr
    assert not (home / "stack.json").exists()


def test_the_whole_stack_on_postgres_and_redis_from_the_settings(tmp_path, home):
    """Every service of docker-compose.yml (the dashboard and gateway included) started by `up`, on the Postgres and
    Redis that the services' own settings name (TRAINYARD_DATABASE_URL, TRAINYARD_BROKER_URL), healthy, serving, and
    stopped by `down`."""
    from tests.conftest import REDIS_URL, fresh_database
    from trainyard.localstack import compose_services

    expected = {n for n in compose_services() if n not in ("postgres", "redis", "migrate")}
    # A Redis database of its own: its worker must not take the session stack's jobs from the shared queue.
    broker = REDIS_URL.rsplit("/", 1)[0] + "/9"
    with fresh_database("trainyard_up") as database:
        env = {**_env(tmp_path), "TRAINYARD_DATABASE_URL": database, "TRAINYARD_BROKER_URL": broker}
        started = subprocess.run([sys.executable, "-m", "trainyard.cli.main", "up", "--detach", "--no-login",
                                  "--home", str(home)], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=600)
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            state = _state(home)
            assert {s["name"] for s in state["services"]} == expected
            assert (state["database_url"], state["broker_url"]) == (database, broker)
            status = _cli(tmp_path, "status", "--home", str(home))
            assert status.returncode == 0 and status.stdout.count("healthy") == len(expected), status.stdout
            dashboard = next(s["address"] for s in state["services"] if s["name"] == "dashboard")
            with urllib.request.urlopen(f"http://{dashboard}/_stcore/health", timeout=30) as resp:
                assert resp.read() == b"ok"
            assert "local (acct_" in _whoami(tmp_path, state)
        finally:
            down = _cli(tmp_path, "down", "--home", str(home))
        assert down.returncode == 0, down.stdout + down.stderr
        assert not any(_alive(s["pid"]) for s in state["services"])
