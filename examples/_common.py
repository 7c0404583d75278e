"""What the Training API examples share: where the services are, and a few small helpers.

By default an example starts its own embedded stack, as `trainyard demo` does: the tiny model is built locally (no
download) and registered as the shared model "tiny-qwen3", and the scheduler, trainer, rollout and weight-sync
services of docker-compose.yml run as local processes on the embedded defaults (SQLite, files under a temporary work
directory, one torch thread each), with a fresh account. They stop when the example ends.

With TRAINYARD_TRAINER_URL set, an example uses that running stack instead, as any ServiceClient() would:
TRAINYARD_API_KEY (or the file `trainyard login` writes) is the key, TRAINYARD_ROLLOUT_URL the rollout's address
(default 127.0.0.1:50053), and the base model is "tiny-qwen3" unless --base-model names another one (the scheduler
registers the tiny model unless its builtin_tiny_models setting is off).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard import ServiceClient

SERVICES = ("scheduler", "trainer", "rollout", "weightsync")
BASE_MODEL = "tiny-qwen3"
EXAMPLES = Path(__file__).resolve().parent


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="training steps")
    p.add_argument("--seed", type=int, default=0, help="random seed (initial weights, data split, sampling)")
    p.add_argument("--base-model", default=BASE_MODEL, help="the model to train")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the embedded stack keeps its data and logs, under volumes/ and logs/ (default: a "
                        "temporary directory, removed at the end); unused with TRAINYARD_TRAINER_URL")
    return p


@contextmanager
def service_client(work_dir: Path | None = None) -> Iterator[ServiceClient]:
    """A ServiceClient on the stack named by the environment (TRAINYARD_TRAINER_URL set), else on an embedded stack
    started here and stopped on exit."""
    if os.environ.get("TRAINYARD_TRAINER_URL"):
        with ServiceClient() as service:
            print(f"using the stack at {service.config.trainer_url} (rollout {service.config.rollout_url})")
            yield service
        return
    with _embedded_stack(work_dir) as (trainer_url, rollout_url, api_key):
        with ServiceClient(base_url=trainer_url, api_key=api_key, rollout_url=rollout_url) as service:
            yield service


@contextmanager
def _embedded_stack(work_dir: Path | None) -> Iterator[tuple[str, str, str]]:
    from models.tiny import build_tiny_model
    from services.common.auth import create_account
    from services.common.config import TrainyardSettings
    from services.common.db import Database, migrate
    from trainyard.localstack import Stack

    t0 = time.monotonic()
    temporary = work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="trainyard-example-")) if temporary else work_dir.absolute()
    for old in ("volumes", "logs"):  # a previous run's stack in the same work directory (nothing else is touched)
        shutil.rmtree(work_dir / old, ignore_errors=True)
    stack = Stack(work_dir, database_url=None, broker_url=None, extra_env={
        "TRAINYARD_TORCH_THREADS": os.environ.get("TRAINYARD_TORCH_THREADS", "1"), "TRAINYARD_LOG_LEVEL": "WARNING"})
    model_dir = build_tiny_model(stack.data_dir / "models" / BASE_MODEL)
    # Register just this model (the scheduler would otherwise build the tiny model of every family).
    stack.extra_env.update({"TRAINYARD_BUILTIN_TINY_MODELS": "false",
                            "TRAINYARD_SHARED_MODELS": json.dumps({BASE_MODEL: str(model_dir)})})
    # database_url "": SQLite under data_dir, even where the environment names another database.
    settings = TrainyardSettings(data_dir=stack.data_dir, database_url="")
    settings.ensure_dirs()
    migrate(settings.database_url)
    db = Database(settings.database_url)
    _, _, api_key = create_account(db, "examples")
    db.dispose()
    failed = False
    try:
        stack.up(*SERVICES)
        print(f"embedded stack up in {time.monotonic() - t0:.0f}s: trainer {stack.url('trainer')}, rollout "
              f"{stack.url('rollout')}, tiny model built at {model_dir}")
        yield stack.url("trainer"), stack.url("rollout"), api_key
    except BaseException:
        failed = True
        raise
    finally:
        stack.down()
        if failed or not temporary:
            print(f"service logs: {stack.log_dir}")
        if temporary and not failed:
            shutil.rmtree(work_dir, ignore_errors=True)


class Timer:
    """Seconds since it was made; str() gives them rounded, e.g. '12s'."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.t0

    def __str__(self) -> str:
        return f"{self.seconds:.0f}s"
