"""Managed DPO jobs through the platform's own processes: the scheduler and a Celery worker started from
docker-compose.yml (trainyard/localstack.py) on a fresh Postgres database and the test Redis, the tiny model shared
as "tiny-dpo". Jobs are created through the SDK and the CLI: a LoRA job and a full-parameter job succeed with their
metrics and checkpoints recorded, bad requests are INVALID_ARGUMENT naming the field, and a worker killed with
SIGKILL mid-job is retried by the reaper and resumes from its last checkpoint (reference logprobs read from it, not
computed again) with every step's metrics recorded once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import create_account, own_stack
from tests.services.trainer.trainer_helpers import PAIRS, chat_row, preference_row
from trainyard import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = [pytest.mark.integration]

MODEL = "tiny-dpo"
FAST = dict(learning_rate=2e-3, batch_size=4, eval_fraction=0.2, max_seq_len=64, beta=0.2)
ROWS = [preference_row(a, b) for a, b in PAIRS + [(b, a) for a, b in PAIRS]]  # 20 pairs: 16 train, 4 held out


@pytest.fixture(scope="module")
def dpo_stack(tmp_path_factory, redis_url, tiny_model_dir):
    env = {"TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_WORKER_LOST_AFTER_S": "6",
           "TRAINYARD_REAPER_INTERVAL_S": "1", "TRAINYARD_SHUTDOWN_GRACE_S": "3",
           "TRAINYARD_TORCH_THREADS": "1", "TRAINYARD_BUILTIN_TINY_MODELS": "false",
           "TRAINYARD_SHARED_MODELS": json.dumps({MODEL: str(tiny_model_dir)})}
    with own_stack(tmp_path_factory.mktemp("dpo-stack"), redis_url, "trainyard_dpo", env) as stack:
        yield stack


@pytest.fixture(scope="module")
def dpo_key(dpo_stack):
    return create_account(dpo_stack.env_for("scheduler"), "dpo")


@pytest.fixture()
def client(dpo_stack, dpo_key):
    from trainyard import Client

    with Client(url=dpo_stack.url("scheduler"), api_key=dpo_key) as c:
        yield c


@pytest.fixture(scope="module")
def pairs_id(dpo_stack, dpo_key):
    from trainyard import Client

    with Client(url=dpo_stack.url("scheduler"), api_key=dpo_key) as c:
        ds, _ = c.upload_dataset("".join(json.dumps(r) + "\n" for r in ROWS).encode(), name="pairs")
    assert ds.format == pb.DATASET_FORMAT_DPO
    return ds.id


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _step_metrics(client, job_id: str) -> dict[int, dict[str, float]]:
    """The job's recorded metrics by step, each step's point asserted to be recorded once."""
    out = {}
    for point in client.job_metrics(job_id):
        assert point.step not in out, f"step {point.step} recorded twice"
        out[point.step] = dict(point.values)
    return out


def test_lora_and_full_parameter_jobs_succeed_with_metrics_and_checkpoints(client, pairs_id):
    plan = client.plan_job("dpo", MODEL, pairs_id, max_steps=8, checkpoint_every=4, **FAST)
    assert (plan.train_rows, plan.eval_rows, plan.total_steps, plan.checkpoints) == (16, 4, 8, 2)
    job = client.create_dpo_job(MODEL, pairs_id, "prefer sums", max_steps=8, checkpoint_every=4, **FAST)
    assert job.spec.method == pb.JOB_METHOD_DPO and job.spec.dpo == plan.spec.dpo
    assert (job.spec.dpo.beta, job.spec.dpo.full_parameter, job.spec.dpo.label_smoothing) == (0.2, False, 0.0)
    done = client.wait_job(job.id, 300)
    logs = [entry.message for entry in client.job_logs(job.id)]
    assert done.status == pb.JOB_STATUS_SUCCEEDED, (done.error, logs)
    assert (done.step, done.total_steps, done.attempts) == (8, 8, 1)
    assert sum(m.startswith("reference logprobs of 20 pairs computed") for m in logs) == 1, logs
    metrics = _step_metrics(client, job.id)
    assert sorted(metrics) == list(range(1, 9))
    assert all({"train/loss", "train/reward_margin", "train/reward_accuracy", "train/chosen_reward",
                "train/rejected_reward", "train/lr", "train/grad_norm"} <= m.keys() for m in metrics.values())
    assert {"eval/loss", "eval/reward_margin", "eval/reward_accuracy"} <= metrics[8].keys()
    assert metrics[8]["eval/reward_margin"] > 0 and metrics[8]["train/loss"] < metrics[1]["train/loss"]
    ckpts = client.list_checkpoints(job.id)
    assert [c.step for c in ckpts] == [4, 8] and ckpts[-1].final and ckpts[-1].id == done.output_checkpoint_id
    assert ckpts[-1].kind == pb.CHECKPOINT_KIND_LORA_ADAPTER
    assert {f.path for f in ckpts[-1].files} == {"adapter_config.json", "adapter_model.safetensors"}

    full = client.create_dpo_job(MODEL, pairs_id, "full", max_steps=2, full_parameter=True,
                                 **{**FAST, "learning_rate": 1e-4})
    done = client.wait_job(full.id, 300)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    assert done.spec.dpo.full_parameter
    (final,) = client.list_checkpoints(full.id)
    assert final.final and final.kind == pb.CHECKPOINT_KIND_FULL
    assert {"config.json", "model.safetensors"} <= {f.path for f in final.files}
    assert sorted(_step_metrics(client, full.id)) == [1, 2]


def test_bad_requests_name_the_field(client, pairs_id):
    before = len(client.list_jobs())
    sft_rows, _ = client.upload_dataset("".join(json.dumps(chat_row(a, b)) + "\n" for a, b in PAIRS).encode())
    for dataset, settings, field in ((sft_rows.id, {}, "spec.dataset_id"),
                                     (pairs_id, {"beta": 0.0}, "spec.dpo.beta"),
                                     (pairs_id, {"beta": -1.0}, "spec.dpo.beta"),
                                     (pairs_id, {"label_smoothing": 0.5}, "spec.dpo.label_smoothing"),
                                     (pairs_id, {"lora_rank": 0}, "spec.dpo.lora.rank"),
                                     (pairs_id, {"max_seq_len": 10**6}, "spec.dpo.max_seq_len")):
        for call in (client.create_dpo_job, lambda *a, **k: client.plan_job("dpo", *a, **k)):
            with pytest.raises(TrainyardError) as exc:
                call(MODEL, dataset, **settings)
            assert exc.value.code == "INVALID_ARGUMENT", exc.value
            assert field in [v.field for v in exc.value.violations], exc.value.violations
    with pytest.raises(TrainyardError) as exc:
        client.create_dpo_job(MODEL, sft_rows.id)
    assert "sft_chat format; dpo needs dpo rows" in exc.value.message
    assert len(client.list_jobs()) == before


def test_worker_killed_mid_job_resumes_from_its_checkpoint(dpo_stack, client, pairs_id):
    job = client.create_dpo_job(MODEL, pairs_id, max_steps=150, checkpoint_every=10, **FAST)
    # past a checkpoint by a few steps, so the killed attempt has recorded metrics the retry must replace
    _wait(lambda: client.get_job(job.id).step >= 14 and any(c.step >= 10 for c in client.list_checkpoints(job.id)),
          180, "a checkpoint and a few steps more")
    dpo_stack.kill("worker")  # SIGKILL: no chance to clean up or report
    killed_at = client.get_job(job.id)
    assert killed_at.status == pb.JOB_STATUS_RUNNING, "the job ended before the kill; make it longer"
    dpo_stack.start("worker")
    dpo_stack.wait_ready("worker")
    done = client.wait_job(job.id, 300)
    logs = [entry.message for entry in client.job_logs(job.id)]
    assert done.status == pb.JOB_STATUS_SUCCEEDED, (done.error, logs)
    assert done.attempts == 2 and done.step == 150
    resumed = [m for m in logs if m.startswith("resuming from the checkpoint at step")]
    assert resumed, logs
    resumed_step = int(resumed[0].split("step ")[1].split()[0])
    print(f"killed at step {killed_at.step}, resumed from the checkpoint at step {resumed_step}")
    assert 10 <= resumed_step < killed_at.step and resumed_step % 10 == 0
    assert f"resumed at step {resumed_step} of 150 (reference logprobs from the checkpoint)" in logs, logs
    assert sum(m.startswith("reference logprobs of 20 pairs computed") for m in logs) == 1, logs  # attempt 1 only
    metrics = _step_metrics(client, job.id)  # each step once: the lost attempt's later points were discarded
    assert sorted(metrics) == list(range(1, 151))
    assert [c.step for c in client.list_checkpoints(job.id)] == list(range(10, 151, 10))


def test_cli_creates_a_dpo_job(dpo_stack, dpo_key, pairs_id, tmp_path):
    env = {**os.environ, "TRAINYARD_URL": dpo_stack.url("scheduler"), "TRAINYARD_API_KEY": dpo_key,
                  "TRAINYARD_CLIENT_CONFIG": str(tmp_path / "client.json"), "COLUMNS": "200"}

    def cli(*args, ok=True):
        proc = subprocess.run([sys.executable, "-m", "trainyard.cli.main", *args], env=env, capture_output=True,
                              text=True, timeout=600)
        if ok:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    target = ("--model", MODEL, "--dataset", pairs_id)
    assert "--beta" in cli("jobs", "create", "--help").stdout
    rejected = cli("jobs", "plan", "--method", "dpo", *target, "--beta", "0", ok=False)
    assert rejected.returncode == 1 and "--beta (spec.dpo.beta)" in rejected.stderr, rejected.stderr
    alien = cli("jobs", "create", "--method", "sft", *target, "--beta", "0.2", ok=False)
    assert alien.returncode == 2 and "--beta: not a setting of sft jobs" in alien.stderr, alien.stderr
    created = cli("jobs", "create", "--method", "dpo", *target, "--beta", "0.2", "--full-parameter", "--max-steps",
                  "2", "--lr", "1e-4", "--max-seq-len", "64", "--watch")
    assert "succeeded" in created.stdout and "2/2" in created.stdout, created.stdout
    job_id = created.stdout.split("job ")[1].split()[0]
    job = json.loads(cli("jobs", "get", job_id).stdout)
    assert job["spec"]["method"] == "JOB_METHOD_DPO", job["spec"]
    assert (job["spec"]["dpo"]["beta"], job["spec"]["dpo"]["full_parameter"]) == (0.2, True)
