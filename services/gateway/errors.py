"""The one mapping from Trainyard errors to the gateway's HTTP answers and failed futures (docs/gateway.md).

Every error body is Tinker's RequestFailedResponse, {"error": message, "category": "user" | "server"}, with the
Trainyard status code and, where one field is at fault, its name: {"code": "INVALID_ARGUMENT", "field": "..."}. The
HTTP status is the one Tinker's error class of that code carries (trainyard/errors.py), so the unmodified SDK raises
the same exception class (BadRequestError, NotFoundError, ...) as trainyard's drop-in SDK does; a failed future's
body is the same JSON under 200, which the SDK raises as RequestFailedError.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse

from services.common import errors as service_errors
from trainyard import errors as sdk_errors

# Codes without an HTTP status in Tinker's table (connection-level there).
_NO_HTTP = {"UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499,
            "EXPIRED": 410}  # the gateway's own: a future or session that is gone (the SDK resends or stops)
# Failures the caller's request caused (Tinker's "user" category); everything else is the platform's ("server").
USER_CODES = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION",
              "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "ABORTED"}


@dataclass
class GatewayError(Exception):
    """An error answered as it is: code is a Trainyard (gRPC) status code name."""
    code: str
    message: str
    field: str = ""
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def bad_request(field: str, reason: str) -> GatewayError:
    return GatewayError("INVALID_ARGUMENT", f"{field}: {reason}", field)


def classify(exc: BaseException) -> GatewayError:
    """Any error raised while serving a request as a GatewayError (an unexpected one is INTERNAL)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, sdk_errors.TrainyardError):
        return GatewayError(exc.code, exc.message, exc.field)
    if isinstance(exc, service_errors.TrainyardError):
        return GatewayError(exc.code.name, str(exc))
    if isinstance(exc, ValueError):  # the trainyard SDK's checks of a request, naming the field first
        message = str(exc)
        return GatewayError("INVALID_ARGUMENT", message, message.split(":", 1)[0] if ":" in message else "")
    return GatewayError("INTERNAL", f"{type(exc).__name__}: {exc}")


def http_status(code: str) -> int:
    status = sdk_errors.TrainyardError(code, "").status_code
    return status if status is not None else _NO_HTTP.get(code, 500)


def body(err: GatewayError) -> dict:
    out = {"error": err.message, "category": "user" if err.code in USER_CODES else "server", "code": err.code}
    if err.field:
        out["field"] = err.field
    return out


def response(exc: BaseException) -> JSONResponse:
    err = classify(exc)
    headers = {"retry-after": str(max(1, round(err.retry_after_s)))} if err.retry_after_s is not None else None
    return JSONResponse(body(err), status_code=http_status(err.code), headers=headers)
