"""The trainer process: Training API sessions over gRPC (python -m services.trainer)."""
from __future__ import annotations

from pydantic import Field

from services.common import channels
from services.common.auth import current_caller
from services.common.blobstore import BlobStore
from services.common.config import TrainyardSettings
from services.common.db import Database
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.common.protoconv import ts
from services.trainer.sessions import SessionManager
from services.trainer.tensors import from_torch
from services.weightsync.client import publish_dir
from trainyard.v1 import trainer_pb2 as pb, trainer_pb2_grpc as rpc, weightsync_pb2, weightsync_pb2_grpc


class TrainerSettings(TrainyardSettings):
    # How long a call waits for the calls with lower seq_id on its session before giving up.
    order_timeout_s: float = Field(default=600.0, gt=0)
    # Batch-invariant forward passes, so logprobs equal a deterministic rollout's bitwise (slower).
    deterministic: bool = False


ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}


class TrainerServicer(rpc.TrainerServiceServicer):
    def __init__(self, sessions: SessionManager):
        self.sessions = sessions

    def _session(self, sess) -> pb.Session:
        msg = self.sessions.info(sess)
        msg.created_at.CopyFrom(ts(sess.created_at))
        return msg

    def CreateSession(self, request, context):
        lora = request.lora
        sess = self.sessions.create(
            current_caller().account_id, request.base_model, lora.rank if lora.HasField("rank") else None,
            lora.alpha if lora.HasField("alpha") else None, list(lora.target_modules), request.seed)
        return self._session(sess)

    def GetSession(self, request, context):
        return self._session(self.sessions.get(current_caller().account_id, request.id))

    def CloseSession(self, request, context):
        return self._session(self.sessions.close(current_caller().account_id, request.id))

    def _forward(self, request, backward: bool) -> pb.ForwardResponse:
        outputs, metrics = self.sessions.forward(current_caller().account_id, request.session_id, request.seq_id,
                                                 request.data, request.loss_fn, backward)
        return pb.ForwardResponse(outputs=[pb.DatumOutput(loss_fn_outputs={"logprobs": from_torch(o)})
                                           for o in outputs], metrics=metrics)

    def Forward(self, request, context):
        return self._forward(request, backward=False)

    def ForwardBackward(self, request, context):
        return self._forward(request, backward=True)

    def OptimStep(self, request, context):
        adam = {k: (getattr(request.adam, k) if request.adam.HasField(k) else v) for k, v in ADAM_DEFAULTS.items()}
        step, metrics = self.sessions.optim_step(current_caller().account_id, request.session_id, request.seq_id, adam)
        return pb.OptimStepResponse(step=step, metrics=metrics)

    def SaveWeights(self, request, context):
        caller = current_caller()
        ckpt_id, version_id = self.sessions.save_weights(caller.account_id, caller.api_key, request.session_id,
                                                         request.seq_id, request.name)
        return pb.SaveWeightsResponse(checkpoint_id=ckpt_id, version_id=version_id)


def build(settings: TrainerSettings) -> Server:
    settings.ensure_dirs()
    settings.apply_torch_threads()
    db = Database(settings.database_url)
    channel = channels.open_channel(settings.weightsync_url, settings.grpc_max_message_mb)
    weightsync = weightsync_pb2_grpc.WeightSyncServiceStub(channel)

    def publish(api_key, sess, adapter_dir) -> str:
        version = publish_dir(weightsync, api_key, lineage=sess.id, parent_id=sess.weight_version_id,
                              kind=weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER, base_model=sess.base_model,
                              directory=adapter_dir, metadata={"optim_steps": str(sess.optim_steps)})
        return version.id

    sessions = SessionManager(db, BlobStore(settings.blob_dir), publish, settings.order_timeout_s,
                              settings.deterministic)

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
