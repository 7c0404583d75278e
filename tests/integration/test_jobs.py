"""Managed SFT jobs through the real scheduler, Celery worker (Redis broker) and Postgres."""
from __future__ import annotations

import time

import grpc
import pytest

from tests.integration.data import chat_rows, jsonl
from trainyard import TrainyardError
from trainyard.client import status_name
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = pytest.mark.integration

FAST = dict(learning_rate=3e-3, batch_size=4, eval_fraction=0.2)


@pytest.fixture()
def dataset(client):
    ds, _ = client.upload_dataset(jsonl(chat_rows(16)), name="addition")
    return ds


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.parametrize("kwargs, field", [
    (dict(learning_rate=-1.0), "spec.sft.learning_rate"),
    (dict(lora_rank=0), "spec.sft.lora.rank"),
    (dict(batch_size=0), "spec.sft.batch_size"),
    (dict(eval_fraction=0.9), "spec.sft.eval_fraction"),
    (dict(lora_dropout=1.5), "spec.sft.lora.dropout"),
    (dict(target_modules=["not_a_module"]), "spec.sft.lora.target_modules"),
    (dict(max_seq_len=100000), "spec.sft.max_seq_len"),
], ids=["negative-lr", "rank-0", "batch-0", "eval-fraction", "dropout", "targets", "context"])
def test_invalid_hyperparameters_store_nothing(client, dataset, kwargs, field):
    before = len(client.list_jobs())
    with pytest.raises(TrainyardError) as exc:
        client.create_sft_job("tiny-qwen3", dataset.id, **kwargs)
    assert exc.value.code == "INVALID_ARGUMENT"
    assert field in [v.field for v in exc.value.violations], exc.value.violations
    with pytest.raises(TrainyardError) as planned:  # PlanJob runs the same checks
        client.plan_job("sft", "tiny-qwen3", dataset.id, **kwargs)
    assert (planned.value.code, planned.value.violations) == (exc.value.code, exc.value.violations)
    assert len(client.list_jobs()) == before


def test_unknown_base_model_and_wrong_dataset_kind(client, dataset):
    before = len(client.list_jobs())
    with pytest.raises(TrainyardError) as exc:
        client.create_sft_job("no-such-model", dataset.id)
    assert exc.value.code == "INVALID_ARGUMENT" and "unknown base model 'no-such-model'" in exc.value.message
    dpo, _ = client.upload_dataset(jsonl([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    with pytest.raises(TrainyardError) as exc:
        client.create_sft_job("tiny-qwen3", dpo.id)
    assert exc.value.code == "INVALID_ARGUMENT" and "dpo" in exc.value.message
    with pytest.raises(TrainyardError) as exc:
        client.create_sft_job("tiny-qwen3", "ds_missing")
    assert exc.value.code == "NOT_FOUND"
    assert len(client.list_jobs()) == before


def test_unknown_enum_values_are_rejected(client, dataset):
    bad = pb.JobSpec(method=pb.JOB_METHOD_SFT, base_model="tiny-qwen3", dataset_id=dataset.id,
                     sft=pb.SftConfig(lr_scheduler=99))
    for call, request in ((client.jobs.CreateJob, pb.CreateJobRequest(spec=bad)),
                          (client.jobs.PlanJob, pb.PlanJobRequest(spec=bad))):
        with pytest.raises(grpc.RpcError) as exc:
            call(request, metadata=client._md)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.sft.lr_scheduler" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        client.jobs.ListJobs(pb.ListJobsRequest(status=42), metadata=client._md)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "status" in exc.value.details()


def test_unknown_job_id_is_not_found(client):
    for call in (client.get_job, client.cancel_job, client.job_metrics, client.list_checkpoints, client.job_logs):
        with pytest.raises(TrainyardError) as exc:
            call("job_doesnotexist")
        assert exc.value.code == "NOT_FOUND"
    with pytest.raises(TrainyardError) as exc:
        list(client.watch_job("job_doesnotexist"))
    assert exc.value.code == "NOT_FOUND"


def test_job_runs_to_success_with_streamed_metrics_and_checkpoints(client, other_client, dataset):
    plan = client.plan_job("sft", "tiny-qwen3", dataset.id, max_steps=12, checkpoint_every=5, **FAST)
    job = client.create_sft_job("tiny-qwen3", dataset.id, "addition", max_steps=12, checkpoint_every=5, **FAST)
    assert (job.spec.sft, job.spec.base_model) == (plan.spec.sft, plan.spec.base_model)  # the same resolved settings
    assert job.status == pb.JOB_STATUS_QUEUED
    statuses, metrics, logs = [], [], []
    for ev in client.watch_job(job.id):
        if ev.HasField("job"):
            if not statuses or statuses[-1] != ev.job.status:
                statuses.append(ev.job.status)
        elif ev.HasField("metric"):
            metrics.append(ev.metric)
        else:
            logs.append(ev.log.message)
    assert statuses[0] in (pb.JOB_STATUS_QUEUED, pb.JOB_STATUS_RUNNING) and statuses[-1] == pb.JOB_STATUS_SUCCEEDED
    # Status snapshots are polled, so a short job may go from queued to succeeded between two of them; the log
    # records every transition.
    assert any(line.startswith("started on worker") for line in logs), logs
    steps = sorted({m.step for m in metrics if "train/loss" in m.values})
    assert steps == list(range(1, 13))
    assert any("eval/loss" in m.values for m in metrics)
    assert any("checkpoint saved at step 5" in line for line in logs)
    assert f"training: 12 steps (train examples {plan.train_rows}, eval examples {plan.eval_rows}, trainable params " \
           f"{plan.trainable_parameters})" in logs, logs

    done = client.get_job(job.id)
    assert (done.step, done.total_steps, done.attempts) == (12, 12, 1)
    assert done.started_at.seconds and done.finished_at.seconds and done.error == ""
    assert done.finished_at.ToDatetime() >= done.started_at.ToDatetime() >= done.created_at.ToDatetime()
    persisted = client.job_metrics(job.id)
    assert [p.step for p in persisted if "train/loss" in p.values] == list(range(1, 13))
    ckpts = client.list_checkpoints(job.id)
    assert [c.step for c in ckpts] == [5, 10, 12] and ckpts[-1].final and ckpts[-1].id == done.output_checkpoint_id
    assert (plan.total_steps, plan.checkpoints) == (done.total_steps, len(ckpts))
    assert {f.path for f in ckpts[-1].files} == {"adapter_config.json", "adapter_model.safetensors"}
    log = client.job_logs(job.id)
    assert log[0].message == "queued" and log[-1].message == "succeeded after 12 steps"
    assert [e.id for e in client.job_logs(job.id, after_id=log[-3].id)] == [e.id for e in log[-2:]]
    # Watching a finished job replays its history and ends.
    replay = list(client.watch_job(job.id, from_step=10))
    assert {e.metric.step for e in replay if e.HasField("metric")} >= {10, 11, 12}
    with pytest.raises(TrainyardError) as exc:
        other_client.get_job(job.id)
    assert exc.value.code == "NOT_FOUND"
    with pytest.raises(TrainyardError) as exc:
        client.cancel_job(job.id)
    assert exc.value.code == "FAILED_PRECONDITION"


def test_cancel_running_job_within_seconds(client, dataset):
    job = client.create_sft_job("tiny-qwen3", dataset.id, max_steps=100000, checkpoint_every=100000, **FAST)
    wait_until(lambda: client.get_job(job.id).step >= 2, 120, "the job to make progress")
    t0 = time.monotonic()
    client.cancel_job(job.id)
    done = wait_until(lambda: (j := client.get_job(job.id)).status in
                      (pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_FAILED) and j, 30, "cancellation")
    elapsed = time.monotonic() - t0
    assert done.status == pb.JOB_STATUS_CANCELLED, status_name(done.status)
    assert elapsed < 10, f"cancellation took {elapsed:.1f}s"
    assert done.finished_at.seconds
    assert client.cancel_job(job.id).status == pb.JOB_STATUS_CANCELLED  # cancelling again is harmless


def test_cancel_queued_job(stack, client, dataset):
    stack.stop("worker")
    try:
        job = client.create_sft_job("tiny-qwen3", dataset.id, max_steps=5, **FAST)
        cancelled = client.cancel_job(job.id)
        assert cancelled.status == pb.JOB_STATUS_CANCELLED and cancelled.finished_at.seconds
    finally:
        stack.start("worker")
        stack.wait_ready("worker")
    # The message still in the broker is consumed without running the job.
    time.sleep(2)
    assert client.get_job(job.id).status == pb.JOB_STATUS_CANCELLED
    assert client.get_job(job.id).attempts == 0


def test_worker_killed_mid_job_is_retried_and_resumes_from_checkpoint(stack, client, dataset):
    job = client.create_sft_job("tiny-qwen3", dataset.id, max_steps=40, checkpoint_every=5, **FAST)
    wait_until(lambda: any(c.step >= 5 for c in client.list_checkpoints(job.id)), 180, "a checkpoint")
    stack.kill("worker")  # SIGKILL: no chance to clean up or report
    killed_at = client.get_job(job.id)
    assert killed_at.status == pb.JOB_STATUS_RUNNING
    stack.start("worker")
    stack.wait_ready("worker")
    done = client.wait_job(job.id, timeout_s=300)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    assert done.attempts == 2 and done.step == 40
    logs = [e.log.message for e in client.watch_job(job.id) if e.HasField("log")]
    assert any("stopped responding; retrying (attempt 2" in m for m in logs), logs
    resumed = [m for m in logs if m.startswith("resuming from the checkpoint at step")]
    assert resumed, logs
    resumed_step = int(resumed[0].split("step ")[1].split()[0])
    assert resumed_step >= 5
    # Steps after the resume point were computed again; every step has exactly one latest value.
    steps = [p.step for p in client.job_metrics(job.id) if "train/loss" in p.values]
    assert sorted(steps) == list(range(1, 41))  # each step once: the lost attempt's later points were discarded


def test_resume_a_cancelled_job_continues_from_its_latest_checkpoint(client, other_client, dataset):
    job = client.create_sft_job("tiny-qwen3", dataset.id, max_steps=40, checkpoint_every=5, **FAST)
    wait_until(lambda: any(c.step >= 5 for c in client.list_checkpoints(job.id)), 180, "a checkpoint")
    with pytest.raises(TrainyardError) as exc:
        client.resume_job(job.id)
    assert exc.value.code == "FAILED_PRECONDITION" and "only a failed or cancelled job" in exc.value.message
    client.cancel_job(job.id)
    cancelled = client.wait_job(job.id, timeout_s=60)
    assert cancelled.status == pb.JOB_STATUS_CANCELLED, status_name(cancelled.status)
    latest = max(client.list_checkpoints(job.id), key=lambda c: c.step)
    with pytest.raises(TrainyardError) as exc:
        other_client.resume_job(job.id)
    assert exc.value.code == "NOT_FOUND"

    resumed = client.resume_job(job.id)
    assert resumed.status in (pb.JOB_STATUS_QUEUED, pb.JOB_STATUS_RUNNING) and resumed.id == job.id
    assert not resumed.cancel_requested and not resumed.finished_at.seconds
    done = client.wait_job(job.id, timeout_s=300)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    assert (done.step, done.attempts) == (40, 2) and done.output_checkpoint_id
    logs = [e.message for e in client.job_logs(job.id)]
    assert f"resumed: queued again, to continue from the checkpoint at step {latest.step} ({latest.id})" in logs
    assert f"resuming from the checkpoint at step {latest.step} ({latest.id})" in logs
    steps = [p.step for p in client.job_metrics(job.id) if "train/loss" in p.values]
    assert sorted(steps) == list(range(1, 41))  # the cancelled attempt's points after the checkpoint were dropped
    with pytest.raises(TrainyardError) as exc:
        client.resume_job(job.id)
    assert exc.value.code == "FAILED_PRECONDITION" and "is succeeded" in exc.value.message


def test_the_scheduler_process_never_loads_torch(stack, client, dataset):
    """CreateJob's checks (the model directory, LoRA targets against the architecture), uploads, the built-in
    models' registration and PlanJob (its numbers come from a child process) all run in a scheduler process that
    never maps torch's library."""
    plan = client.plan_job("sft", "tiny-qwen3-moe", dataset.id, max_steps=1, target_modules=["q_proj", "experts"])
    assert plan.total_steps == 1 and plan.trainable_parameters > 0
    job = client.create_sft_job("tiny-qwen3-moe", dataset.id, max_steps=1, target_modules=["q_proj", "experts"])
    with pytest.raises(TrainyardError) as exc:
        client.create_sft_job("tiny-qwen3-moe", dataset.id, target_modules=["q_a_proj"])
    assert exc.value.code == "INVALID_ARGUMENT" and "q_a_proj" in str(exc.value)
    client.cancel_job(job.id)
    maps = open(f"/proc/{stack.procs['scheduler'].popen.pid}/maps").read()
    assert "libtorch" not in maps
