"""The job queue the scheduler and the workers share: its settings and the Celery wiring. The scheduler only sends
task names (it never imports training code); workers run them.

Broker: Redis (or any Celery broker URL) in compose and tests; the filesystem transport under data_dir for the
embedded quickstart, so a machine with no servers still runs separate worker processes. acks_late +
reject_on_worker_lost + prefetch 1: a message is acknowledged only when its job finished. Duplicate deliveries are
harmless because a worker must first claim the job in the database (services/common/ledger.py).
"""
from __future__ import annotations

from celery import Celery
from pydantic import Field

from services.common.config import TrainyardSettings

RUN_JOB = "trainyard.run_job"


class JobQueueSettings(TrainyardSettings):
    """What the scheduler and the workers both read (env TRAINYARD_*): the broker, the queue, the lease heartbeat."""

    broker_url: str = Field(default="", description="Celery broker; default: filesystem broker under data_dir")
    celery_queue: str = "trainyard"
    # Job leases: a worker heartbeats every heartbeat_s (the scheduler retries a job silent for worker_lost_after_s).
    heartbeat_s: float = Field(default=2.0, gt=0)
    # Per-account quotas where an operator set none (`trainyard admin set-quota`; docs/resources.md), 0 = no limit:
    # devices held at once by the account's running jobs (workers enforce it: a job over it waits, queued), and jobs
    # queued at once (CreateJob refuses one more with RESOURCE_EXHAUSTED).
    max_devices_per_account: int = Field(default=0, ge=0)
    max_queued_jobs_per_account: int = Field(default=1000, ge=0)

    def broker(self) -> str:
        return self.broker_url or "filesystem://"

    def broker_dir(self):
        return self.data_dir / "broker"


def make_celery(settings: JobQueueSettings) -> Celery:
    app = Celery("trainyard")
    broker = settings.broker()
    conf = dict(
        broker_url=broker,
        task_default_queue=settings.celery_queue,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
    )
    if broker.startswith("filesystem"):
        folders = {name: settings.broker_dir() / name for name in ("queue", "processed", "control")}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": str(folders["queue"]), "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]), "control_folder": str(folders["control"]),
            "store_processed": False}
    app.conf.update(conf)
    return app


class Dispatcher:
    def __init__(self, settings: JobQueueSettings):
        self.app = make_celery(settings)
        self.queue = settings.celery_queue

    def __call__(self, job_id: str) -> None:
        self.app.send_task(RUN_JOB, args=[job_id], queue=self.queue)
