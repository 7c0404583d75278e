"""The trainer process: Training API sessions over gRPC (python -m services.trainer)."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import grpc
from pydantic import Field

from services.common import channels
from services.common.auth import current_caller
from services.common.blobstore import CHUNK, BlobStore
from services.common.config import TrainyardSettings
from services.common.db import Database
from services.common.errors import Unavailable
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.common.protoconv import ts
from services.trainer.session_spec import CreateSpec, LoraSpec
from services.trainer.sessions import SESSION_ADAMW, SessionInfo, SessionManager
from services.trainer.tensors import from_torch
from services.weightsync.client import publish_dir
from trainyard.v1 import common_pb2, trainer_pb2 as pb, trainer_pb2_grpc as rpc, weightsync_pb2, weightsync_pb2_grpc


class TrainerSettings(TrainyardSettings):
    # How long a call waits for the calls with lower seq_id on its session before giving up.
    order_timeout_s: float = Field(default=600.0, gt=0)
    # Batch-invariant forward passes, so logprobs equal a deterministic rollout's bitwise (slower).
    deterministic: bool = False
    # Tokens per micro-batch of a Forward / ForwardBackward whose request leaves micro_batch_tokens at 0.
    micro_batch_tokens: int = Field(default=2048, ge=1)


ADAM_DEFAULTS = dataclasses.asdict(SESSION_ADAMW)
WEIGHT_KINDS = {"lora_adapter": weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER, "full": weightsync_pb2.WEIGHT_KIND_FULL}


def _optional(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def create_spec(request: pb.CreateSessionRequest) -> CreateSpec:
    lora = None
    if request.HasField("lora"):
        m = request.lora
        lora = LoraSpec(rank=_optional(m, "rank"), alpha=_optional(m, "alpha"), target_modules=tuple(m.target_modules),
                        train_attn=_optional(m, "train_attn"), train_mlp=_optional(m, "train_mlp"),
                        train_unembed=_optional(m, "train_unembed"))
    return CreateSpec(base_model=request.base_model, lora=lora, seed=request.seed,
                      full_parameter=request.full_parameter, from_state=request.from_state,
                      with_optimizer=request.with_optimizer)


def forward_response(outputs, metrics) -> pb.ForwardResponse:
    return pb.ForwardResponse(outputs=[pb.DatumOutput(loss_fn_outputs={"logprobs": from_torch(o)}) for o in outputs],
                              metrics=metrics)


def session_proto(info: SessionInfo) -> pb.Session:
    """The one conversion of a session to the wire."""
    return pb.Session(id=info.id, base_model=info.base_model, lora_rank=info.lora_rank, lora_alpha=info.lora_alpha,
                      target_modules=info.target_modules, next_seq_id=info.next_seq_id, optim_steps=info.optim_steps,
                      closed=info.closed, error=info.error, num_trainable_parameters=info.num_trainable_parameters,
                      full_parameter=info.full_parameter, lineage=info.lineage, vocab_size=info.vocab_size,
                      num_layers=info.num_layers, hidden_size=info.hidden_size, architecture=info.architecture,
                      created_at=ts(info.created_at))


class TrainerServicer(rpc.TrainerServiceServicer):
    def __init__(self, sessions: SessionManager):
        self.sessions = sessions

    def _session(self, sess) -> pb.Session:
        return session_proto(self.sessions.info(sess))

    def CreateSession(self, request, context):
        return self._session(self.sessions.create(current_caller().account_id, create_spec(request)))

    def GetSession(self, request, context):
        return session_proto(self.sessions.describe(current_caller().account_id, request.id))

    def CloseSession(self, request, context):
        return self._session(self.sessions.close(current_caller().account_id, request.id))

    def Forward(self, request, context):
        return forward_response(*self.sessions.forward(
            current_caller().account_id, request.session_id, request.seq_id, request.data, request.loss_fn,
            request.loss_fn_config, backward=False))

    def ForwardBackward(self, request, context):
        return forward_response(*self.sessions.forward(
            current_caller().account_id, request.session_id, request.seq_id, request.data, request.loss_fn,
            request.loss_fn_config, backward=True, micro_batch_tokens=request.micro_batch_tokens))

    def ForwardBackwardStream(self, request_iterator, context):
        return forward_response(*self.sessions.forward_backward_stream(current_caller().account_id,
                                                                       request_iterator))

    def OptimStep(self, request, context):
        adam = {k: (getattr(request.adam, k) if request.adam.HasField(k) else v) for k, v in ADAM_DEFAULTS.items()}
        step, metrics = self.sessions.optim_step(current_caller().account_id, request.session_id, request.seq_id, adam)
        return pb.OptimStepResponse(step=step, metrics=metrics)

    def SaveWeights(self, request, context):
        caller = current_caller()
        ckpt_id, version_id, path = self.sessions.save_weights(caller.account_id, caller.api_key, request.session_id,
                                                               request.seq_id, request.name)
        return pb.SaveWeightsResponse(checkpoint_id=ckpt_id, version_id=version_id, path=path)

    def SaveState(self, request, context):
        ckpt_id, path = self.sessions.save_state(current_caller().account_id, request.session_id, request.seq_id,
                                                 request.name)
        return pb.SaveStateResponse(checkpoint_id=ckpt_id, path=path)

    def LoadState(self, request, context):
        return self._session(self.sessions.load_state(current_caller().account_id, request.session_id,
                                                      request.seq_id, request.path, request.with_optimizer))

    def GetTokenizer(self, request, context):
        for path in self.sessions.tokenizer_files(current_caller().account_id, request.session_id):
            size, offset = path.stat().st_size, 0
            with open(path, "rb") as f:
                while data := f.read(CHUNK):
                    yield common_pb2.FileChunk(path=path.name, offset=offset, data=data, file_size=size,
                                               sha256=hashlib.sha256(data).hexdigest())
                    offset += len(data)


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
                              settings.deterministic, settings.micro_batch_tokens)

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
