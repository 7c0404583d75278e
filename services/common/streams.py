"""Client-streaming uploads: a header message first, then data messages."""
from __future__ import annotations

from collections.abc import Iterator

from services.common.errors import InvalidArgument


def split_header(requests: Iterator, header_field: str = "header", data_field: str = "chunk") -> tuple[object, Iterator]:
    """The stream's header and an iterator over the data messages that follow it (each must be data_field)."""
    first = next(requests, None)
    if first is None or first.WhichOneof("part") != header_field:
        raise InvalidArgument("the first message of the stream must carry the header", field=header_field)

    def data() -> Iterator:
        for req in requests:
            if req.WhichOneof("part") != data_field:
                raise InvalidArgument("only one header is allowed, as the first message", field=header_field)
            yield getattr(req, data_field)

    return getattr(first, header_field), data()
