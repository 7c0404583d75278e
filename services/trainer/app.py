"""The trainer process: settings, the weight-sync publisher and the server around the Training API sessions
(python -m services.trainer); the gRPC adapter is servicer.py."""
from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import Field

from services.common import channels
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
    # Quota: open Training API sessions per account on this trainer (each holds an adapter and its AdamW state, or
    # for a full-parameter session a copy of the model); CreateSession beyond it is RESOURCE_EXHAUSTED.
    max_sessions_per_account: int = Field(default=64, ge=1)


WEIGHT_KINDS = {"lora_adapter": weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER, "full": weightsync_pb2.WEIGHT_KIND_FULL}


def make_publisher(weightsync: weightsync_pb2_grpc.WeightSyncServiceStub):
    """SessionManager's publish: the saved directory as the next version of the session's lineage."""

    def publish(api_key: str, sess, directory: Path, kind: str) -> str:
        try:
            version = publish_dir(weightsync, api_key, lineage=sess.id, parent_id=sess.weight_version_id,
                                  kind=WEIGHT_KINDS[kind], base_model=sess.base_model, directory=directory,
                                  metadata={"optim_steps": str(sess.optim_steps)})
        except grpc.RpcError as exc:  # the session's state is intact: the caller can save again
            raise Unavailable(f"the weights were not published to the weight-sync service: {exc.details()}") from None
        return version.id

    return publish


def build(settings: TrainerSettings) -> Server:
    settings.ensure_dirs()
    settings.apply_torch_threads()
    db = Database(settings.database_url)
    channel = channels.open_channel(settings.weightsync_url, settings.grpc_max_message_mb)
    weightsync = weightsync_pb2_grpc.WeightSyncServiceStub(channel)

    sessions = SessionManager(db, BlobStore(settings.blob_dir), make_publisher(weightsync), settings.order_timeout_s,
                              settings.deterministic, settings.micro_batch_tokens,
                              max_sessions_per_account=settings.max_sessions_per_account)

    def shutdown() -> None:
        channel.close()
        db.dispose()

    spec = ServiceSpec(
        name="trainer",
        register=lambda server: rpc.add_TrainerServiceServicer_to_server(TrainerServicer(sessions), server),
        service_names=[pb.DESCRIPTOR.services_by_name["TrainerService"].full_name],
        on_shutdown=shutdown,
    )
    return service_server(spec, settings, settings.trainer_port, db)


def main() -> None:
    run_service(TrainerSettings, build)


if __name__ == "__main__":
    main()
