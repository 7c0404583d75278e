"""Loop jobs end to end on the tiny model: two iterations of SFT on two datasets, every checkpoint scored on a held-out
rft set by an evaluator uploaded through the API (in its sandbox), the best deployed under one stable name (created
by iteration 0, re-pointed by iteration 1 and sampled through the rollout), per-iteration metrics recorded; a worker
lost after iteration 0 is resumed by the next attempt without redoing it; bad requests name their field."""
from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from services.common.blobstore import BlobStore
from services.common.errors import InvalidArgument
from services.common.ledger import Ledger
from services.common.schema import Checkpoint, Deployment, Job, JobMetric
from services.evaluators.store import EvaluatorStore
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.jobs import JobCore, NewJob
from tests.services.common.inprocess import Platform
from trainyard import Client, TrainyardError
from trainyard.v1 import rollout_pb2, rollout_pb2_grpc
from trainyard.v1 import scheduler_pb2 as pb

EVALUATOR = b"""
def reward_fn(completion, row):
    return 1.0 if row["answer"] in completion else len(completion) % 3 / 3
"""
RFT_ROWS = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}).encode() + b"\n" for a, b in
            [(1, 2), (3, 4), (5, 6)]]


def _chat(user: str, assistant: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": user},
                                    {"role": "assistant", "content": assistant}]}).encode() + b"\n"


@pytest.fixture()
def platform(tmp_path, tiny_model_dir):
    p = Platform(tmp_path / "platform", tiny_model_dir)
    store = DatasetStore(p.db, BlobStore(p.root / "blobs"), 1 << 20)
    alice = p.accounts["alice"]
    p.rft = store.upload(alice, UploadHeader("held-out", "rft", ""), iter(RFT_ROWS))[0].id
    p.train = [store.upload(alice, UploadHeader(f"round-{n}", None, ""), iter(rows))[0].id for n, rows in enumerate((
        [_chat(f"{a}+{b}=", str(a + b)) for a, b in [(1, 2), (3, 4), (5, 6), (2, 2)]],
        [_chat(f"what is {a}+{b}?", f"{a}+{b}={a + b}") for a, b in [(1, 1), (3, 3), (5, 5), (4, 4)]]))]
    p.core = JobCore(p.db, Ledger(p.db), lambda job_id: None, 0.05, threading.Event())
    EvaluatorStore(p.db, BlobStore(p.root / "blobs")).upload(alice, "sum-check", "evaluator.py", EVALUATOR)
    yield p
    p.close()


LOOP = dict(training_method="sft", max_steps=2, checkpoint_every=1, learning_rate=0.05, eval_fraction=0.0,
            lora_rank=4, evaluator="sum-check", samples_per_row=2, max_tokens=6, deployment="loop-best")


def _worker(platform, host: str):
    from services.worker.settings import WorkerSettings

    return WorkerSettings(data_dir=platform.root, database_url=f"sqlite:///{platform.root / 'trainyard.db'}",
                          heartbeat_s=0.2, torch_threads=1, worker_host=host, cpu_slots=2,
                          scheduler_url=platform.url("scheduler"), rollout_url=platform.url("rollout"))


def _points(platform, job_id: str) -> list[JobMetric]:
    with platform.db.session() as s:
        return list(s.scalars(select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step,
                                                                                            JobMetric.id)))


def test_loop_requests_are_checked_by_field(platform):
    alice = platform.accounts["alice"]

    def problems(config: dict) -> set[str]:
        with pytest.raises(InvalidArgument) as err:
            platform.core.create(alice, NewJob("loop", "tiny", platform.rft, "", config))
        return {v.field for v in err.value.violations}

    assert problems({}) == {"spec.loop.eval.evaluator", "spec.loop.deployment", "spec.loop.train_datasets"}
    good = dict(LOOP, train_datasets=platform.train)
    assert problems(dict(good, train_datasets=[platform.train[0], platform.rft, "ds_nope"])) == {
        "spec.loop.train_datasets[1]", "spec.loop.train_datasets[2]"}
    assert problems(dict(good, beta=0.5, samples_per_row=0, lora_rank=0, checkpoint_id="ckpt_x")) == {
        "spec.loop.training.beta", "spec.loop.eval.samples_per_row", "spec.loop.training.lora.rank",
        "spec.loop.eval.checkpoint_id"}
    assert problems(dict(good, training_method="dpo")) == {"spec.loop.train_datasets[0]",
                                                           "spec.loop.train_datasets[1]"}  # chat rows, not pairs
    with platform.db.session() as s:  # a name in use (here by a lineage deployment) is not the loop's to take
        s.add(Deployment(id="dep_taken", account_id=alice, name="taken", lineage="some-session", base_model="tiny"))
    assert problems(dict(good, deployment="taken")) == {"spec.loop.deployment"}
    job = platform.core.create(alice, NewJob("loop", "tiny", platform.rft, "", good))
    assert (job.trainer_devices, job.rollout_devices) == (1, 1)

    from trainyard.cli.main import cli

    args = ["--url", platform.url("scheduler"), "--api-key", platform.keys["alice"], "jobs", "create", "--method",
            "loop", "--model", "tiny", "--dataset", platform.rft, "--train-dataset", platform.train[0],
            "--train-dataset", platform.train[1], "--evaluator", "sum-check", "--deployment", "loop-best", "--k", "3",
            "--max-steps", "2", "--lr", "0.01", "--checkpoints-per-iteration", "1"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        spec = c.get_job(out.output.split("job ")[1].split()[0]).spec
    assert spec.method == pb.JOB_METHOD_LOOP and spec.WhichOneof("config") == "loop"
    assert list(spec.loop.train_datasets) == platform.train and spec.loop.deployment == "loop-best"
    assert (spec.loop.training.max_steps, spec.loop.training.learning_rate, spec.loop.eval.samples_per_row,
            spec.loop.checkpoints_per_iteration, spec.loop.training_method) == (2, 0.01, 3, 1, "sft")


def test_a_loop_trains_evaluates_deploys_the_best_and_continues_from_it(platform, flip_byte):
    from services.worker.job import run_managed_job

    alice = platform.accounts["alice"]
    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        job = c.create_job("loop", "tiny", platform.rft, train_datasets=platform.train, **LOOP)
    # The first worker is lost once iteration 0 is recorded (its lease expires and the reaper requeues the job);
    # the next attempt resumes: iteration 0 is not trained, evaluated or deployed again.
    first = threading.Thread(target=run_managed_job, args=(job.id, _worker(platform, "loop-a")))
    first.start()
    ledger, deadline = Ledger(platform.db), time.monotonic() + 120
    while not any("loop/iterations_done" in p.data for p in _points(platform, job.id)):
        assert first.is_alive() and time.monotonic() < deadline, "iteration 0 was not recorded"
        time.sleep(0.05)
    with platform.db.session() as s:
        dep0 = s.scalar(select(Deployment).where(Deployment.name == "loop-best", Deployment.deleted_at.is_(None)))
        s.get(Job, job.id).heartbeat_at = s.get(Job, job.id).heartbeat_at.replace(year=2000)
    assert ledger.reap(lost_after_s=1, max_attempts=3) == [job.id]
    first.join(timeout=120)
    assert not first.is_alive()
    run_managed_job(job.id, _worker(platform, "loop-b"))

    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        done = c.get_job(job.id)
        logs = [e.message for e in c.job_logs(job.id)]
    assert done.status == pb.JOB_STATUS_SUCCEEDED, (done.error, logs)
    assert done.attempts == 2
    assert any(m.startswith("resuming the loop after 1 of 2 iterations") for m in logs), logs
    with platform.db.session() as s:
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)))
        dep = s.scalar(select(Deployment).where(Deployment.account_id == alice, Deployment.name == "loop-best",
                                                Deployment.deleted_at.is_(None)))
    # Two iterations of two steps, a checkpoint at each: the job's steps 1, 2 (iteration 0) and 3, 4 (iteration 1).
    assert [(c.step, c.final) for c in ckpts] == [(1, False), (2, True), (3, False), (4, True)]
    m = dict(done.latest_metrics)
    assert (m["loop/iteration"], m["loop/iterations_done"]) == (1.0, 2.0)
    points = _points(platform, job.id)
    scored = {p.step: p.data for p in points if "loop/checkpoint_reward_mean" in p.data}
    assert sorted(scored) == [1, 2, 3, 4]  # every checkpoint evaluated once, by one attempt or the other
    assert sum("loop/checkpoint_reward_mean" in p.data for p in points) == 4
    for i, steps in ((0, (1, 2)), (1, (3, 4))):
        best = max(steps, key=lambda st: (scored[st]["loop/checkpoint_reward_mean"], st))  # ties: the later
        assert m[f"iteration/{i}/best_step"] == best and m[f"iteration/{i}/deployed"] == 1.0
        assert m[f"iteration/{i}/eval_reward_mean"] == scored[best]["loop/checkpoint_reward_mean"]
        assert all(scored[st]["loop/iteration"] == i and scored[st]["loop/checkpoint_rows"] == 3 for st in steps)
    best0, best1 = (next(c for c in ckpts if c.step == m[f"iteration/{i}/best_step"]) for i in (0, 1))
    # Iteration 0 created the deployment on its best; iteration 1 re-pointed the same one (id and name kept).
    assert dep0 is not None and dep0.checkpoint_id == best0.id
    assert dep.id == dep0.id and dep.checkpoint_id == best1.id and dep.status == "ready"
    assert done.output_checkpoint_id == best1.id
    assert any(f"iteration 1 of 2: training (sft) on dataset {platform.train[1]}, from checkpoint {best0.id}" in e
               for e in logs), logs
    assert any(f"iteration 1 of 2: best checkpoint {best1.id}" in e and dep.id in e for e in logs)
    assert any(f"starting from the weights of a checkpoint at step {best0.step}" in e for e in logs), logs
    # The rollout serves the re-pointed deployment from iteration 1's best checkpoint, and sampling it works.
    rollout = rollout_pb2_grpc.RolloutServiceStub(platform.channel("rollout"))
    loaded = {x.name: x for x in rollout.ListLoaded(rollout_pb2.ListLoadedRequest(),
                                                    metadata=platform.metadata()).models}
    assert loaded["loop-best"].checkpoint_id == best1.id and loaded["loop-best"].deployment_id == dep.id
    out = rollout.Sample(rollout_pb2.SampleRequest(model="loop-best", text="1+2=", params=rollout_pb2.SamplingParams(
        max_tokens=4, temperature=0.0)), metadata=platform.metadata())
    assert out.model == "loop-best" and len(out.sequences[0].tokens) > 0
    # Iteration 0's checkpoint was unloaded when the new one was in: only iteration 1's best is laid out.
    laid_out = platform.root / "rollout" / "adapters" / dep.id
    assert [d.name for d in laid_out.iterdir() if not d.name.startswith(".")] == [best1.id]
    # A re-point whose new checkpoint the rollout cannot load (its stored adapter is damaged) switches the row back:
    # the deployment keeps serving iteration 1's best.
    adapter = next(f for f in best0.files if f["path"].endswith(".safetensors"))
    flip_byte(BlobStore(platform.root / "blobs").path(adapter["sha256"]), 200)
    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        with pytest.raises(TrainyardError, match=f"still serves {best1.id}: the rollout service could not load "
                                                 f"{best0.id}") as err:
            c.repoint_deployment("loop-best", best0.id)
        assert err.value.code == "DATA_LOSS"
        assert c.get_deployment("loop-best").checkpoint_id == best1.id
    again = rollout.Sample(rollout_pb2.SampleRequest(model="loop-best", text="1+2=", params=rollout_pb2.SamplingParams(
        max_tokens=4, temperature=0.0)), metadata=platform.metadata())
    assert list(again.sequences[0].tokens) == list(out.sequences[0].tokens)


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_a_run_starts_from_a_checkpoints_weights_with_a_fresh_optimizer_and_step(method, tmp_path, tiny_model_dir):
    """The seam each iteration after the first trains through: start_from loads the adapter only (step 0, a fresh
    optimizer): with a vanishing learning rate the new run's adapter is the starting one, not a fresh adapter."""
    import torch

    from services.common.methods.loop import TRAINING
    from services.trainer.dpo import run_dpo
    from services.trainer.sft import run_sft
    from tests.services.trainer.trainer_helpers import PAIRS, RecordingRun, chat_row, preference_row, write_jsonl

    rows = [chat_row(a, b) for a, b in PAIRS[:4]] if method == "sft" else [preference_row(a, b) for a, b in PAIRS[:4]]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    runner = run_sft if method == "sft" else run_dpo
    base = dict(max_steps=2, checkpoint_every=2, learning_rate=0.05, eval_fraction=0.0, lora_rank=4, max_seq_len=64)
    first = RecordingRun(tmp_path / "first", runner=runner)
    first.run(tiny_model_dir, data, TRAINING[method].from_json(base), work_dir=tmp_path / "w1")
    started = first.checkpoints[-1][0]
    slow = TRAINING[method].from_json(dict(base, max_steps=1, checkpoint_every=1, learning_rate=1e-12))
    second = RecordingRun(tmp_path / "second", runner=runner)
    second.run(tiny_model_dir, data, slow, work_dir=tmp_path / "w2", start_from=started)
    fresh = RecordingRun(tmp_path / "fresh", runner=runner)
    fresh.run(tiny_model_dir, data, slow, work_dir=tmp_path / "w3")
    assert second.total_steps == 1 and [c.step for c, _, _ in second.checkpoints] == [1]
    assert any("starting from the weights of a checkpoint at step 2" in m for _, m in second.logs)
    a, b, c = first.final_adapter(), second.final_adapter(), fresh.final_adapter()
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-3  # a fresh adapter is far from the trained one
    assert all(torch.isfinite(t).all() for t in b.values())


def test_a_job_scoped_key_deploys_only_its_own_checkpoints(platform):
    """What the loop's worker may do with its attempt's key: deploy one of the job's checkpoints, re-point a deployment
    serving one of them to another, have the rollout load such a deployment; nothing on other jobs' checkpoints."""
    from services.common import auth
    from services.common.errors import PermissionDenied
    from services.common.schema import new_id

    alice = platform.accounts["alice"]
    jobs = [platform.core.create(alice, NewJob("sft", "tiny", platform.train[0], "", {"max_steps": 1}))
            for _ in range(2)]
    ledger = Ledger(platform.db)
    own, other = [], []
    for job, into in zip(jobs, (own, other)):
        ledger.claim(job.id, "w")
        into += [ledger.add_checkpoint(job.id, "w", step=n, files=[], state=[], final=False, metrics={}).id
                 for n in (1, 2)]
    with platform.db.session() as s:
        key = auth.issue_job_key(s, s.get(Job, jobs[0].id))
        for name, ckpt in (("mine", own[0]), ("theirs", other[0])):
            s.add(Deployment(id=new_id("dep"), account_id=alice, name=name, checkpoint_id=ckpt, base_model="tiny",
                             status="ready"))
    with platform.db.session() as s:
        deps = {d.name: d.id for d in s.scalars(select(Deployment))}
    keys = auth.KeyAuthenticator(platform.db)
    caller = keys.authenticate(key)
    v1 = "/trainyard.v1."

    def allowed(method: str, request) -> bool:
        try:
            keys.authorize(caller, v1 + method, request)
            return True
        except PermissionDenied:
            return False

    assert allowed("DeploymentService/CreateDeployment", pb.CreateDeploymentRequest(name="n", checkpoint_id=own[1]))
    assert not allowed("DeploymentService/CreateDeployment", pb.CreateDeploymentRequest(name="n",
                                                                                         checkpoint_id=other[1]))
    assert not allowed("DeploymentService/CreateDeployment", pb.CreateDeploymentRequest(name="n", job_id=jobs[0].id))
    assert allowed("DeploymentService/RepointDeployment", pb.RepointDeploymentRequest(id="mine", checkpoint_id=own[1]))
    assert allowed("DeploymentService/RepointDeployment", pb.RepointDeploymentRequest(id=deps["mine"],
                                                                                       checkpoint_id=own[1]))
    assert not allowed("DeploymentService/RepointDeployment", pb.RepointDeploymentRequest(id="mine",
                                                                                           checkpoint_id=other[1]))
    assert not allowed("DeploymentService/RepointDeployment", pb.RepointDeploymentRequest(id="theirs",
                                                                                           checkpoint_id=own[1]))
    assert not allowed("DeploymentService/DeleteDeployment", pb.DeleteDeploymentRequest(id="mine"))
    assert allowed("RolloutService/LoadDeployment", rollout_pb2.LoadDeploymentRequest(deployment_id=deps["mine"]))
    assert not allowed("RolloutService/LoadDeployment", rollout_pb2.LoadDeploymentRequest(
        deployment_id=deps["theirs"]))


def test_a_dpo_loop_continues_from_its_best_adapter(platform):
    """The same loop with DPO on preference pairs: the last checkpoint of each iteration evaluated, iteration 1
    started from iteration 0's best adapter, the deployment re-pointed to iteration 1's."""
    from services.worker.job import run_managed_job
    from tests.services.trainer.trainer_helpers import PAIRS, preference_row

    store = DatasetStore(platform.db, BlobStore(platform.root / "blobs"), 1 << 20)
    pairs = [store.upload(platform.accounts["alice"], UploadHeader(f"pairs-{n}", "dpo", ""), iter(
        [json.dumps(preference_row(a, b)).encode() + b"\n" for a, b in PAIRS[n * 4:n * 4 + 4]]))[0].id for n in (0, 1)]
    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        job = c.create_job("loop", "tiny", platform.rft, train_datasets=pairs, **dict(
            LOOP, training_method="dpo", beta=0.2, max_steps=1, max_seq_len=64, checkpoints_per_iteration=1,
            deployment="dpo-best"))
        run_managed_job(job.id, _worker(platform, "loop-dpo"))
        done = c.get_job(job.id)
        logs = [e.message for e in c.job_logs(job.id)]
        dep = c.get_deployment("dpo-best")
    assert done.status == pb.JOB_STATUS_SUCCEEDED, (done.error, logs)
    with platform.db.session() as s:
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)))
    assert [c.step for c in ckpts] == [1, 2]
    m = dict(done.latest_metrics)
    assert (m["iteration/0/best_step"], m["iteration/1/best_step"], m["loop/iterations_done"]) == (1.0, 2.0, 2.0)
    assert dep.checkpoint_id == ckpts[1].id == done.output_checkpoint_id
    assert any("starting from the weights of a checkpoint at step 1" in e for e in logs), logs
    assert any(e.startswith(f"iteration 0 of 2: best checkpoint {ckpts[0].id}") and dep.id in e for e in logs), logs
