"""gRPC adapter for the Training API sessions: the one conversion between trainer_pb2 and the core's types. No logic
and no try/except here: errors map in the interceptor (services/common/grpcserver.py).

Datums convert lazily, in the call's turn (the session manager consumes them), so a bad tensor fails its call in
order and uses up its seq_id like any other bad input.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from services.common import calls
from services.common.auth import current_caller
from services.common.blobstore import CHUNK
from services.common.errors import InvalidArgument
from services.common.protoconv import opt, ts
from services.common.streams import client_messages
from services.trainer.datums import DatumInput
from services.trainer.engine import AdamW
from services.trainer.session_spec import CreateSpec, LoraSpec
from services.trainer.session_states import SaveOptions
from services.trainer.sessions import SESSION_ADAMW, SessionInfo, SessionManager
from trainyard.v1 import common_pb2, trainer_pb2 as pb, trainer_pb2_grpc as rpc

DTYPES = {pb.TensorData.DTYPE_FLOAT32: (np.float32, torch.float32), pb.TensorData.DTYPE_INT64: (np.int64, torch.int64)}
# Loss inputs are [T] or [T, K]; a few more dimensions cost nothing, numpy stops at 64.
MAX_DIMS = 8
# Call metadata of an ordered call: the highest seq_id whose answer the client has (trainer.proto; the SDK sends it).
ANSWERED_KEY = "trainyard-answered-seq-id"


def answered_seq_id(context) -> int:
    """context: the call's grpc.ServicerContext."""
    value = dict(context.invocation_metadata()).get(ANSWERED_KEY, "0")
    if not (isinstance(value, str) and value.isdigit() and len(value) <= 18):
        raise InvalidArgument(f"must be a seq_id (up to 18 digits), got {value!r}", field=f"metadata {ANSWERED_KEY}")
    return int(value)


# -- tensors ----------------------------------------------------------------------------------------------------
def to_torch(t: pb.TensorData, field: str) -> torch.Tensor:
    if t.dtype not in DTYPES:
        raise InvalidArgument("dtype must be DTYPE_FLOAT32 or DTYPE_INT64", field=f"{field}.dtype")
    np_dtype, _ = DTYPES[t.dtype]
    shape = tuple(int(s) for s in t.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"at most {MAX_DIMS} dimensions, got {len(shape)}", field=f"{field}.shape")
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"negative dimension in shape {list(shape)}", field=f"{field}.shape")
    count = math.prod(shape)  # exact: numpy's product of int64 wraps around ([2**32, 2**32] -> 0)
    itemsize = np.dtype(np_dtype).itemsize
    if len(t.data) != count * itemsize:
        raise InvalidArgument(f"{len(t.data)} bytes do not hold shape {list(shape)} of "
                              f"{pb.TensorData.DType.Name(t.dtype)} ({count * itemsize} bytes)", field=f"{field}.data")
    arr = np.frombuffer(t.data, dtype=np.dtype(np_dtype).newbyteorder("<")).reshape(shape)
    return torch.from_numpy(arr.astype(np_dtype, copy=True))


def from_torch(x: torch.Tensor) -> pb.TensorData:
    x = x.detach().cpu()
    if x.is_floating_point():
        arr, dtype = x.to(torch.float32).numpy().astype("<f4"), pb.TensorData.DTYPE_FLOAT32
    else:
        arr, dtype = x.to(torch.int64).numpy().astype("<i8"), pb.TensorData.DTYPE_INT64
    return pb.TensorData(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


# -- requests ---------------------------------------------------------------------------------------------------
def create_spec(request: pb.CreateSessionRequest) -> CreateSpec:
    lora = None
    if request.HasField("lora"):
        m = request.lora
        lora = LoraSpec(rank=opt(m, "rank"), alpha=opt(m, "alpha"), target_modules=tuple(m.target_modules),
                        train_attn=opt(m, "train_attn"), train_mlp=opt(m, "train_mlp"),
                        train_unembed=opt(m, "train_unembed"))
    return CreateSpec(base_model=request.base_model, lora=lora, seed=request.seed,
                      full_parameter=request.full_parameter, from_state=request.from_state,
                      with_optimizer=request.with_optimizer)


def datum_input(d: pb.Datum, index: int) -> DatumInput:
    where = f"data[{index}]"
    return DatumInput(tokens=torch.tensor(list(d.tokens), dtype=torch.int64),
                      loss_fn_inputs={key: to_torch(t, f"{where}.loss_fn_inputs['{key}']")
                                      for key, t in d.loss_fn_inputs.items()})


def datum_inputs(data: Iterable[pb.Datum]) -> Iterator[DatumInput]:
    """The datums converted one at a time, as the core asks for them."""
    for i, d in enumerate(data):
        yield datum_input(d, i)


def stream_request(messages: Iterable[pb.ForwardBackwardStreamRequest]) -> tuple[pb.ForwardBackwardRequest,
                                                                                  Iterator[DatumInput]]:
    """A ForwardBackwardStream's header, and its datums as they arrive, numbered across messages as data[0],
    data[1], ... (as in the unary call)."""
    messages = client_messages(messages)
    first = next(messages, None)
    if first is None or first.WhichOneof("item") != "header":
        raise InvalidArgument("the first message must be the header", field="header")
    if first.header.data:
        raise InvalidArgument("must be empty: datums follow in later messages", field="header.data")

    def datums() -> Iterator[DatumInput]:
        index = 0
        for n, msg in enumerate(messages, start=1):
            if msg.WhichOneof("item") != "datums":
                raise InvalidArgument("only the first message is a header; later ones carry datums",
                                      field=f"messages[{n}]")
            for d in msg.datums.data:
                yield datum_input(d, index)
                index += 1

    return first.header, datums()


def adamw(m: pb.AdamParams) -> AdamW:
    """The request's AdamW settings, the session defaults (SESSION_ADAMW) for the fields it leaves unset."""
    return AdamW(**{f.name: (getattr(m, f.name) if m.HasField(f.name) else getattr(SESSION_ADAMW, f.name))
                    for f in dataclasses.fields(AdamW)})


# -- responses --------------------------------------------------------------------------------------------------
def forward_response(outputs: list[torch.Tensor], metrics: dict[str, float]) -> pb.ForwardResponse:
    return pb.ForwardResponse(outputs=[pb.DatumOutput(loss_fn_outputs={"logprobs": from_torch(o)}) for o in outputs],
                              metrics=metrics)


def session_proto(info: SessionInfo) -> pb.Session:
    return pb.Session(id=info.id, base_model=info.base_model, lora_rank=info.lora_rank, lora_alpha=info.lora_alpha,
                      target_modules=info.target_modules, next_seq_id=info.next_seq_id, optim_steps=info.optim_steps,
                      closed=info.closed, error=info.error, num_trainable_parameters=info.num_trainable_parameters,
                      full_parameter=info.full_parameter, lineage=info.lineage, vocab_size=info.vocab_size,
                      num_layers=info.num_layers, hidden_size=info.hidden_size, architecture=info.architecture,
                      created_at=ts(info.created_at), last_request_at=ts(info.last_request_at),
                      last_state_checkpoint_id=info.last_state_checkpoint_id,
                      last_weights_checkpoint_id=info.last_weights_checkpoint_id)


def save_options(request: pb.SaveWeightsRequest | pb.SaveStateRequest) -> SaveOptions:
    return SaveOptions(ttl_seconds=opt(request, "ttl_seconds"), user_metadata=tuple(request.user_metadata.items()))


class TrainerServicer(rpc.TrainerServiceServicer):
    def __init__(self, sessions: SessionManager, endpoints: pb.Endpoints | None = None):
        self.sessions = sessions
        self.endpoints = endpoints or pb.Endpoints()  # what GetEndpoints advertises (the trainer's settings)

    def _session(self, sess) -> pb.Session:
        return session_proto(self.sessions.info(sess))

    def CreateSession(self, request, context):
        return self._session(self.sessions.create(current_caller().account_id, create_spec(request)))

    def GetSession(self, request, context):
        return session_proto(self.sessions.describe(current_caller().account_id, request.id))

    def CloseSession(self, request, context):
        caller = current_caller()
        return session_proto(self.sessions.close(caller.account_id, request.id, caller.api_key))

    def Forward(self, request, context):
        return forward_response(*self.sessions.forward(
            current_caller().account_id, request.session_id, request.seq_id, datum_inputs(request.data),
            request.loss_fn, dict(request.loss_fn_config), backward=False, answered=answered_seq_id(context),
            cancel=calls.current()))

    def ForwardBackward(self, request, context):
        return forward_response(*self.sessions.forward(
            current_caller().account_id, request.session_id, request.seq_id, datum_inputs(request.data),
            request.loss_fn, dict(request.loss_fn_config), backward=True,
            micro_batch_tokens=request.micro_batch_tokens, answered=answered_seq_id(context), cancel=calls.current()))

    def ForwardBackwardStream(self, request_iterator, context):
        header, datums = stream_request(request_iterator)
        return forward_response(*self.sessions.forward(
            current_caller().account_id, header.session_id, header.seq_id, datums, header.loss_fn,
            dict(header.loss_fn_config), backward=True, micro_batch_tokens=header.micro_batch_tokens, streamed=True,
            answered=answered_seq_id(context), cancel=calls.current()))

    def OptimStep(self, request, context):
        step, metrics = self.sessions.optim_step(current_caller().account_id, request.session_id, request.seq_id,
                                                 adamw(request.adam), answered=answered_seq_id(context),
                                                 cancel=calls.current())
        return pb.OptimStepResponse(step=step, metrics=metrics)

    def SaveWeights(self, request, context):
        caller = current_caller()
        ckpt_id, version_id, path = self.sessions.save_weights(caller.account_id, caller.api_key, request.session_id,
                                                               request.seq_id, request.name, request.ephemeral,
                                                               answered=answered_seq_id(context),
                                                               cancel=calls.current(), options=save_options(request))
        return pb.SaveWeightsResponse(checkpoint_id=ckpt_id, version_id=version_id, path=path)

    def SaveState(self, request, context):
        ckpt_id, path = self.sessions.save_state(current_caller().account_id, request.session_id, request.seq_id,
                                                 request.name, answered=answered_seq_id(context),
                                                 cancel=calls.current(), options=save_options(request))
        return pb.SaveStateResponse(checkpoint_id=ckpt_id, path=path)

    def LoadState(self, request, context):
        return self._session(self.sessions.load_state(current_caller().account_id, request.session_id,
                                                      request.seq_id, request.path, request.with_optimizer,
                                                      answered=answered_seq_id(context), cancel=calls.current()))

    def GetTokenizer(self, request, context):
        for path in self.sessions.tokenizer_files(current_caller().account_id, request.session_id):
            size, offset = path.stat().st_size, 0
            with open(path, "rb") as f:
                while data := f.read(CHUNK):
                    yield common_pb2.FileChunk(path=path.name, offset=offset, data=data, file_size=size,
                                               sha256=hashlib.sha256(data).hexdigest())
                    offset += len(data)

    def ListSessions(self, request, context):
        infos, total = self.sessions.list_sessions(current_caller().account_id, request.limit, request.offset)
        return pb.ListSessionsResponse(sessions=[session_proto(i) for i in infos], total=total)
    def GetEndpoints(self, request, context):
        return self.endpoints
