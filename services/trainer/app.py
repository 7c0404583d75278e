"""The trainer process: settings, the weight-sync publisher and the server around the Training API sessions
(python -m services.trainer); the gRPC adapter is servicer.py. Under torchrun (more than one process) the trainer is
a group: rank 0 runs this server over the group's engines, the other ranks serve rank 0's commands
(services/trainer/group.py); trainer_nproc / trainer_nnodes make `python -m services.trainer` launch that group."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import grpc
from pydantic import Field

from services.common import channels
from services.common.channels import auth_metadata
from services.common.blobstore import BlobStore
from services.common.config import TrainyardSettings
from services.common.db import Database
from services.common.errors import InvalidArgument, Unavailable
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.trainer import group as trainer_group
from services.trainer.engine.parallel.dims import ParallelDims, from_mapping
from services.trainer.servicer import TrainerServicer
from services.trainer.sessions import SessionManager
from services.weightsync.client import publish_dir
from trainyard.v1 import trainer_pb2 as pb, trainer_pb2_grpc as rpc, weightsync_pb2, weightsync_pb2_grpc


class TrainerSettings(TrainyardSettings):
    # How long a call waits for the calls with lower seq_id on its session before giving up.
    order_timeout_s: float = Field(default=600.0, gt=0)
    # Batch-invariant forward passes, so logprobs equal a deterministic rollout's bitwise (slower).
    deterministic: bool = False
    # Tokens per micro-batch of a Forward / ForwardBackward whose request leaves micro_batch_tokens at 0.
    micro_batch_tokens: int = Field(default=2048, ge=1)
    # When a Training API session's state is recorded, to be restored after a trainer restart (besides SaveState and
    # SIGTERM, which always record it; services/trainer/sessions.py): every this many optimizer steps (0: never on a
    # schedule; a crash then loses what came after the session's last SaveState / SaveWeights), and with every
    # SaveWeights (its checkpoint then also holds the optimizer state: for a full-parameter session that is twice
    # the model's size per save, so turn it off where such sessions publish often).
    session_state_every_steps: int = Field(default=50, ge=0)
    session_state_with_weights: bool = True
    # Quota: open Training API sessions per account on this trainer (each holds an adapter and its AdamW state, or
    # for a full-parameter session a copy of the model); CreateSession beyond it is RESOURCE_EXHAUSTED.
    max_sessions_per_account: int = Field(default=64, ge=1)
    # The trainer as a torchrun group (services/trainer/group.py; docs/distributed.md): processes per node and nodes
    # (`python -m services.trainer` then launches torchrun itself; under torchrun, WORLD_SIZE is the world size),
    # the c10d rendezvous every node reaches (host:port, with trainer_nnodes > 1) and its id, how often torchrun
    # restarts a group whose rank failed, and how long a collective waits for a silent rank.
    trainer_nproc: int = Field(default=1, ge=1)
    trainer_nnodes: int = Field(default=1, ge=1)
    trainer_rdzv_endpoint: str = ""
    trainer_rdzv_id: str = "trainyard-trainer"
    trainer_max_restarts: int = Field(default=3, ge=0)
    trainer_group_timeout_s: float = Field(default=300.0, gt=0)
    # The sessions' parallel layout over the group (engine/parallel/dims.py): dp_replicate, dp_shard (-1: what the
    # others leave), cp, ep, pp and pipeline_schedule (with pp > 1; 1f1b by default); e.g.
    # TRAINYARD_TRAINER_PARALLEL='{"dp_shard": 2}'. Empty: FSDP over every rank.
    trainer_parallel: dict[str, int | str] = Field(default_factory=dict)
    # The addresses GetEndpoints gives clients for the rollout and the scheduler (host:port as a client reaches them,
    # e.g. the host's published ports), so that an SDK given only the trainer's address finds the others. Empty:
    # rollout_url / scheduler_url, the addresses this trainer itself uses.
    advertised_rollout_url: str = ""
    advertised_scheduler_url: str = ""

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """trainer_parallel for world_size ranks, checked; errors name the setting's knob."""
        prefix = "trainer_parallel."
        if self.trainer_parallel.get("tp", 1) != 1:
            raise InvalidArgument("the trainer service does not run sessions with tensor parallelism yet",
                                  field=prefix + "tp")
        dims = from_mapping(dict(self.trainer_parallel), world_size=world_size, field_prefix=prefix)
        for knob, what in (("cp", "context"), ("pp", "pipeline")):
            if getattr(dims, knob) > 1 and self.deterministic:
                raise InvalidArgument(f"deterministic (batch-invariant) mode is not available with {what} "
                                      "parallelism", field=prefix + knob)
        return dims


WEIGHT_KINDS = {"lora_adapter": weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER, "full": weightsync_pb2.WEIGHT_KIND_FULL}


def make_publisher(weightsync: weightsync_pb2_grpc.WeightSyncServiceStub):
    """SessionManager's publish: the saved directory as the next version of the session's lineage (ephemeral: one
    for sampling only, services/weightsync/store.py)."""

    def publish(api_key: str, sess, directory: Path, kind: str, checkpoint_id: str = "",
                ephemeral: bool = False) -> str:
        try:
            parent = sess.weight_version_id
            if parent is None:  # a restored session goes on from its lineage's newest version
                versions = weightsync.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=sess.id),
                                                   metadata=auth_metadata(api_key)).versions
                parent = versions[-1].id if versions else ""
            version = publish_dir(weightsync, api_key, lineage=sess.id, parent_id=parent, kind=WEIGHT_KINDS[kind],
                                  base_model=sess.base_model, directory=directory,
                                  metadata={"optim_steps": str(sess.optim_steps), "checkpoint_id": checkpoint_id},
                                  ephemeral=ephemeral)
        except grpc.RpcError as exc:  # the session's state is intact: the caller can save again
            raise Unavailable(f"the weights were not published to the weight-sync service: {exc.details()}") from None
        return version.id

    return publish


def make_ephemeral_dropper(weightsync: weightsync_pb2_grpc.WeightSyncServiceStub):
    """SessionManager's drop_ephemeral: delete the ephemeral versions of a closed session's lineage (none published:
    the lineage does not exist, nothing to do)."""

    def drop(api_key: str, session_id: str) -> None:
        try:
            weightsync.DeleteEphemeralVersions(weightsync_pb2.DeleteEphemeralVersionsRequest(lineage=session_id),
                                               metadata=auth_metadata(api_key))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise Unavailable(f"the weight-sync service did not delete them: {exc.details()}") from None

    return drop


def build(settings: TrainerSettings, group: trainer_group.EngineGroup | None = None) -> Server:
    """The trainer's server; group: the torchrun group whose engines the sessions use (rank 0), None on one
    process."""
    settings.ensure_dirs()
    settings.apply_torch_threads()
    db = Database(settings.database_url)
    channel = channels.open_channel(settings.weightsync_url, settings.grpc_max_message_mb,
                                    settings.channel_credentials())
    weightsync = weightsync_pb2_grpc.WeightSyncServiceStub(channel)

    blobs = BlobStore(settings.blob_dir)
    blobs.sweep_staging()  # what a trainer killed mid-save left behind
    sessions = SessionManager(db, blobs, make_publisher(weightsync), settings.order_timeout_s,
                              settings.deterministic, settings.micro_batch_tokens,
                              state_every_steps=settings.session_state_every_steps,
                              state_with_weights=settings.session_state_with_weights,
                              max_sessions_per_account=settings.max_sessions_per_account, group=group,
                              drop_ephemeral=make_ephemeral_dropper(weightsync))
    endpoints = pb.Endpoints(rollout_url=settings.advertised_rollout_url or settings.rollout_url,
                             scheduler_url=settings.advertised_scheduler_url or settings.scheduler_url)

    def refuse_waiting_calls(stopping) -> None:
        stopping.wait()
        sessions.begin_shutdown()

    def shutdown() -> None:  # the calls in flight have finished (or had their grace period)
        if group is None or not group.broken.is_set():  # a broken group cannot save: the last records stand
            sessions.record_all()
        if group is not None:
            group.stop()
        channel.close()
        db.dispose()

    spec = ServiceSpec(
        name="trainer",
        register=lambda server: rpc.add_TrainerServiceServicer_to_server(TrainerServicer(sessions, endpoints),
                                                                          server),
        service_names=[pb.DESCRIPTOR.services_by_name["TrainerService"].full_name],
        on_shutdown=shutdown,
        background=[sessions.restore_all, refuse_waiting_calls],
    )
    return service_server(spec, settings, settings.trainer_port, db)


def build_process(settings: TrainerSettings) -> Server:
    """This process's part of the trainer: the whole trainer on one process; under torchrun rank 0's server over the
    group (a worker rank serves rank 0's commands here and exits when the group stops); with trainer_nproc /
    trainer_nnodes asking for a group, this process becomes its torchrun agent."""
    argv = trainer_group.launch_argv(settings)
    if argv is not None:
        os.execve(argv[0], argv, {**os.environ, **trainer_group.TORCHRUN_ENV})
    if not trainer_group.in_group():
        settings.parallel_dims(1)  # a layout for more ranks than one process is refused by name
        return build(settings)
    return _build_rank(settings)


def _build_rank(settings: TrainerSettings) -> Server:
    """One rank of the group (services/trainer/group.py). Rank 0's server stops as at SIGTERM when the group breaks
    (waiting calls get UNAVAILABLE, unrun) and the process then exits 1, for torchrun to restart the group."""
    import signal

    import torch.distributed as dist

    from services.trainer.engine.parallel.controller import Controller
    from services.trainer.sessions import SESSION_ADAMW

    settings.apply_torch_threads()
    dims, device = trainer_group.init_group(settings)
    host = trainer_group.EngineHost(dims, SESSION_ADAMW, device)
    if dist.get_rank() != 0:
        trainer_group.run_worker(settings, host)
        sys.exit(0)
    logging.getLogger("trainyard.trainer.group").info("trainer group of %d ranks (%s)", dims.world_size,
                                                      dims.describe())
    group = trainer_group.EngineGroup(Controller(host), host, on_broken=lambda: os.kill(os.getpid(), signal.SIGTERM))
    server = build(settings, group)
    shutdown = server.spec.on_shutdown

    def shutdown_then_exit() -> None:
        shutdown()
        if group.broken.is_set():
            os._exit(1)  # the workers' sockets close with this process; nothing else of it is worth waiting for
        dist.destroy_process_group()

    server.spec.on_shutdown = shutdown_then_exit
    return server


def main() -> None:
    run_service(TrainerSettings, build_process)


if __name__ == "__main__":
    main()
