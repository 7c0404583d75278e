"""Domain errors and their one mapping to gRPC status codes.

Cores raise these; the server interceptor (services/common/grpcserver.py) turns them into statuses, so servicer methods
hold no try/except. INVALID_ARGUMENT carries every FieldViolation in google.rpc.BadRequest details as well as in the
message, so a plain gRPC client still sees which field or row is wrong.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Violation:
    field: str
    reason: str
    row: int = 0

    def __str__(self) -> str:
        where = f"row {self.row}" if self.row else ""
        if self.field:
            where = f"{where}, field '{self.field}'" if where else f"field '{self.field}'"
        return f"{where}: {self.reason}" if where else self.reason


class TrainyardError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(TrainyardError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str = "", *, field: str = "", violations: list[Violation] | None = None,
                 truncated: bool = False):
        self.violations = list(violations or [])
        if field and not self.violations:
            self.violations = [Violation(field=field, reason=message)]
        if not message:
            message = summarize(self.violations, truncated=truncated)
        elif field:
            message = f"{field}: {message}"
        super().__init__(message)


class NotFound(TrainyardError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TrainyardError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(TrainyardError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(TrainyardError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TrainyardError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TrainyardError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(TrainyardError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(TrainyardError):
    """Stored bytes are damaged or missing: what was read does not hash to the sha256 its row recorded."""

    code = grpc.StatusCode.DATA_LOSS


class Aborted(TrainyardError):
    """What the caller relied on is gone (a restarted trainer restored a session to before calls it had answered)."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(TrainyardError):
    """What the call waited for did not happen before its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TrainyardError):
    """The client ended the call early (e.g. broke off a stream)."""

    code = grpc.StatusCode.CANCELLED


def summarize(violations: list[Violation], *, limit: int = 5, truncated: bool = False) -> str:
    shown = "; ".join(str(v) for v in violations[:limit])
    more = len(violations) - limit
    if more > 0 or truncated:
        shown += f" (and {max(more, 0)}{'+' if truncated else ''} more)"
    return shown or "invalid argument"


def log_internal(logger: logging.Logger, where: str, exc: BaseException) -> str:
    """Log exc with its traceback under a fresh error id, and return what the client may see of it: the id, never
    the exception's text, which can hold SQL, file paths or another account's data."""
    ref = secrets.token_hex(8)
    logger.error("internal error %s in %s", ref, where, exc_info=exc)
    return f"internal error in {where} (error id {ref}; the service's log has the details)"


def not_found(kind: str, ident: str) -> NotFound:
    """The same message whether the object does not exist or belongs to another account."""
    return NotFound(f"{kind} '{ident}' not found")


class AttemptLost(Exception):
    """A process a managed job's attempt runs on died (a rank of its torchrun group, the job's rollout process): the
    attempt failed, but another may not. The worker hands the job back (Ledger.abandon) and the scheduler's reaper
    retries it from its latest checkpoint, as when the worker itself is lost. Not a gRPC error: it never leaves the
    worker."""
