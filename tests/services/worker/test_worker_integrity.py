"""A managed job reads its stored inputs verified (services/worker/recipes/recording.py): a damaged dataset, or a damaged
checkpoint the retried job would resume from, fails the job with DataLoss naming the object before any training;
the job's scratch directory lives in the worker's staging directory, which start-up sweeps after a kill; a retry whose
lost attempt had stored the final checkpoint finishes with it."""
from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from services.common import auth, registry
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.worker.settings import WorkerSettings
from services.common.ledger import Ledger
from services.common.schema import SHARED_SCOPE, Checkpoint, Job, JobMetric
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.jobs import JobCore, NewJob
from services.worker.job import run_managed_job

pytestmark = pytest.mark.reliability

ROW = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


@pytest.fixture()
def env(tmp_path, tiny_model_dir):
    settings = WorkerSettings(data_dir=tmp_path / "data", heartbeat_s=0.2)
    settings.ensure_dirs()
    migrate(settings.database_url)
    db = Database(settings.database_url)
    account = auth.create_account(db, "acme")[0].id
    with db.session() as s:
        registry.register_model(s, SHARED_SCOPE, "tiny", str(tiny_model_dir))
    blobs = BlobStore(settings.blob_dir)
    ds, _ = DatasetStore(db, blobs, 1 << 20).upload(account, UploadHeader("d", None, ""), iter([ROW] * 4))
    job = JobCore(db, Ledger(db), lambda job_id: None, 0.05, threading.Event()).create(
        account, NewJob("sft", "tiny", ds.id, "", {"max_steps": 2}))
    yield settings, db, blobs, ds, job.id
    db.dispose()


def job_row(db: Database, job_id: str) -> Job:
    with db.session() as s:
        return s.get(Job, job_id)


def test_a_damaged_dataset_fails_the_job_naming_it(env, flip_byte):
    settings, db, blobs, ds, job_id = env
    flip_byte(blobs.path(ds.sha256), 5)
    run_managed_job(job_id, settings)
    job = job_row(db, job_id)
    assert job.status == "failed" and job.step == 0
    assert f"DataLoss: dataset {ds.id} file dataset.jsonl: blob {ds.sha256} is damaged" in job.error
    assert [p.name for p in blobs.staging_dir().iterdir()] == [".lock"]  # the job's scratch is gone


def test_a_damaged_checkpoint_fails_the_resumed_job_naming_it(env, flip_byte):
    """A worker died after saving a checkpoint; its state is damaged at rest; the retry does not resume from it."""
    settings, db, blobs, _, job_id = env
    ledger = Ledger(db)
    ledger.claim(job_id, "lost-worker")
    adapter, adapter_size = blobs.put_bytes(b"adapter bytes")
    optimizer, optimizer_size = blobs.put_bytes(b"optimizer state " * 1000)
    ckpt = ledger.add_checkpoint(job_id, "lost-worker", step=1, final=False, metrics={},
                                 files=[{"path": "adapter_model.safetensors", "sha256": adapter,
                                         "size_bytes": adapter_size}],
                                 state=[{"path": "optimizer.pt", "sha256": optimizer, "size_bytes": optimizer_size}])
    flip_byte(blobs.path(optimizer), 1000)
    assert ledger.reap(0.0, max_attempts=3) == [job_id]
    run_managed_job(job_id, settings)
    job = job_row(db, job_id)
    assert job.status == "failed" and job.attempts == 2
    assert f"DataLoss: checkpoint {ckpt.id} state file optimizer.pt: blob {optimizer} is damaged" in job.error


class _Killed(BaseException):
    """The worker process dying at one point (kill -9): nothing after it runs, no handler sees it."""


def test_a_worker_killed_after_the_final_checkpoint_is_not_trained_or_recorded_again(env, monkeypatch):
    """The final checkpoint is stored and the worker dies before the job is marked succeeded: the retry finishes the
    job with that checkpoint; it neither records the last step's metrics again nor stores a second final
    checkpoint."""
    settings, db, _, _, job_id = env

    def die(*args, **kwargs):
        raise _Killed()
    with monkeypatch.context() as m:
        m.setattr(Ledger, "finish", die)
        with pytest.raises(_Killed):
            run_managed_job(job_id, settings)
    ledger = Ledger(db)
    first = ledger.latest_checkpoint(job_id)
    assert (job_row(db, job_id).status, first.step, first.final) == ("running", 2, True)
    assert ledger.reap(0.0, max_attempts=3) == [job_id]
    run_managed_job(job_id, settings)
    job = job_row(db, job_id)
    assert (job.status, job.attempts, job.step, job.output_checkpoint_id) == ("succeeded", 2, 2, first.id)
    with db.session() as s:
        steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)))
        checkpoints = [(c.step, c.final) for c in s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id))]
    assert steps == [1, 2]  # each step once
    assert checkpoints == [(2, True)]
