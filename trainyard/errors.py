"""Errors raised by the SDK: the server's status code, its message and any field/row violations.

A TrainyardError is also an instance of the Tinker exception class its status code corresponds to (NOT_FOUND ->
NotFoundError, INVALID_ARGUMENT -> BadRequestError, UNAVAILABLE -> APIConnectionError, ...), so `except
tinker.BadRequestError` clauses work with `import trainyard as tinker` (docs/tinker_compat.md)."""
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


class TinkerError(Exception):
    """Tinker's exception classes, as bases of TrainyardError's per-code classes."""


class APIError(TinkerError):
    pass


class APIStatusError(APIError):
    pass


class APIConnectionError(APIError):
    pass


class APITimeoutError(APIConnectionError):
    pass


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


# gRPC status -> (Tinker class, the HTTP status Tinker's would carry)
_TINKER = {"INVALID_ARGUMENT": (BadRequestError, 400), "OUT_OF_RANGE": (BadRequestError, 400),
           "UNAUTHENTICATED": (AuthenticationError, 401), "PERMISSION_DENIED": (PermissionDeniedError, 403),
           "NOT_FOUND": (NotFoundError, 404), "ALREADY_EXISTS": (ConflictError, 409), "ABORTED": (ConflictError, 409),
           "FAILED_PRECONDITION": (UnprocessableEntityError, 422), "RESOURCE_EXHAUSTED": (RateLimitError, 429),
           "INTERNAL": (InternalServerError, 500), "UNKNOWN": (InternalServerError, 500),
           "DATA_LOSS": (InternalServerError, 500), "UNIMPLEMENTED": (InternalServerError, 501),
           "UNAVAILABLE": (APIConnectionError, None), "DEADLINE_EXCEEDED": (APITimeoutError, None),
           "CANCELLED": (APIError, None)}


class TrainyardError(APIError):
    def __new__(cls, code: str, *args, **kwargs):
        if cls is TrainyardError and code in _BY_CODE:
            cls = _BY_CODE[code]
        return super().__new__(cls, code, *args)

    @property
    def status_code(self) -> int | None:
        """The HTTP status Tinker's error of this kind carries (None for connection errors)."""
        return _TINKER.get(self.code, (None, None))[1]

    def __init__(self, code: str, message: str, violations: list[FieldError] | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.violations = violations or []

    @property
    def field(self) -> str:
        """The first field the server named as wrong ("" when none): e.g. "data[2].loss_fn_inputs['weights']"."""
        return self.violations[0].field if self.violations else ""


_BY_CODE = {code: type(f"TrainyardError_{code}", (TrainyardError, base), {"__module__": __name__,
                                                                          "__qualname__": "TrainyardError"})
            for code, (base, _) in _TINKER.items()}


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
