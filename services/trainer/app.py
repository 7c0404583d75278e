"""The trainer process: settings, the weight-sync publisher and the server around the Training API sessions
(python -m services.trainer); the gRPC adapter is servicer.py."""
from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import Field

from services.common import channels
from services.common.channels import auth_metadata
from services.common.blobstore import BlobStore
from services.common.config import TrainyardSettings
from services.common.db import Database
from services.common.errors import Unavailable
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
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


WEIGHT_KINDS = {"lora_adapter": weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER, "full": weightsync_pb2.WEIGHT_KIND_FULL}


def make_publisher(weightsync: weightsync_pb2_grpc.WeightSyncServiceStub):
    """SessionManager's publish: the saved directory as the next version of the session's lineage."""

    def publish(api_key: str, sess, directory: Path, kind: str) -> str:
        try:
            parent = sess.weight_version_id
            if parent is None:  # a restored session goes on from its lineage's newest version
                versions = weightsync.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=sess.id),
                                                   metadata=auth_metadata(api_key)).versions
                parent = versions[-1].id if versions else ""
            version = publish_dir(weightsync, api_key, lineage=sess.id, parent_id=parent, kind=WEIGHT_KINDS[kind],
                                  base_model=sess.base_model, directory=directory,
                                  metadata={"optim_steps": str(sess.optim_steps)})
        except grpc.RpcError as exc:  # the session's state is intact: the caller can save again
            raise Unavailable(f"the weights were not published to the weight-sync service: {exc.details()}") from None
        return version.id

    return publish


def build(settings: TrainerSettings) -> Server:
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
                              max_sessions_per_account=settings.max_sessions_per_account)

    def refuse_waiting_calls(stopping) -> None:
        stopping.wait()
        sessions.begin_shutdown()

    def shutdown() -> None:  # the calls in flight have finished (or had their grace period)
        sessions.record_all()
        channel.close()
        db.dispose()

    spec = ServiceSpec(
        name="trainer",
        register=lambda server: rpc.add_TrainerServiceServicer_to_server(TrainerServicer(sessions), server),
        service_names=[pb.DESCRIPTOR.services_by_name["TrainerService"].full_name],
        on_shutdown=shutdown,
        background=[sessions.restore_all, refuse_waiting_calls],
    )
    return service_server(spec, settings, settings.trainer_port, db)


def main() -> None:
    run_service(TrainerSettings, build)


if __name__ == "__main__":
    main()
