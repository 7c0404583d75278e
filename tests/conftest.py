"""Shared fixtures: the locally built tiny models of every family (built once per test session), a fresh Postgres
database per session, Redis, and the service stack from docker-compose.yml."""
from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("TRAINYARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TRAINYARD_TEST_REDIS", "redis://127.0.0.1:6379/0")


# -- models ------------------------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """One torch thread for the test (the process's count back afterwards, also when the test fails): the tiny
    models' ops are far too small to gain from intra-op threads, on a shared 2-core machine threads only contend, and
    a fixed count keeps bitwise comparisons reproducible. A test folder or module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny dense Qwen3 model and tokenizer the project builds locally (models/tiny.py)."""
    from models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """The tiny model of every family: qwen3 (dense), qwen3_moe (MoE, softmax router), deepseek_v3 (MLA + MoE)."""
    from models.tiny import build_tiny_model

    dirs = {"qwen3": tiny_model_dir}
    for family in ("qwen3_moe", "deepseek_v3"):
        dirs[family] = build_tiny_model(tmp_path_factory.mktemp(family), family=family)
    return dirs


# -- TLS ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A throwaway CA with a certificate for 127.0.0.1 / localhost (server and client use: the services present it
    to each other under mutual TLS), a client certificate, and a second CA with a client certificate of its own
    that the first does not trust. Made with the openssl command for this test session; nothing is committed."""
    d = tmp_path_factory.mktemp("pki")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "rogue-ca"):
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    (d / "leaf.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                "extendedKeyUsage=serverAuth,clientAuth\n")
    for name, ca in (("server", "ca"), ("client", "ca"), ("rogue-client", "rogue-ca")):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "leaf.ext")
    return {p.stem if p.suffix == ".pem" else p.name: p for p in d.iterdir() if p.suffix in (".pem", ".key")}


# -- services ----------------------------------------------------------------------------------------------------
def _admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql)


@contextlib.contextmanager
def fresh_database(prefix: str):
    """A new, empty Postgres database (its SQLAlchemy URL), dropped afterwards."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    _admin(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    try:
        yield f"{base}/{name}"
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def own_stack(work_dir: Path, redis_url: str, prefix: str, extra_env: dict[str, str]):
    """The scheduler and a Celery worker on a fresh database of their own, for tests that kill, restart or
    reconfigure them; downed and dropped afterwards."""
    from trainyard.localstack import Stack

    with fresh_database(prefix) as url:
        stack = Stack(work_dir, database_url=url, broker_url=redis_url, extra_env=extra_env)
        try:
            stack.up("scheduler", "worker")
            yield stack
        finally:
            stack.down()


@pytest.fixture(scope="session")
def pg_url():
    """A new, empty Postgres database for this test session (dropped afterwards)."""
    with fresh_database("trainyard_test") as url:
        yield url


@pytest.fixture(scope="session")
def redis_url():
    import redis

    redis.Redis.from_url(REDIS_URL).ping()
    return REDIS_URL


def create_account(env: dict, name: str) -> str:
    """`trainyard admin create-account` as an operator runs it; returns the printed API key."""
    out = subprocess.run([sys.executable, "-m", "trainyard.cli.main", "admin", "create-account", name, "--quiet"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def stack(tmp_path_factory, pg_url, redis_url):
    """Every application service of docker-compose.yml running as a local process, on Postgres and Redis."""
    from trainyard.localstack import Stack

    s = Stack(tmp_path_factory.mktemp("stack"), database_url=pg_url, broker_url=redis_url, extra_env={
        "TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_WORKER_LOST_AFTER_S": "6", "TRAINYARD_REAPER_INTERVAL_S": "1",
        "TRAINYARD_SHUTDOWN_GRACE_S": "20", "TRAINYARD_TORCH_THREADS": "1",
    })
    try:
        s.up()
        yield s
    finally:
        s.down()


@pytest.fixture(scope="session")
def api_key(stack):
    return create_account(stack.env_for("scheduler"), "alice")


@pytest.fixture(scope="session")
def other_api_key(stack):
    return create_account(stack.env_for("scheduler"), "mallory")


@pytest.fixture()
def client(stack, api_key):
    from trainyard import Client

    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=api_key) as c:
        yield c


@pytest.fixture()
def other_client(stack, other_api_key):
    from trainyard import Client

    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=other_api_key) as c:
        yield c


# -- damage --------------------------------------------------------------------------------------------------------
@pytest.fixture()
def flip_byte():
    """Damage a file at rest, as a failing disk would: flip the low bit of its byte at offset (negative: from the
    end). Blobs are read-only files; their mode is restored."""

    def flip(path: Path, offset: int = 0) -> None:
        mode = path.stat().st_mode
        path.chmod(0o644)
        with open(path, "r+b") as f:
            f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
            at = f.tell()
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 1]))
        path.chmod(mode)

    return flip
