"""Managed RFT jobs through the CLI, the real scheduler, Celery worker (Redis broker) and Postgres: the reward rises in
sync and in async mode (staleness within its bound), an Environment evaluator's multi-turn episodes train and are
recorded, bad settings name their field, and a worker killed mid-job resumes from its last checkpoint with each
step's metrics recorded once, and so does a job whose rollout service is killed (the stack's worker samples RFT jobs
from a deployment of the rollout service)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from tests.integration.data import jsonl
from services.common.channels import auth_metadata
from trainyard import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb, weightsync_pb2, weightsync_pb2_grpc

pytestmark = pytest.mark.integration

# The tiny random-weight model learns to write digits (reward: the share of digit characters) in a few steps.
TASK = ("--model", "tiny-qwen3", "--full-parameter", "--evaluator", "builtin:digit_share", "--lr", "1e-3",
        "--prompts-per-step", "8", "--group-size", "8", "--max-tokens", "4")


@pytest.fixture()
def cli(stack, api_key, tmp_path):
    env = {**os.environ, "TRAINYARD_URL": stack.url("scheduler"), "TRAINYARD_API_KEY": api_key,
           "TRAINYARD_CLIENT_CONFIG": str(tmp_path / "client.json"), "COLUMNS": "200"}

    def run(*args, ok=True):
        proc = subprocess.run([sys.executable, "-m", "trainyard.cli.main", *args], env=env, capture_output=True,
                              text=True, timeout=600)
        if ok:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc
    return run


@pytest.fixture()
def dataset(cli, tmp_path):
    data = tmp_path / "arithmetic.jsonl"
    data.write_bytes(jsonl([{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]))
    out = cli("datasets", "upload", str(data), "--name", "arithmetic").stdout
    assert "rft, 100 rows" in out, out
    return out.split()[1]


def _rewards(cli, job_id: str) -> list[dict]:
    metrics = json.loads(cli("jobs", "metrics", job_id, "--json").stdout)
    return [m for m in metrics if "reward/mean" in m]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rft_job_from_the_cli_raises_the_reward(cli, dataset, mode):
    created = cli("jobs", "create", "--method", "rft", "--dataset", dataset, *TASK, "--steps", "12", "--mode", mode,
                  "--max-staleness", "1", "--checkpoint-every", "6", "--watch")
    assert "succeeded" in created.stdout and "12/12" in created.stdout, created.stdout
    job_id = created.stdout.split("job ")[1].split()[0]
    steps = _rewards(cli, job_id)
    assert [m["step"] for m in steps] == list(range(1, 13))
    first = sum(m["reward/mean"] for m in steps[:3]) / 3
    last = sum(m["reward/mean"] for m in steps[-3:]) / 3
    assert last > first + 0.05, [round(m["reward/mean"], 3) for m in steps]
    stale = [m["staleness/max"] for m in steps]
    if mode == "sync":
        assert set(stale) == {0.0}
    else:
        assert max(stale) == 1.0 and all(m["samples/dropped_stale"] == 0 for m in steps)
    assert all(m["kl/k3_rollout_trainer"] >= 0 and m["rollout/tokens_per_s"] > 0 for m in steps)
    job = json.loads(cli("jobs", "get", job_id).stdout)
    assert job["spec"]["rft"]["mode"] == f"RFT_MODE_{mode.upper()}" and job["output_checkpoint_id"]


def test_rft_settings_are_checked_with_their_field(cli, dataset):
    plan = json.loads(cli("jobs", "plan", "--method", "rft", "--dataset", dataset, *TASK, "--steps", "12",
                          "--checkpoint-every", "5", "--json").stdout)
    assert (plan["total_steps"], plan["checkpoints"], plan["dataset_rows"], plan["steps_per_epoch"]) == \
        ("12", "3", "100", "13")
    assert plan["spec"]["rft"]["evaluator"] == "builtin:digit_share" and plan["spec"]["rft"]["full_parameter"]
    bad = cli("jobs", "create", "--method", "rft", "--dataset", dataset, "--model", "tiny-qwen3", "--evaluator",
              "builtin:nope", "--group-size", "1", "--max-staleness", "0", ok=False)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    for field in ("spec.rft.evaluator", "spec.rft.group_size", "spec.rft.max_staleness"):
        assert field in bad.stderr, bad.stderr
    missing = cli("jobs", "create", "--method", "rft", "--dataset", dataset, "--model", "tiny-qwen3", ok=False)
    assert "spec.rft.evaluator" in missing.stderr and "required" in missing.stderr


def test_rft_worker_killed_mid_job_resumes_without_lost_or_duplicated_steps(stack, client, api_key, cli, dataset):
    created = cli("jobs", "create", "--method", "rft", "--dataset", dataset, *TASK, "--steps", "30", "--mode",
                  "async", "--max-staleness", "2", "--checkpoint-every", "5")
    job_id = created.stdout.split("job ")[1].split()[0]
    deadline = time.monotonic() + 240
    while not any(c.step >= 5 for c in client.list_checkpoints(job_id)):
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    stack.kill("worker")  # SIGKILL: the worker and its rollout process get no chance to report
    assert client.get_job(job_id).status == pb.JOB_STATUS_RUNNING
    stack.start("worker")
    stack.wait_ready("worker")
    done = client.wait_job(job_id, timeout_s=400)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    assert done.attempts == 2 and done.step == 30
    logs = [e.message for e in client.job_logs(job_id)]
    resumed = [m for m in logs if m.startswith("resuming from the checkpoint at step")]
    assert resumed and int(resumed[0].split("step ")[1].split()[0]) >= 5, logs
    assert [m["step"] for m in _rewards(cli, job_id)] == list(range(1, 31))  # each step once
    # The job's lineage (the rollout service's deployment followed it): the second attempt published its restored
    # weights (step k) as the next version, then went on to the final 30.
    k = int(resumed[0].split("step ")[1].split()[0])
    ws = weightsync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(stack.url("weightsync")))
    versions = ws.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=job_id),
                               metadata=auth_metadata(api_key)).versions
    assert [v.version for v in versions] == list(range(1, len(versions) + 1))
    policy = [int(v.metadata["policy_version"]) for v in versions]
    second = len(policy) - 1 - policy[::-1].index(k)  # where the second attempt began
    assert policy[second:] == list(range(k, 31)) and policy[:second] == list(range(second)), policy


def test_rft_rollout_killed_mid_job_the_job_resumes_from_its_checkpoint(stack, client, cli, dataset):
    """kill -9 of the rollout service the job samples from (the stack's worker serves RFT jobs from a deployment of
    it: services/trainer/rl/rollout_service.py), restarted at once: the attempt is handed back, the job is retried
    from its latest checkpoint (republishing its weights as the next version of its lineage), and every step's
    metrics are recorded once."""
    created = cli("jobs", "create", "--method", "rft", "--dataset", dataset, *TASK, "--steps", "20", "--mode",
                  "async", "--max-staleness", "1", "--checkpoint-every", "5")
    job_id = created.stdout.split("job ")[1].split()[0]
    deadline = time.monotonic() + 240
    while not any(c.step >= 5 for c in client.list_checkpoints(job_id)):
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    stack.kill("rollout")
    stack.start("rollout")
    stack.wait_ready("rollout")
    done = client.wait_job(job_id, timeout_s=400)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    assert done.attempts >= 2 and done.step == 20
    logs = [e.message for e in client.job_logs(job_id)]
    resumed = [m for m in logs if m.startswith("resuming from the checkpoint at step")]
    assert resumed and int(resumed[0].split("step ")[1].split()[0]) >= 5, logs
    assert [m["step"] for m in _rewards(cli, job_id)] == list(range(1, 21))  # each step once


ENVIRONMENT = b'''
class Environment:
    """Two turns with a tool: the reward of each answer is its share of digits; the tool fails on rows whose
    first operand is even."""

    def reset(self, row):
        self.row, self.turn = row, 0
        return " tool:"

    def step(self, action):
        self.turn += 1
        if int(self.row["prompt"].split("+")[0]) % 2 == 0:
            raise RuntimeError("the tool is down")
        reward = sum(c.isdigit() for c in action) / max(len(action), 1)
        return " again:", reward, self.turn == 2
'''

DIGITS = b'''
def reward_fn(completion, row):
    if row["answer"] % 7 == 0:
        raise ValueError("no reward for multiples of seven")
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''


def test_rft_job_with_an_uploaded_evaluator_in_the_sandbox(client, cli, dataset):
    """The reward of an uploaded evaluator runs in the sandbox in the worker; its per-row errors are logged and
    score 0, and the job succeeds. A reference the account does not hold is refused at creation, naming the field."""
    missing = cli("jobs", "create", "--method", "rft", "--dataset", dataset, "--model", "tiny-qwen3", "--evaluator",
                  "no-such-evaluator", ok=False)
    assert "INVALID_ARGUMENT" in missing.stderr and "spec.rft.evaluator" in missing.stderr, missing.stderr
    uploaded = client.upload_evaluator(DIGITS, name="digits", filename="evaluator.py")
    task = [a if a != "builtin:digit_share" else f"digits@{uploaded.version}" for a in TASK]
    created = cli("jobs", "create", "--method", "rft", "--dataset", dataset, *task, "--steps", "3", "--watch")
    assert "succeeded" in created.stdout, created.stdout
    job_id = created.stdout.split("job ")[1].split()[0]
    steps = _rewards(cli, job_id)
    assert [m["step"] for m in steps] == [1, 2, 3]
    logs = [e.message for e in client.job_logs(job_id)]
    assert any(m.startswith("reward: evaluator digits@") for m in logs), logs
    errors = [m for m in logs if "reward error" in m]
    assert sum(m["reward/errors"] for m in steps) > 0 and "no reward for multiples of seven" in errors[0], logs

    # A reward_fn scores one completion: more turns are refused at creation (the SDK's keywords this time).
    with pytest.raises(TrainyardError) as exc:
        client.create_rft_job("tiny-qwen3", dataset, "digits", steps=2, max_turns=2)
    assert exc.value.code == "INVALID_ARGUMENT" and "spec.rft.max_turns" in str(exc.value)
    assert "need an Environment evaluator" in str(exc.value)


def test_rft_job_with_a_multi_turn_environment(client, cli, dataset, tmp_path):
    """An Environment evaluator uploaded with the CLI: each sample is an episode of two turns (the policy answers,
    sees the tool's observation, answers again), its reward the sum of the steps'; the rows whose env crashes are
    per-row errors scored 0, logged, and the job succeeds. (The samples record of the episodes:
    tests/services/trainer/test_rl_episodes.py.)"""
    (tmp_path / "evaluator.py").write_bytes(ENVIRONMENT)
    uploaded = cli("evaluators", "upload", str(tmp_path / "evaluator.py"), "--name", "tool-env").stdout
    assert "tool-env@1" in uploaded, uploaded
    task = [a if a != "builtin:digit_share" else "tool-env" for a in TASK]
    task[task.index("--prompts-per-step") + 1] = task[task.index("--group-size") + 1] = "4"
    created = cli("jobs", "create", "--method", "rft", "--dataset", dataset, *task, "--steps", "2", "--max-turns",
                  "2", "--mode", "async", "--watch")
    assert "succeeded" in created.stdout, created.stdout
    job_id = created.stdout.split("job ")[1].split()[0]
    steps = _rewards(cli, job_id)
    assert [m["step"] for m in steps] == [1, 2] and all("train/loss" in m and m["train/lr"] > 0 for m in steps)
    logs = [e.message for e in client.job_logs(job_id)]
    assert any("Environment evaluator tool-env@1" in m and "up to 2 turns" in m for m in logs), logs
    errors = [m for m in logs if "reward error" in m]
    assert sum(m["reward/errors"] for m in steps) > 0 and "step: RuntimeError: the tool is down" in errors[0], logs
    for m in steps:  # 16 episodes a step: the failing ones end after one action, the others after two (done)
        failed = m["reward/errors"] / 16
        assert m["episode/turns_mean"] == pytest.approx(2 - failed) and m["episode/done"] == pytest.approx(1 - failed)
    job = json.loads(cli("jobs", "get", job_id).stdout)
    assert job["spec"]["rft"]["max_turns"] == 2 and job["output_checkpoint_id"]


def test_rft_job_cancelled_within_seconds(client, dataset):
    job = client.create_rft_job("tiny-qwen3", dataset, "builtin:digit_share", steps=100000, full_parameter=True,
                                prompts_per_step=4, group_size=4, max_tokens=4, mode="async")
    deadline = time.monotonic() + 120
    while client.get_job(job.id).step < 2:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    t0 = time.monotonic()
    client.cancel_job(job.id)
    while (done := client.get_job(job.id)).status not in (pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_FAILED):
        assert time.monotonic() - t0 < 30, "not cancelled"
        time.sleep(0.2)
    assert done.status == pb.JOB_STATUS_CANCELLED, done.error
    assert time.monotonic() - t0 < 10
