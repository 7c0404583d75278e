"""The scheduler process: control-plane gRPC services, the lease reaper and shared-model registration."""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable

import sqlalchemy.exc

from services.common import channels, metrics
from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.common.schema import SHARED_SCOPE
from services.common import registry
from services.scheduler.accounts import AccountCore
from services.scheduler.checkpoints import CheckpointCore
from services.common.jobqueue import Dispatcher
from services.scheduler.datasets import DatasetStore
from services.scheduler.deployments import DeploymentCore
from services.scheduler.evaluators import EvaluatorCore
from services.scheduler.exports import ExportCore
from services.evaluators.store import EvaluatorStore
from services.scheduler.jobs import JobCore
from services.common.ledger import Ledger
from services.scheduler.planner import Planner
from services.scheduler.servicer import (
    AccountServicer,
    CheckpointServicer,
    DatasetServicer,
    DeploymentServicer,
    EvaluatorServicer,
    JobServicer,
    ModelServicer,
    ResourceServicer,
)
from services.scheduler.devices import DeviceCore
from services.scheduler.settings import SchedulerSettings
from trainyard.v1 import rollout_pb2, rollout_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc as rpc

log = logging.getLogger("trainyard.scheduler")
# The tiny model of each family, built locally at first start: a model to try the platform with before importing one.
TINY_MODELS = {"tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3_moe", "tiny-deepseek-v3": "deepseek_v3"}


class RolloutGateway:
    """Calls the rollout service on the caller's behalf (their API key travels with the call)."""

    def __init__(self, target: str, max_mb: int, credentials=None):
        self.channel = channels.open_channel(target, max_mb, credentials)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def load(self, api_key: str, deployment_id: str) -> None:
        # Wait briefly for a (re)starting rollout, then call: a down rollout fails in seconds, not at the deadline.
        channels.ready(self.channel, timeout_s=10)
        self.stub.LoadDeployment(rollout_pb2.LoadDeploymentRequest(deployment_id=deployment_id),
                                 metadata=channels.auth_metadata(api_key), timeout=300)

    def unload(self, api_key: str, deployment_id: str) -> None:
        self.stub.UnloadDeployment(rollout_pb2.UnloadDeploymentRequest(deployment_id=deployment_id),
                                   metadata=channels.auth_metadata(api_key), timeout=30)


def register_shared_models(settings: SchedulerSettings, db: Database) -> None:
    models = dict(settings.shared_models)
    if settings.builtin_tiny_models:
        for name, family in TINY_MODELS.items():
            path = settings.data_dir / "models" / name
            if not (path / "config.json").exists():
                # Built by a child process: building needs torch, and the scheduler process never imports it.
                built = subprocess.run([sys.executable, "-m", "models.tiny", str(path), "--family", family],
                                       capture_output=True, text=True)
                if built.returncode != 0:
                    raise RuntimeError(f"building the built-in model {name} failed:\n{built.stderr[-2000:]}")
            models.setdefault(name, str(path))
    for name, path in models.items():
        with db.session() as s:
            registry.register_model(s, SHARED_SCOPE, name, path)
        log.info("shared model %s -> %s", name, path)


def reaper_loop(settings: SchedulerSettings, ledger: Ledger, dispatch,
                checkpoints: CheckpointCore) -> Callable[[threading.Event], None]:
    """Every reaper_interval_s: requeue jobs of lost workers, send jobs whose attempt never reached the broker, and
    delete expired checkpoints."""

    def loop(stopping: threading.Event) -> None:
        while not stopping.wait(settings.reaper_interval_s):
            try:
                checkpoints.sweep_expired()
            except Exception:  # noqa: BLE001 - the next pass sweeps again; expired ones stay unreadable meanwhile
                log.exception("expired checkpoint sweep failed")
            try:
                lost = ledger.reap(settings.worker_lost_after_s, settings.max_job_attempts)
                pending = ledger.undispatched(older_than_s=settings.worker_lost_after_s)
            except Exception:  # noqa: BLE001 - keep reaping through database blips
                log.exception("reaper pass failed")
                continue
            for job_id in dict.fromkeys(lost + pending):
                try:
                    dispatch(job_id)
                    ledger.mark_dispatched(job_id)
                    log.warning("job %s dispatched again (%s)", job_id, "worker lost" if job_id in lost else
                                "never reached the broker")
                except Exception:  # noqa: BLE001 - this job stays undispatched; the next pass tries again
                    log.exception("could not dispatch job %s", job_id)
    return loop


def job_gauges(ledger: Ledger) -> metrics.Gauges:
    """trainyard_jobs{status} and trainyard_job_queue_depth, counted in the database when scraped."""
    def read() -> dict[str, dict]:
        try:
            counts = ledger.count_by_status()
        except sqlalchemy.exc.OperationalError as exc:  # the scrape still serves the RPC metrics
            log.warning("job metrics left out of this scrape: the database is unavailable (%s)", exc)
            return {}
        return {"trainyard_jobs": {(status,): n for status, n in counts.items()},
                "trainyard_job_queue_depth": {(): counts["queued"]}}

    return metrics.Gauges({"trainyard_jobs": ("Managed jobs by status", ["status"]),
                           "trainyard_job_queue_depth": ("Managed jobs queued, waiting for a worker", [])}, read)


def build(settings: SchedulerSettings) -> Server:
    settings.ensure_dirs()
    db = Database(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    blobs.sweep_staging()  # uploads cut by a killed scheduler
    register_shared_models(settings, db)
    ledger = Ledger(db)
    metrics.register("jobs", job_gauges(ledger))
    dispatch = Dispatcher(settings)
    rollout = RolloutGateway(settings.rollout_url, settings.grpc_max_message_mb, settings.channel_credentials())
    # Set at shutdown: the reaper stops, and WatchJob streams end with UNAVAILABLE (clients resume) instead of
    # holding the process for the whole grace period.
    stopping = threading.Event()
    accounts = AccountCore(db, blobs, settings.model_import_roots, [settings.data_dir, settings.blob_dir])
    checkpoints = CheckpointCore(db, blobs)
    planner = Planner(blobs)
    exports = ExportCore(accounts, checkpoints, blobs, settings.data_dir / "exports", settings.max_merged_exports)
    jobs = JobCore(db, ledger, dispatch, settings.watch_poll_s, stopping, planner,
                   live_within_s=settings.worker_lost_after_s,
                   max_queued_jobs_per_account=settings.max_queued_jobs_per_account,
                   max_devices_per_account=settings.max_devices_per_account)
    devices = DeviceCore(db, settings.worker_lost_after_s, settings.max_devices_per_account,
                         settings.max_queued_jobs_per_account)
    deployments = DeploymentCore(db, rollout.load, rollout.unload, settings.max_deployments_per_account)
    datasets = DatasetStore(db, blobs, settings.max_dataset_mb * 1024 * 1024, settings.max_datasets_per_account,
                            settings.max_dataset_mb_per_account)
    evaluators = EvaluatorCore(EvaluatorStore(db, blobs, settings.evaluator_limits(), settings.max_evaluator_kb << 10,
                                              settings.max_evaluator_versions_per_account),
                               datasets, settings.max_evaluator_test_rows)

    def register(server) -> None:
        rpc.add_AccountServiceServicer_to_server(AccountServicer(accounts), server)
        rpc.add_ModelServiceServicer_to_server(ModelServicer(accounts), server)
        rpc.add_DatasetServiceServicer_to_server(DatasetServicer(datasets), server)
        rpc.add_JobServiceServicer_to_server(JobServicer(jobs), server)
        rpc.add_CheckpointServiceServicer_to_server(CheckpointServicer(checkpoints, exports), server)
        rpc.add_DeploymentServiceServicer_to_server(DeploymentServicer(deployments), server)
        rpc.add_ResourceServiceServicer_to_server(ResourceServicer(devices), server)
        rpc.add_EvaluatorServiceServicer_to_server(EvaluatorServicer(evaluators), server)

    def shutdown() -> None:
        planner.close()
        rollout.channel.close()
        db.dispose()

    names = [scheduler_pb2.DESCRIPTOR.services_by_name[n].full_name for n in
             ("AccountService", "ModelService", "DatasetService", "JobService", "CheckpointService",
              "DeploymentService", "ResourceService", "EvaluatorService")]
    spec = ServiceSpec(name="scheduler", register=register, service_names=names, on_shutdown=shutdown,
                       background=[reaper_loop(settings, ledger, dispatch, checkpoints)], stopping=stopping)
    server = service_server(spec, settings, settings.scheduler_port, db)
    return server


def main() -> None:
    run_service(SchedulerSettings, build)


if __name__ == "__main__":
    main()
