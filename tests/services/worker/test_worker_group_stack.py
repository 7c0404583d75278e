"""A managed SFT job on 2 ranks through the platform's own processes: the scheduler and a Celery worker started from
docker-compose.yml (trainyard/localstack.py) on a fresh Postgres database and the test Redis, the worker with
TRAINYARD_MANAGED_NPROC=2 and TRAINYARD_MANAGED_PARALLEL={"dp_shard": 2}.

The job is created and watched through the SDK; rank 1 is killed with SIGKILL once the job has recorded a checkpoint.
The attempt fails (its log says so), the scheduler's reaper retries the job with no help from the test, the second
attempt resumes from the last checkpoint, and the job succeeds with every step recorded once and the same metrics
as the job trained in a worker process (the reference of test_worker_group.py: the same model, dataset and
settings) within the tolerance stated there. About 2 minutes on 2 shared cores.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.conftest import create_account, own_stack
from tests.services.trainer.trainer_helpers import PAIRS, chat_row
from tests.services.worker.test_worker_group import CONFIG, _compare, _wait, reference, world  # noqa: F401
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def group_stack(tmp_path_factory, redis_url, tiny_model_dir):
    env = {"TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_WORKER_LOST_AFTER_S": "6",
           "TRAINYARD_REAPER_INTERVAL_S": "1", "TRAINYARD_SHUTDOWN_GRACE_S": "10",
           "TRAINYARD_TORCH_THREADS": "1", "TRAINYARD_BUILTIN_TINY_MODELS": "false",
           "TRAINYARD_SHARED_MODELS": json.dumps({"tiny-group": str(tiny_model_dir)}),
           "TRAINYARD_MANAGED_NPROC": "2", "TRAINYARD_MANAGED_PARALLEL": '{"dp_shard": 2}'}
    with own_stack(tmp_path_factory.mktemp("group-stack"), redis_url, "trainyard_group", env) as stack:
        yield stack


def test_a_killed_rank_is_retried_by_the_reaper(group_stack, reference):  # noqa: F811
    from trainyard import Client

    key = create_account(group_stack.env_for("scheduler"), "group")
    with Client(url=group_stack.url("scheduler"), api_key=key) as client:
        rows = "".join(json.dumps(chat_row(a, b)) + "\n" for a, b in PAIRS).encode()
        ds, _ = client.upload_dataset(rows, name="chat")
        job = client.create_sft_job("tiny-group", ds.id, "on two ranks", **CONFIG)
        _wait(lambda: client.get_job(job.id).step >= 4 and client.list_checkpoints(job.id), 300,
              "step 4 with a checkpoint")
        pid_file = _wait(lambda: next(group_stack.data_dir.rglob(f"{job.id}-*/group/rank1.pid"), None), 10,
                         "rank 1's pid")
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed_at = time.monotonic()
        done = client.wait_job(job.id, 300)
        logs = [entry.message for entry in client.job_logs(job.id)]
        assert done.status == pb.JOB_STATUS_SUCCEEDED, (done.error, logs)
        assert done.attempts == 2 and done.step == CONFIG["max_steps"]
        assert any(m.startswith("attempt 1 failed: the training group of 2 ranks ended") for m in logs), logs
        assert any(m.startswith("resuming from the checkpoint at step") for m in logs), logs
        metrics = {}
        for point in client.job_metrics(job.id):
            assert point.step not in metrics, f"step {point.step} recorded twice"
            metrics[point.step] = dict(point.values)
        worst = _compare(metrics, reference)
        print(f"through the stack: retried and finished {time.monotonic() - killed_at:.1f} s after the kill; "
              f"worst relative metric difference {worst:.2e}")
