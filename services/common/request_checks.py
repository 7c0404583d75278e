"""What every request message must satisfy, whatever the RPC: checked by the server interceptor
(services/common/grpcserver.py) before any servicer runs, so no call touches state with such a value.

- Strings hold no NUL character. Postgres cannot store one in text (psycopg refuses the value), so a name or an id
  with one would fail its write after whatever the call did before it; and no name, id or path of ours has one.
  Invalid UTF-8 never gets this far: the protobuf parser refuses it, and the interceptor answers that as
  INVALID_ARGUMENT too (`Undecodable`).
- Floats and doubles are finite. Every float a request carries is a hyperparameter, a sampling parameter or a loss
  setting; NaN passes every `x > 0` bound and infinity overflows whatever it touches.

Each violation names the field's path in the message as the cores do: "spec.sft.lora.alpha", "data[2].tokens",
"loss_fn_inputs['weights']"; messages of a client stream after the first are prefixed "messages[n].".
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.common.errors import InvalidArgument, Violation

_STRING = FieldDescriptor.TYPE_STRING
_FLOATS = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
_MESSAGE = FieldDescriptor.TYPE_MESSAGE


class Undecodable:
    """Stands in for a request whose bytes do not parse as its message (e.g. a string field of invalid UTF-8): the
    gRPC runtime would answer a failed parse with INTERNAL, so the interceptor's deserializer hands this over and
    check() turns it into INVALID_ARGUMENT."""

    def __init__(self, reason: str):
        self.reason = reason


def deserializer(parse):
    """The handler's request parser, returning Undecodable instead of raising."""
    if parse is None:
        return None

    def parse_or_report(data: bytes):
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or any parser error on arbitrary bytes
            return Undecodable(str(exc))

    return parse_or_report


def check(request, prefix: str = ""):
    """The request if every field is storable and finite; InvalidArgument naming each field that is not."""
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"{prefix}not a valid request message: {request.reason}")
    found: list[Violation] = []
    _walk(request, prefix, found)
    if found:
        raise InvalidArgument(violations=found)
    return request


def check_stream(requests: Iterable) -> Iterator:
    """A client stream's messages, each checked as the servicer takes it."""
    for n, request in enumerate(requests):
        yield check(request, f"messages[{n}]." if n else "")


@functools.cache
def _checked_type(desc) -> bool:
    """Whether a message type holds a string or a float anywhere below it (TensorData, say, does not: its values
    are not walked, which keeps a ForwardBackward of thousands of datums cheap)."""
    def holds(fd: FieldDescriptor, seen: frozenset) -> bool:
        if fd.type == _STRING or fd.type in _FLOATS:
            return True
        sub = fd.message_type
        return fd.type == _MESSAGE and sub.full_name not in seen and any(
            holds(f, seen | {sub.full_name}) for f in sub.fields)
    return any(holds(f, frozenset({desc.full_name})) for f in desc.fields)


def _walk(msg: Message, prefix: str, found: list[Violation]) -> None:
    for fd, value in msg.ListFields():  # set fields only: defaults ("" and 0.0) are always fine
        path = prefix + fd.name
        if fd.type == _MESSAGE and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for key, item in value.items():
                where = f"{path}[{key!r}]"
                if key_fd.type == _STRING and "\x00" in key:
                    found.append(Violation(field=where, reason="the key must not contain a NUL character"))
                _value(value_fd, item, where, found)
        elif fd.is_repeated:
            if fd.type == _STRING or fd.type in _FLOATS or (fd.type == _MESSAGE and _checked_type(fd.message_type)):
                for i, item in enumerate(value):
                    _value(fd, item, f"{path}[{i}]", found)
        else:
            _value(fd, value, path, found)


def _value(fd: FieldDescriptor, value, path: str, found: list[Violation]) -> None:
    if fd.type == _MESSAGE:
        if _checked_type(fd.message_type):
            _walk(value, path + ".", found)
    elif fd.type == _STRING:
        if "\x00" in value:
            found.append(Violation(field=path, reason="must not contain a NUL character"))
    elif fd.type in _FLOATS and not math.isfinite(value):
        found.append(Violation(field=path, reason=f"must be a finite number, got {value}"))
