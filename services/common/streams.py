"""Client-streaming uploads: a header message first, then data messages."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from services.common.errors import Cancelled, InvalidArgument


def client_messages(requests: Iterable) -> Iterator:
    """A client stream's messages; a stream the client cancels or breaks ends the call as CANCELLED (gRPC's request
    iterator raises RpcError then), not as an internal error."""
    it = iter(requests)
    while True:
        try:
            msg = next(it)
        except StopIteration:
            return
        except grpc.RpcError:
            raise Cancelled("the client ended the stream before its last message") from None
        yield msg


def split_header(requests: Iterable, header_field: str = "header", data_field: str = "chunk") -> tuple[object, Iterator]:
    """The stream's header and an iterator over the data messages that follow it (each must be data_field)."""
    requests = client_messages(requests)
    first = next(requests, None)
    if first is None or first.WhichOneof("part") != header_field:
        raise InvalidArgument("the first message of the stream must carry the header", field=header_field)

    def data() -> Iterator:
        for req in requests:
            if req.WhichOneof("part") != data_field:
                raise InvalidArgument("only one header is allowed, as the first message", field=header_field)
            yield getattr(req, data_field)

    return getattr(first, header_field), data()
