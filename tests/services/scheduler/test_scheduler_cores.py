"""Scheduler cores in process on SQLite: upload limits, the job ledger and its reaper."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from services.common import auth
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.schema import SHARED_SCOPE, Job, utcnow
from services.common import registry
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.jobs import JobCore, NewJob
from services.common.ledger import LeaseLost, Ledger

ROW = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


@pytest.fixture()
def env(tmp_path):
    from models.tiny import build_tiny_model

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    account, _, _ = auth.create_account(db, "acme")
    with db.session() as s:
        registry.register_model(s, SHARED_SCOPE, "tiny", str(build_tiny_model(tmp_path / "tiny")))
    blobs = BlobStore(tmp_path / "blobs")
    yield db, blobs, account.id
    db.dispose()


def test_upload_over_the_size_limit_stores_nothing(env, tmp_path):
    db, blobs, account = env
    store = DatasetStore(db, blobs, max_bytes=1000)
    with pytest.raises(InvalidArgument, match="larger than"):
        store.upload(account, UploadHeader("big", None, "big.jsonl"), iter([ROW] * 50))
    assert [p.name for p in blobs.staging_dir().iterdir()] == [".lock"]
    assert not (tmp_path / "blobs" / "sha256").exists()
    ds, dedup = store.upload(account, UploadHeader("ok", None, "ok.jsonl"), iter([ROW]))
    assert ds.num_rows == 1 and not dedup


def test_a_sharegpt_upload_stores_the_mapped_rows_and_says_so(env):
    db, blobs, account = env
    store = DatasetStore(db, blobs, 1 << 20)
    sharegpt = (b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}\n'
                b'{"conversations": [{"from": "human", "value": "yo"}, {"from": "gpt", "value": "hey"}]}\n')
    ds, dedup, mapping = store.upload_mapped(account, UploadHeader("chat", None, "chat.jsonl"), iter([sharegpt]))
    assert (ds.format, ds.num_rows, dedup, mapping.name) == ("sft_chat", 2, False, "sharegpt")
    _, rows = store.preview(account, ds.id, 0, 10)
    assert rows[0] == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    # The stored blob is the mapped file: uploading the same rows in our format finds the same dataset.
    native = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    again, dedup = store.upload(account, UploadHeader("again", None, ""), iter([native]))
    assert again.id == ds.id and dedup
    assert [p.name for p in blobs.staging_dir().iterdir()] == [".lock"]


def test_dataset_quotas_count_live_datasets_and_their_bytes(env, tmp_path):
    db, blobs, account = env
    other, _, _ = auth.create_account(db, "other")
    row = lambda i: ROW.replace(b"hi", f"hi {i}".encode())  # noqa: E731 - distinct contents, no deduplication
    store = DatasetStore(db, blobs, 1 << 20, max_per_account=2, max_mb_per_account=1)
    first, _ = store.upload(account, UploadHeader("a", None, ""), iter([row(0)]))
    store.upload(account, UploadHeader("b", None, ""), iter([row(1)]))
    with pytest.raises(ResourceExhausted, match=r"quota max_datasets_per_account \(2\) reached"):
        store.upload(account, UploadHeader("c", None, ""), iter([row(2)]))
    store.upload(other.id, UploadHeader("c", None, ""), iter([row(2)]))  # another account's quota is its own
    store.delete(account, first.id)
    store.upload(account, UploadHeader("c", None, ""), iter([row(2)]))
    # Bytes: 1 MB in all for the account's live datasets; a refused upload stores nothing.
    store = DatasetStore(db, blobs, 2 << 20, max_per_account=10, max_mb_per_account=1)
    big = [row(3)] * ((1 << 20) // len(row(3)))
    with pytest.raises(ResourceExhausted, match=r"quota max_dataset_mb_per_account \(1\) reached"):
        store.upload(account, UploadHeader("big", None, ""), iter(big))
    assert [p.name for p in blobs.staging_dir().iterdir()] == [".lock"]
    assert len(store.list(account, 0, 50)[0]) == 2


def _job(db, blobs, account, dispatch=lambda job_id: None) -> tuple[JobCore, str]:
    ds, _ = DatasetStore(db, blobs, 1 << 20).upload(account, UploadHeader("d", None, ""), iter([ROW]))
    core = JobCore(db, Ledger(db), dispatch, 0.05, threading.Event())
    job = core.create(account, NewJob("sft", "tiny", ds.id, "", {"max_steps": 3}))
    return core, job.id


def test_broker_failure_marks_the_job_failed(env):
    db, blobs, account = env

    def down(job_id):
        raise ConnectionError("redis unreachable")

    with pytest.raises(Unavailable, match="broker"):
        _job(db, blobs, account, dispatch=down)
    with db.session() as s:
        job = s.query(Job).one()
        assert job.status == "failed" and "redis unreachable" in job.error


def test_lease_claim_heartbeat_reap_and_retry_limit(env):
    db, blobs, account = env
    core, job_id = _job(db, blobs, account)
    ledger = Ledger(db)
    claim = ledger.claim(job_id, "w1")
    assert claim.attempt == 1 and ledger.claim(job_id, "w2") is None  # one owner at a time
    assert ledger.heartbeat(job_id, "w1") is False
    with pytest.raises(LeaseLost):
        ledger.heartbeat(job_id, "w2")
    assert ledger.reap(lost_after_s=60, max_attempts=2) == []  # fresh heartbeat: left alone

    def stale():
        with db.session() as s:
            s.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=utcnow() - timedelta(seconds=120)))

    stale()
    assert ledger.reap(lost_after_s=60, max_attempts=2) == [job_id]
    with pytest.raises(LeaseLost):
        ledger.progress(job_id, "w1", step=5)  # the lost worker can no longer write
    assert ledger.claim(job_id, "w2").attempt == 2
    stale()
    assert ledger.reap(lost_after_s=60, max_attempts=2) == []
    job = core.get(account, job_id)
    assert job.status == "failed" and "worker lost 2 times" in job.error


def test_cancel_requested_on_a_lost_job_ends_cancelled(env):
    db, blobs, account = env
    core, job_id = _job(db, blobs, account)
    ledger = Ledger(db)
    ledger.claim(job_id, "w1")
    core.cancel(account, job_id)
    assert ledger.heartbeat(job_id, "w1") is True  # the worker learns of the cancellation on its next beat
    with db.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=utcnow() - timedelta(seconds=120)))
    assert ledger.reap(lost_after_s=60, max_attempts=3) == []
    assert core.get(account, job_id).status == "cancelled"


def test_watch_follows_a_job_to_its_end(env):
    db, blobs, account = env
    core, job_id = _job(db, blobs, account)
    ledger = Ledger(db)
    ledger.claim(job_id, "w1")
    for step in (1, 2, 3):
        ledger.progress(job_id, "w1", step=step, total_steps=3, metrics={"train/loss": 1.0 / step})
    ledger.finish(job_id, "w1", "succeeded")
    items = list(core.watch(account, job_id, 2, lambda: True))
    assert [i.row.step for i in items if i.kind == "metric"] == [2, 3]
    assert items[0].kind == "job" and items[-1].kind in ("job", "log")
    with pytest.raises(InvalidArgument, match="from_step"):
        list(core.watch(account, job_id, -1, lambda: True))


def test_reaper_finds_jobs_that_never_reached_the_broker(env):
    db, blobs, account = env
    sent = []
    core, job_id = _job(db, blobs, account, dispatch=sent.append)
    ledger = Ledger(db)
    assert sent == [job_id] and ledger.undispatched(older_than_s=0) == []
    with db.session() as s:  # as if the scheduler stopped between the commit and the send
        s.execute(update(Job).where(Job.id == job_id).values(dispatched_at=None))
    assert ledger.undispatched(older_than_s=3600) == []  # too recent to tell apart from a send in progress
    assert ledger.undispatched(older_than_s=0) == [job_id]
    ledger.mark_dispatched(job_id)
    assert ledger.undispatched(older_than_s=0) == []


def test_page_tokens_are_checked():
    from services.scheduler.servicer import page
    from trainyard.v1 import common_pb2

    assert page(common_pb2.PageRequest()) == (0, 50)
    assert page(common_pb2.PageRequest(page_size=5, page_token="10")) == (10, 5)
    for bad in ("-50", "abc", "9" * 30, "+5", " 5"):
        with pytest.raises(InvalidArgument, match="page.page_token"):
            page(common_pb2.PageRequest(page_token=bad))
    with pytest.raises(InvalidArgument, match="page.page_size"):
        page(common_pb2.PageRequest(page_size=501))


def test_weight_version_paths_must_be_normalized_and_distinct():
    from services.weightsync.store import FileSpec, PublishHeader, check_header

    sha = "0" * 64
    for paths in (["a", "a/b"], ["a/b", "a"], ["x/../y"], ["./a"], ["/abs"], ["a", "a"], [""]):
        with pytest.raises(InvalidArgument, match="header.files"):
            check_header(PublishHeader("lin", "", "full", "", [FileSpec(p, sha, 1) for p in paths], {}))
    check_header(PublishHeader("lin", "", "full", "", [FileSpec("a/b", sha, 1), FileSpec("a/c", sha, 1)], {}))
    with pytest.raises(InvalidArgument, match="header.base_model"):
        check_header(PublishHeader("lin", "", "full", "m" * 200, [FileSpec("a", sha, 1)], {}))


def test_max_steps_zero_is_refused_and_unset_is_derived(env):
    db, blobs, account = env
    ds, _ = DatasetStore(db, blobs, 1 << 20).upload(account, UploadHeader("d", None, ""), iter([ROW]))
    core = JobCore(db, Ledger(db), lambda job_id: None, 0.05, threading.Event())
    with pytest.raises(InvalidArgument) as exc:
        core.create(account, NewJob("sft", "tiny", ds.id, "", {"max_steps": 0}))
    assert [v.field for v in exc.value.violations] == ["spec.sft.max_steps"]
    assert core.list(account, None, 0, 10)[0] == []
    job = core.create(account, NewJob("sft", "tiny", ds.id, "", {}))
    assert job.config["max_steps"] is None
