"""Training API datums off the wire: trainer_pb2.Datum checked into the engine's Datum (every error names data[i] and
the field), a client stream's messages, and a stream the client ends early (CANCELLED)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc
import torch

from services.common.errors import InvalidArgument, TrainyardError
from services.trainer.engine import losses
from services.trainer.engine.forward_backward import Datum
from services.trainer.tensors import to_torch


def check_datum(d, index: int, loss_fn: str, vocab_size: int) -> Datum:
    """A wire Datum (trainer_pb2.Datum) checked against the loss; every error names data[index] and the field."""
    where = f"data[{index}]"
    if not d.tokens:
        raise InvalidArgument("model input is empty", field=f"{where}.tokens")
    tokens = torch.tensor(list(d.tokens), dtype=torch.int64)
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise InvalidArgument(f"token ids must be in [0, {vocab_size})", field=f"{where}.tokens")
    raw = {key: to_torch(t, f"{where}.loss_fn_inputs['{key}']") for key, t in d.loss_fn_inputs.items()}
    return Datum(tokens, losses.check_datum(loss_fn, raw, len(tokens), vocab_size, where=where))


class Cancelled(TrainyardError):
    code = grpc.StatusCode.CANCELLED


def client_messages(messages: Iterable) -> Iterator:
    """A client stream's messages; a stream the client cancels or breaks ends the call as CANCELLED (the session is
    not at fault, and the call restores its gradients like any failed call)."""
    it = iter(messages)
    while True:
        try:
            msg = next(it)
        except StopIteration:
            return
        except grpc.RpcError:
            raise Cancelled("the client ended the stream before its last message") from None
        yield msg


def stream_datums(messages: Iterator, loss_fn: str, vocab_size: int) -> Iterator[Datum]:
    """The checked datums of a ForwardBackwardStream's messages after the header, numbered across messages as
    data[0], data[1], ... (as in the unary call)."""
    index = 0
    for n, msg in enumerate(messages, start=1):
        if msg.WhichOneof("item") != "datums":
            raise InvalidArgument("only the first message is a header; later ones carry datums",
                                  field=f"messages[{n}]")
        for d in msg.datums.data:
            yield check_datum(d, index, loss_fn, vocab_size)
            index += 1
