"""Resources on a fresh Postgres database: the device inventory, atomic allocation under concurrent claims, the
queue's order (priority, fairness between accounts, age), per-account quotas, releases, job-scoped keys."""
from __future__ import annotations

import secrets
import threading

import grpc
import pytest
from sqlalchemy import select

from services.common import auth, registry
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from services.common.ledger import Ledger
from services.common.resources import DeviceInfo, Inventory, set_quota
from services.common.schema import SHARED_SCOPE, Deployment, Device, Job, JobLog, utcnow
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.devices import DeviceCore
from services.scheduler.jobs import JobCore, NewJob
from tests.conftest import PG_ADMIN_URL, _admin

ROW = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


def slots(n: int) -> list[DeviceInfo]:
    return [DeviceInfo("cpu", i, f"slot {i}") for i in range(n)]


class World:
    def __init__(self, url: str, blob_dir, model_dir):
        migrate(url)
        self.db = Database(url)
        self.ledger = Ledger(self.db)
        self.blobs = BlobStore(blob_dir)
        with self.db.session() as s:
            registry.register_model(s, SHARED_SCOPE, "tiny", str(model_dir))
        self.accounts, self.datasets = {}, {}
        self.core = JobCore(self.db, self.ledger, lambda job_id: None, 0.05, threading.Event(), live_within_s=60)

    def account(self, name: str) -> str:
        if name not in self.accounts:
            self.accounts[name] = auth.create_account(self.db, name)[0].id
            ds, _ = DatasetStore(self.db, self.blobs, 1 << 20).upload(self.accounts[name], UploadHeader("d", None, ""),
                                                                      iter([ROW] * 4))
            self.datasets[name] = ds.id
        return self.accounts[name]

    def job(self, who: str, **kw) -> str:
        account = self.account(who)
        return self.core.create(account, NewJob("sft", "tiny", self.datasets[who], "", {"max_steps": 1}, **kw)).id

    def row(self, job_id: str) -> Job:
        with self.db.session() as s:
            return s.get(Job, job_id)

    def held(self) -> dict[str, str]:
        with self.db.session() as s:
            return {d.id: d.job_id for d in s.scalars(select(Device)) if d.job_id is not None}

    def logs(self, job_id: str) -> list[str]:
        with self.db.session() as s:
            return [r.message for r in s.scalars(select(JobLog).where(JobLog.job_id == job_id).order_by(JobLog.id))]


@pytest.fixture()
def world(tmp_path, tiny_model_dir):
    name = f"trainyard_res_{secrets.token_hex(4)}"
    _admin(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    w = World(f"{base}/{name}", tmp_path / "data" / "blobs", tiny_model_dir)
    w.url, w.data_dir = f"{base}/{name}", tmp_path / "data"
    yield w
    w.db.dispose()
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_inventory_lists_devices_with_their_holders_and_releases_them_at_the_end(world):
    inv = Inventory(world.db)
    inv.register("m1", slots(2))
    inv.register("m1", slots(2))  # a second worker process of the machine: the same two devices
    job_id = world.job("alice")
    claim = world.ledger.claim_on(job_id, "w1", "m1")
    assert [(d.id, d.role) for d in claim.devices] == [("m1/cpu0", "trainer")]
    assert claim.credential.startswith("ty_")
    core = DeviceCore(world.db, 60, 0, 0)
    mine = {v.device.id: (v.device.job_id, v.mine, v.live) for v in core.list(world.account("alice")).devices}
    assert mine == {"m1/cpu0": (job_id, True, True), "m1/cpu1": (None, False, True)}
    theirs = core.list(world.account("bob"))
    assert [(v.device.id, v.mine) for v in theirs.devices if v.device.job_id] == [("m1/cpu0", False)]
    assert core.list(world.account("alice")).devices_in_use == 1
    world.ledger.finish(job_id, "w1", "succeeded")
    assert world.held() == {}


def test_concurrent_claims_never_take_the_same_device(world):
    Inventory(world.db).register("m1", slots(3))
    jobs = [world.job(who) for who in ("a", "b", "c", "d", "e", "f") for _ in range(2)]
    claims, barrier = [], threading.Barrier(8)

    def claim(i: int) -> None:
        barrier.wait()
        c = world.ledger.claim_next(f"w{i}", "m1")
        if c is not None:
            claims.append(c)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claims) == 3  # three devices: three jobs started, the other claims found none free
    devices = [d.id for c in claims for d in c.devices]
    assert sorted(devices) == ["m1/cpu0", "m1/cpu1", "m1/cpu2"]
    assert world.held() == {d.id: c.job.id for c in claims for d in c.devices}
    assert len({c.job.id for c in claims}) == 3 and {c.job.id for c in claims} <= set(jobs)
    # Each of the three accounts that went first is a different one (fairness), and the rest still wait.
    assert len({c.job.account_id for c in claims}) == 3
    assert sum(world.row(j).status == "queued" for j in jobs) == 9


def test_queue_order_is_priority_then_fairness_between_accounts_then_age(world):
    Inventory(world.db).register("m1", slots(1))
    a = [world.job("alice") for _ in range(4)]
    b = world.job("bob")
    urgent = world.job("carol", priority=5)

    def run_next() -> str:
        c = world.ledger.claim_next("w1", "m1")
        world.ledger.finish(c.job.id, "w1", "succeeded")
        return c.job.id

    # carol's priority first; then alice (oldest) and bob take turns although alice queued four jobs first.
    assert [run_next() for _ in range(6)] == [urgent, a[0], b, a[1], a[2], a[3]]


def test_a_job_over_its_account_device_quota_waits_with_the_reason_and_lets_others_go(world):
    Inventory(world.db).register("m1", slots(4))
    world.account("alice")
    set_quota(world.db, "alice", max_devices=1, max_queued_jobs=None)
    first, second = world.job("alice"), world.job("alice")
    bob = world.job("bob")
    assert world.ledger.claim_next("w1", "m1").job.id == first
    assert world.ledger.claim_on(second, "w2", "m1") is None  # free devices, but alice holds her quota
    assert world.ledger.claim_next("w2", "m1").job.id == bob  # bob is not held up by alice's quota
    waiting = world.row(second)
    assert waiting.status == "queued"
    assert waiting.wait_reason.startswith("quota max_devices (1) reached: the account's running jobs hold 1 devices")
    assert sum(m.startswith("waiting: quota max_devices (1)") for m in world.logs(second)) == 1  # once per reason
    queue = DeviceCore(world.db, 60, 0, 0).list(world.account("alice")).queued
    assert [(j.id, j.wait_reason) for j in queue] == [(second, waiting.wait_reason)]
    world.ledger.finish(first, "w1", "succeeded")
    assert world.ledger.claim_next("w1", "m1").job.id == second
    assert world.row(second).wait_reason == ""


def test_requests_are_checked_and_the_queued_jobs_quota_refuses_more(world):
    job = world.row(world.job("alice"))
    assert (job.trainer_devices, job.rollout_devices, job.priority) == (1, 0, 0)  # SFT's defaults
    Inventory(world.db).register("m1", slots(2))
    with pytest.raises(InvalidArgument) as err:
        world.job("alice", trainer_devices=1, rollout_devices=2)
    assert [v.field for v in err.value.violations] == ["spec.resources.rollout_devices"]
    assert "the largest worker (m1) has 2" in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        world.job("alice", trainer_devices=-1, priority=11)
    assert {v.field for v in err.value.violations} == {"spec.resources.trainer_devices", "spec.priority"}
    with pytest.raises(InvalidArgument, match="at least one device"):
        world.job("alice", trainer_devices=0)
    assert world.row(world.job("alice", trainer_devices=2, priority=-10)).trainer_devices == 2
    set_quota(world.db, "alice", max_devices=None, max_queued_jobs=2)
    with pytest.raises(ResourceExhausted, match=r"quota max_queued_jobs_per_account \(2\) reached"):
        world.job("alice")


def test_a_job_that_no_free_device_fits_waits_and_blocks_smaller_jobs_behind_it(world):
    Inventory(world.db).register("m1", slots(2))
    small = world.job("alice")
    assert world.ledger.claim_next("w1", "m1").job.id == small
    big = world.job("bob", trainer_devices=2)
    later = world.job("carol")
    assert world.ledger.claim_next("w2", "m1") is None  # bob's job goes first: carol's does not fill the gap
    assert world.row(big).wait_reason == "waiting for 2 free devices on one worker (worker m1 has 1 of 2 free)"
    world.ledger.finish(small, "w1", "succeeded")
    c = world.ledger.claim_next("w2", "m1")
    assert c.job.id == big and [d.role for d in c.devices] == ["trainer", "trainer"]
    assert world.row(later).status == "queued"


def test_the_reaper_releases_a_lost_workers_devices_and_revokes_its_key(world):
    Inventory(world.db).register("m1", slots(1))
    job_id = world.job("alice")
    claim = world.ledger.claim_next("w1", "m1")
    keys = auth.KeyAuthenticator(world.db)
    assert keys.authenticate(claim.credential).job_id == job_id
    assert world.ledger.reap(0.0, max_attempts=3) == [job_id]
    assert world.held() == {}
    with pytest.raises(Unauthenticated):
        keys.authenticate(claim.credential)
    retry = world.ledger.claim_next("w2", "m1")
    assert retry.job.id == job_id and retry.attempt == 2 and retry.credential != claim.credential


def test_a_job_scoped_key_reaches_only_its_own_job_and_stops_at_the_end(world, tmp_path, tiny_model_dir):
    from tests.services.common.inprocess import Platform
    from trainyard.v1 import scheduler_pb2 as pb, scheduler_pb2_grpc as rpc

    platform = Platform(tmp_path / "platform", tiny_model_dir)
    try:
        db, alice, bob = platform.db, platform.accounts["alice"], platform.accounts["bob"]
        blobs = BlobStore(tmp_path / "platform" / "blobs")
        store = DatasetStore(db, blobs, 1 << 20)
        ds, _ = store.upload(alice, UploadHeader("d", None, ""), iter([ROW] * 4))
        other_ds, _ = store.upload(alice, UploadHeader("e", None, ""), iter([ROW.replace(b"hi", b"yo")] * 4))
        bob_ds, _ = store.upload(bob, UploadHeader("d", None, ""), iter([ROW] * 4))
        core = JobCore(db, Ledger(db), lambda job_id: None, 0.05, threading.Event())
        job = core.create(alice, NewJob("sft", "tiny", ds.id, "", {"max_steps": 1}))
        sibling = core.create(alice, NewJob("sft", "tiny", ds.id, "", {"max_steps": 1}))
        bobs = core.create(bob, NewJob("sft", "tiny", bob_ds.id, "", {"max_steps": 1}))
        Inventory(db).register("m1", slots(1))
        claim = Ledger(db).claim_on(job.id, "w1", "m1")
        md = (("authorization", f"Bearer {claim.credential}"),)
        ch = platform.channel("scheduler")
        jobs, datasets = rpc.JobServiceStub(ch), rpc.DatasetServiceStub(ch)
        assert jobs.GetJob(pb.GetJobRequest(id=job.id), metadata=md).status == pb.JOB_STATUS_RUNNING
        assert datasets.GetDataset(pb.GetDatasetRequest(id=ds.id), metadata=md).id == ds.id
        denied = [lambda: jobs.GetJob(pb.GetJobRequest(id=sibling.id), metadata=md),
                  lambda: jobs.GetJob(pb.GetJobRequest(id=bobs.id), metadata=md),
                  lambda: jobs.ListJobs(pb.ListJobsRequest(), metadata=md),
                  lambda: jobs.CancelJob(pb.CancelJobRequest(id=job.id), metadata=md),
                  lambda: datasets.GetDataset(pb.GetDatasetRequest(id=other_ds.id), metadata=md),
                  lambda: datasets.GetDataset(pb.GetDatasetRequest(id=bob_ds.id), metadata=md),
                  lambda: rpc.AccountServiceStub(ch).CreateApiKey(pb.CreateApiKeyRequest(name="x"), metadata=md)]
        for call in denied:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            assert f"scoped to job {job.id}" in err.value.details()
        # Weights: its own lineages only; sampling: its own deployments only (not even the account's base model).
        from trainyard.v1 import rollout_pb2, rollout_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc

        ws = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync"))
        assert list(ws.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=f"{job.id}/policy"),
                                    metadata=md).versions) == []
        for call in (lambda: ws.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=sibling.id), metadata=md),
                     lambda: rollout_pb2_grpc.RolloutServiceStub(platform.channel("rollout")).Sample(
                         rollout_pb2.SampleRequest(model="tiny", text="hi"), metadata=md)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        with pytest.raises(PermissionDenied):
            keys = auth.KeyAuthenticator(db)
            keys.authorize(keys.authenticate(claim.credential), "/trainyard.v1.WeightSyncService/GetLineage",
                           weightsync_pb2.GetLineageRequest(lineage=bobs.id))
        # Deployments of its own lineages (an RFT job's rollout): created, deleted and unloaded; no one else's.
        caller = keys.authenticate(claim.credential)
        create = "/trainyard.v1.DeploymentService/CreateDeployment"
        keys.authorize(caller, create, pb.CreateDeploymentRequest(name="r", lineage=job.id))
        for other in (sibling.id, f"{sibling.id}/x", bobs.id):
            with pytest.raises(PermissionDenied):
                keys.authorize(caller, create, pb.CreateDeploymentRequest(name="r", lineage=other))
        with db.session() as s:
            for name, lineage in (("mine", job.id), ("siblings", sibling.id)):
                s.add(Deployment(id=f"dep_{name}", account_id=alice, name=name, lineage=lineage, base_model="tiny",
                                 status="ready", created_at=utcnow(), updated_at=utcnow()))
        keys.authorize(caller, "/trainyard.v1.DeploymentService/DeleteDeployment",
                       pb.DeleteDeploymentRequest(id="mine"))
        keys.authorize(caller, "/trainyard.v1.RolloutService/UnloadDeployment",
                       rollout_pb2.UnloadDeploymentRequest(deployment_id="dep_mine"))
        for method, request in (("DeploymentService/DeleteDeployment", pb.DeleteDeploymentRequest(id="siblings")),
                                ("RolloutService/UnloadDeployment",
                                 rollout_pb2.UnloadDeploymentRequest(deployment_id="dep_siblings"))):
            with pytest.raises(PermissionDenied):
                keys.authorize(caller, "/trainyard.v1." + method, request)
        Ledger(db).finish(job.id, "w1", "succeeded")
        with pytest.raises(grpc.RpcError) as err:
            jobs.GetJob(pb.GetJobRequest(id=job.id), metadata=md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The account's own key is not scoped: it still reaches every job of the account.
        assert jobs.GetJob(pb.GetJobRequest(id=sibling.id), metadata=platform.metadata("alice")).id == sibling.id
    finally:
        platform.close()


def test_a_worker_runs_the_queue_in_order_on_its_devices_with_a_key_per_attempt(world):
    from services.common.schema import ApiKey
    from services.worker.job import run_queue
    from services.worker.settings import WorkerSettings

    settings = WorkerSettings(data_dir=world.data_dir, database_url=world.url, heartbeat_s=0.2, torch_threads=1,
                              worker_host="m-worker", cpu_slots=1)
    assert settings.blob_dir == world.blobs.root
    low = world.job("alice", priority=-1)
    high = world.job("bob", priority=2)
    run_queue(low, settings)  # the message of the low-priority job: the worker starts the queue's head first
    first, second = world.row(high), world.row(low)
    assert first.status == second.status == "succeeded"
    assert first.started_at < second.started_at
    assert any(m.startswith("started on worker") and "with cpu0 (trainer)" in m for m in world.logs(low))
    assert world.held() == {}
    with world.db.session() as s:
        keys = s.scalars(select(ApiKey).where(ApiKey.job_id.in_([low, high]))).all()
    assert len(keys) == 2 and all(k.revoked_at is not None for k in keys)
    assert [d.id for d in Inventory(world.db).devices()] == ["m-worker/cpu0"]


def test_a_delivered_job_that_cannot_start_waits_and_is_sent_again(world):
    from services.worker.job import run_queue
    from services.worker.settings import WorkerSettings

    settings = WorkerSettings(data_dir=world.data_dir, database_url=world.url, worker_host="m-busy", cpu_slots=1)
    Inventory(world.db).register("m-busy", slots(1))
    running = world.job("alice")
    assert world.ledger.claim_next("w-other", "m-busy").job.id == running
    waiting = world.job("bob")
    assert world.row(waiting).dispatched_at is not None
    run_queue(waiting, settings)  # its message reaches a worker whose only device is held
    row = world.row(waiting)
    assert (row.status, row.attempts, row.dispatched_at) == ("queued", 0, None)
    assert row.wait_reason == "waiting for 1 free devices on one worker (worker m-busy has 0 of 1 free)"
    assert waiting in world.ledger.undispatched(older_than_s=0)  # the scheduler's reaper sends it again


def test_sdk_and_cli_list_devices_quota_and_queue(tmp_path, tiny_model_dir, monkeypatch):
    from click.testing import CliRunner

    from tests.services.common.inprocess import Platform
    from trainyard import Client
    from trainyard.cli.main import cli

    platform = Platform(tmp_path / "platform", tiny_model_dir)
    try:
        db, alice = platform.db, platform.accounts["alice"]
        ds, _ = DatasetStore(db, BlobStore(tmp_path / "platform" / "blobs"), 1 << 20).upload(
            alice, UploadHeader("d", None, ""), iter([ROW] * 4))
        Inventory(db).register("m1", slots(2))
        monkeypatch.setenv("TRAINYARD_DATA_DIR", str(tmp_path / "platform"))
        monkeypatch.setenv("TRAINYARD_DATABASE_URL", f"sqlite:///{tmp_path / 'platform' / 'trainyard.db'}")
        runner = CliRunner()
        out = runner.invoke(cli, ["admin", "set-quota", "alice", "--max-devices", "1", "--max-queued-jobs", "5"])
        assert out.exit_code == 0 and "max_devices 1, max_queued_jobs 5" in out.output, out.output
        with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
            job = c.create_job("sft", "tiny", ds.id, priority=3, max_steps=1)
            assert (job.spec.priority, job.spec.resources.trainer_devices, job.spec.resources.rollout_devices) == \
                (3, 1, 0)
            with pytest.raises(Exception) as err:
                c.create_job("sft", "tiny", ds.id, rollout_devices=2)
            assert "spec.resources.rollout_devices" in str(err.value)
            r = c.list_devices()
            assert [(d.id, d.free, d.live) for d in r.devices] == [("m1/cpu0", True, True), ("m1/cpu1", True, True)]
            assert (r.quota.max_devices, r.quota.max_queued_jobs, r.quota.queued_jobs) == (1, 5, 1)
            assert [(e.job_id, e.priority, e.devices) for e in r.queue] == [(job.id, 3, 1)]
            Ledger(db).claim_next("w1", "m1")
            held = [d for d in c.list_devices().devices if not d.free]
            assert [(d.id, d.job_id, d.role) for d in held] == [("m1/cpu0", job.id, "trainer")]
        shown = runner.invoke(cli, ["--url", platform.url("scheduler"), "--api-key", platform.keys["alice"],
                                    "resources"])
        assert shown.exit_code == 0, shown.output
        assert "m1/cpu0" in shown.output and job.id in shown.output and "quota 1" in shown.output
        other = runner.invoke(cli, ["--url", platform.url("scheduler"), "--api-key", platform.keys["bob"],
                                    "resources", "--json"])
        assert job.id not in other.output and '"held_by_other_account": true' in other.output
    finally:
        platform.close()
