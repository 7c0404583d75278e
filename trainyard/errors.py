"""Errors raised by the SDK: the server's status code, its message and any field/row violations."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

T = TypeVar("T")


@dataclass(frozen=True)
class FieldError:
    field: str
    reason: str
    row: int = 0  # 1-based row of an uploaded file; 0 when the problem is not tied to a row


def _field_error(field: str, reason: str) -> FieldError:
    """The server writes row-level violations as 'row N: field' (google.rpc.BadRequest has no row)."""
    head, sep, rest = field.partition(": ")
    if sep and head.startswith("row ") and head[4:].isdigit():
        return FieldError(field=rest, reason=reason, row=int(head[4:]))
    return FieldError(field=field, reason=reason)


class TrainyardError(Exception):
    def __init__(self, code: str, message: str, violations: list[FieldError] | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.violations = violations or []

    @property
    def field(self) -> str:
        """The first field the server named as wrong ("" when none): e.g. "data[2].loss_fn_inputs['weights']"."""
        return self.violations[0].field if self.violations else ""


def from_rpc_error(exc: grpc.RpcError) -> TrainyardError:
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    message = exc.details() if hasattr(exc, "details") else str(exc)
    violations = []
    try:
        status = rpc_status.from_call(exc)
    except ValueError:
        status = None
    for detail in getattr(status, "details", []) or []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations = [_field_error(v.field, v.description) for v in bad.field_violations]
    if code == "UNAVAILABLE" and (message or "").lower().startswith("failed to connect"):
        message = f"cannot reach the server ({message})"
    return TrainyardError(code, message or "", violations)


def translate(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
    return wrapper


def translate_iter(it: Iterator[T]) -> Iterator[T]:
    try:
        yield from it
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
