"""Celery worker entry point: ``celery -A services.worker.app worker --pool solo -Q trainyard``.

One job at a time per worker process (a worker owns its accelerators); the job itself runs in services/worker/job.py.
"""
from __future__ import annotations

import os

from celery import signals

from services.common import metrics
from services.common.blobstore import BlobStore
from services.common.jobqueue import RUN_JOB, make_celery
from services.common.logs import configure_logging
from services.worker.settings import WorkerSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
settings = WorkerSettings()
settings.ensure_dirs()
settings.apply_torch_threads()
configure_logging(settings.log_level, settings.log_format)
BlobStore(settings.blob_dir).sweep_staging()  # what processes killed mid-write (a worker mid-job) left behind
app = make_celery(settings)


@signals.worker_init.connect
def serve_metrics(**_) -> None:
    """/metrics of the worker process (training step time and tokens); started with the worker, so a celery command
    that only imports the app (inspect, purge) takes no port."""
    if settings.metrics_port:
        metrics.serve(settings.host, settings.metrics_port)


@signals.worker_init.connect
def register_inventory(**_) -> None:
    """This machine's devices into the inventory at start, kept live by a beat while the worker idles too."""
    import threading

    from services.common.db import Database
    from services.common.resources import Inventory
    from services.worker.job import register_devices

    db = Database(settings.database_url)
    register_devices(db, settings)

    def beat() -> None:
        while True:
            threading.Event().wait(settings.heartbeat_s)
            try:
                Inventory(db).heartbeat(settings.machine())
            except Exception:  # noqa: BLE001 - a database blip; the next beat retries
                pass

    threading.Thread(target=beat, daemon=True, name="inventory-heartbeat").start()


@app.task(name=RUN_JOB)
def run_job(job_id: str) -> None:
    from services.worker.job import run_queue

    run_queue(job_id, settings)
