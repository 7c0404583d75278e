"""Celery worker entry point: ``celery -A services.worker.app worker --pool solo -Q trainyard``.

One job at a time per worker process (a worker owns its accelerators); the job itself runs in services/worker/job.py.
"""
from __future__ import annotations

import os

from services.common.blobstore import BlobStore
from services.common.grpcserver import configure_logging
from services.common.jobqueue import RUN_JOB, JobQueueSettings, make_celery

os.environ.setdefault("HF_HUB_OFFLINE", "1")
settings = JobQueueSettings()
settings.ensure_dirs()
settings.apply_torch_threads()
configure_logging(settings.log_level)
BlobStore(settings.blob_dir).sweep_staging()  # what processes killed mid-write (a worker mid-job) left behind
app = make_celery(settings)


@app.task(name=RUN_JOB)
def run_job(job_id: str) -> None:
    from services.worker.job import run_managed_job

    run_managed_job(job_id, settings)
