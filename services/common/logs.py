"""Logging for every Trainyard process: plain text, or one JSON object per line (setting `log_format`), each record
carrying the ids of what it belongs to.

The ids live in a context variable for the duration of a call or a job: the gRPC interceptor opens a scope per call
with its request id (the client's `x-request-id` metadata, else a new one) and the session or job id the request
names, then adds the caller's account id; cores add ids they learn later (the session of a ForwardBackwardStream,
whose header comes with its first message); a worker opens a scope per job. A JSON record then reads

    {"time": "2027-01-05T10:00:00.123+00:00", "level": "INFO", "logger": "trainyard.trainer.sessions",
     "message": "...", "request_id": "4be1...", "account_id": "acct_...", "session_id": "sess_..."}
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Iterator
from datetime import datetime, timezone

IDS = ("request_id", "account_id", "job_id", "session_id")
_ids: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("trainyard_log_ids", default=None)


@contextlib.contextmanager
def scope(**ids: str) -> Iterator[dict[str, str]]:
    """Ids for the records logged inside the block (and by annotate() calls in it); the outer scope's ids stay
    unless given again."""
    current = dict(_ids.get() or {})
    current.update({k: v for k, v in ids.items() if v})
    token = _ids.set(current)
    try:
        yield current
    finally:
        _ids.reset(token)


def annotate(**ids: str) -> None:
    """Add ids to the current scope (a no-op outside one, so cores can call it whoever drives them)."""
    current = _ids.get()
    if current is not None:
        current.update({k: v for k, v in ids.items() if v})


def current_ids() -> dict[str, str]:
    return dict(_ids.get() or {})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(current_ids())
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The plain format, with the record's ids appended as key=value."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = current_ids()
        if not ids:
            return text
        head, sep, rest = text.partition("\n")  # after the message's first line, before any traceback
        return head + " [" + " ".join(f"{k}={ids[k]}" for k in IDS if k in ids) + "]" + sep + rest


def configure_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
