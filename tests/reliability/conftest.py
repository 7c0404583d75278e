"""The reliability suite's stack, accounts and figures.

The suite runs against its own stack (every service of docker-compose.yml as a local process, via
trainyard/localstack.py) on its own Postgres database, so its fuzzing, kills and load never disturb the integration
tests' stack. Its short form runs in CI; TRAINYARD_SOAK=1 (scripts/soak.sh) scales counts and durations up for a
manual run. Every module records its figures in FIGURES; they are printed at the end of the run and written as
JSON to TRAINYARD_RELIABILITY_REPORT when that names a file.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL, _admin
from tests.reliability.figures import FIGURES
from tests.reliability.snapshot import Snapshots
from tests.reliability.world import Stubs, build_account

# Fast failure detection and retries, as the integration tests' stack: a killed worker's job is retried within
# seconds, not after the production defaults.
STACK_ENV = {
    "TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_WORKER_LOST_AFTER_S": "6", "TRAINYARD_REAPER_INTERVAL_S": "1",
    "TRAINYARD_SHUTDOWN_GRACE_S": "10", "TRAINYARD_TORCH_THREADS": "1",
}


@dataclass(frozen=True)
class Scale:
    """How much of everything a run does. The short form fits CI (minutes); the soak form is for manual runs."""

    soak: bool
    fuzz_examples: int        # generated requests per RPC (explicit probes come on top)
    fault_rounds: int         # times each service is killed during the managed job and the Training API loop
    load_sessions: int        # Training API sessions training at once in the load test
    load_samplers: int        # threads sampling at once in the load test
    load_seconds: float       # how long the load runs
    rss_growth_bound: float   # how much a service's RSS may grow under the load (fraction of its start)

    @classmethod
    def from_env(cls) -> Scale:
        if os.environ.get("TRAINYARD_SOAK", "0") not in ("", "0"):
            return cls(soak=True, fuzz_examples=int(os.environ.get("TRAINYARD_SOAK_FUZZ", "200")), fault_rounds=3,
                       load_sessions=8, load_samplers=16,
                       load_seconds=float(os.environ.get("TRAINYARD_SOAK_SECONDS", "300")), rss_growth_bound=0.25)
        return cls(soak=False, fuzz_examples=20, fault_rounds=1, load_sessions=4, load_samplers=8, load_seconds=20,
                   rss_growth_bound=0.25)



def pytest_terminal_summary(terminalreporter):
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for name, figures in FIGURES.items():
        terminalreporter.write_line(f"{name}: {json.dumps(figures, sort_keys=True, default=str)}")
    path = os.environ.get("TRAINYARD_RELIABILITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(FIGURES, indent=1, sort_keys=True, default=str))
        terminalreporter.write_line(f"written to {path}")


@pytest.fixture(scope="session")
def scale() -> Scale:
    s = Scale.from_env()
    FIGURES.setdefault("scale", asdict(s))
    return s


def new_stack(work_dir: Path, redis_url: str, extra_env: dict[str, str] | None = None):
    """A fresh database and the whole stack on it, up; the caller downs it and drops the database (drop_db)."""
    from trainyard.localstack import Stack

    name = f"trainyard_reliability_{secrets.token_hex(4)}"
    _admin(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    stack = Stack(work_dir, database_url=f"{base}/{name}", broker_url=redis_url,
                  extra_env={**STACK_ENV, **(extra_env or {})})
    stack.db_name = name
    try:
        stack.up()
    except BaseException:
        stack.down()
        drop_db(stack)
        raise
    return stack


def drop_db(stack) -> None:
    _admin(f'DROP DATABASE IF EXISTS "{stack.db_name}" WITH (FORCE)')


@pytest.fixture(scope="package")
def rstack(tmp_path_factory, redis_url):
    stack = new_stack(tmp_path_factory.mktemp("reliability"), redis_url)
    try:
        yield stack
    finally:
        stack.down()
        drop_db(stack)


@pytest.fixture(scope="package")
def stubs(rstack):
    s = Stubs(rstack)
    yield s
    s.close()


@pytest.fixture(scope="package")
def owner(rstack, stubs):
    """Account A: the one whose objects the others try to reach."""
    return build_account(rstack, stubs, "owner")


@pytest.fixture(scope="package")
def intruder(rstack, stubs):
    """Account B: reaches for A's objects with its own key, holding objects of every kind itself."""
    return build_account(rstack, stubs, "intruder")


@pytest.fixture(scope="package")
def snapshots(rstack):
    s = Snapshots(rstack.database_url, rstack.data_dir / "blobs")
    yield s
    s.close()
