"""Streaming validation of uploaded JSONL training datasets, and row previews.

A dataset is a JSONL file: one JSON object per line, all rows in one of four formats.

    sft_chat               {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
    sft_prompt_completion  {"prompt": "...", "completion": "..."}
    dpo                    {"prompt": "..." | [messages], "chosen": "..." | [messages], "rejected": ...}
    rft                    {"prompt": "..."} or {"messages": [...]}, plus free-form fields for the reward function

Two common formats of other tools are mapped onto these at upload (MAPPINGS, declared once below):

    sharegpt -> sft_chat               {"conversations": [{"from": "human" | "gpt" | "system", "value": "..."}]}
    alpaca   -> sft_prompt_completion  {"instruction": "...", "input": "..." (optional), "output": "..."}

A file is mapped when its first row has the source format's keys (and the declared format, if any, is the target);
every row is then mapped and checked as a row of the target format, and its problems are named by the original
line and the original field (conversations[1].from, not messages[1].role). The stored dataset holds the mapped rows.

Users read the errors directly, so each names the 1-based line of the file, the JSON path of the field and what is
wrong with it. Files may be hundreds of MB: they are read line by line in binary, and a line over MAX_ROW_BYTES is
reported without ever being decoded.
"""
from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from services.common.errors import Violation

MAX_ROW_BYTES = 16 * 1024 * 1024
_DRAIN_CHUNK = 1 << 20
_READ_BUFFER = 1 << 20
_BOM = b"\xef\xbb\xbf"
ROLES = ("system", "user", "assistant", "tool")
_MISSING = object()


class DatasetFormat(str, enum.Enum):
    SFT_CHAT = "sft_chat"
    SFT_PROMPT_COMPLETION = "sft_prompt_completion"
    DPO = "dpo"
    RFT = "rft"


# How each format looks, for messages that tell a user which format a row resembles.
_LOOKS_LIKE = {
    DatasetFormat.SFT_CHAT: "'messages' with an assistant reply",
    DatasetFormat.SFT_PROMPT_COMPLETION: "'prompt'/'completion'",
    DatasetFormat.DPO: "'prompt'/'chosen'/'rejected'",
    DatasetFormat.RFT: "'prompt' or 'messages' with reward fields",
}

# The key that gives a row's format away, and which of them each format accepts. A row whose key is not accepted is
# reported as belonging to another format; otherwise it is checked field by field (so a prompt/completion row that
# lacks "completion" hears "missing required field", not "wrong format").
_ACCEPTED_SHAPES = {
    DatasetFormat.SFT_CHAT: {"messages"},
    DatasetFormat.SFT_PROMPT_COMPLETION: {"completion", "prompt"},
    DatasetFormat.DPO: {"chosen", "prompt"},
    DatasetFormat.RFT: {"messages", "prompt"},
}



# ---------------------------------------------------------------------------------------------------------------
# Mappings from other tools' formats
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    """Another tool's row format and how its rows become rows of one of ours."""

    name: str
    target: DatasetFormat
    detect: Callable[[dict], bool]  # the row's keys give the source format away
    convert: Callable[[dict, list], dict]  # (row, problems) -> the target row; problems name the source's fields
    renames: tuple[tuple[str, str], ...]  # target field path fragments -> the source's, for the target's checks
    summary: str  # what the mapping does, in words (the upload reply carries it)

    def source_path(self, path: str) -> str:
        for ours, theirs in self.renames:
            path = path.replace(ours, theirs)
        return path


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _from_sharegpt(row: dict, problems: list) -> dict:
    turns = row.get("conversations", _MISSING)
    messages = []
    if turns is _MISSING:
        problems.append(("conversations", "missing required field"))
    elif not isinstance(turns, list):
        problems.append(("conversations", f"expected a list of turns, got {_type_name(turns)}"))
    elif not turns:
        problems.append(("conversations", "expected at least one turn, got an empty list"))
    else:
        for i, turn in enumerate(turns):
            path = f"conversations[{i}]"
            if not isinstance(turn, dict):
                problems.append((path, f"expected a turn object with 'from' and 'value', got {_type_name(turn)}"))
                continue
            speaker = turn.get("from", _MISSING)
            if speaker is _MISSING:
                problems.append((f"{path}.from", "missing required field"))
            elif not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
                shown = _short(speaker) if isinstance(speaker, str) else _type_name(speaker)
                problems.append((f"{path}.from", f"unknown speaker {shown!r} (expected one of: "
                                                 f"{', '.join(SHAREGPT_ROLES)})"))
            _check_string(turn, "value", problems, non_empty=False, path=f"{path}.value")
            messages.append({"role": SHAREGPT_ROLES.get(speaker, "user") if isinstance(speaker, str) else "user",
                             "content": turn.get("value")})
    return {"messages": messages, **{k: v for k, v in row.items() if k != "conversations"}}


def _from_alpaca(row: dict, problems: list) -> dict:
    _check_string(row, "instruction", problems, non_empty=True)
    _check_string(row, "output", problems, non_empty=True)
    extra = row.get("input", "")
    if not isinstance(extra, str):
        problems.append(("input", f"expected a string, got {_type_name(extra)}"))
        extra = ""
    instruction = row.get("instruction") if isinstance(row.get("instruction"), str) else ""
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    rest = {k: v for k, v in row.items() if k not in ("instruction", "input", "output")}
    return {"prompt": prompt, "completion": row.get("output"), **rest}


MAPPINGS = (
    Mapping("sharegpt", DatasetFormat.SFT_CHAT,
            detect=lambda row: "conversations" in row and "messages" not in row,
            convert=_from_sharegpt, renames=(("messages", "conversations"), (".role", ".from"),
                                             (".content", ".value")),
            summary="sharegpt -> sft_chat: each turn of 'conversations' became a message, 'from' human / gpt / "
                    "system became the role user / assistant / system and 'value' the content"),
    Mapping("alpaca", DatasetFormat.SFT_PROMPT_COMPLETION,
            detect=lambda row: "instruction" in row and not {"prompt", "messages", "conversations"} & row.keys(),
            convert=_from_alpaca, renames=(("prompt", "instruction"), ("completion", "output")),
            summary="alpaca -> sft_prompt_completion: the prompt is 'instruction' (followed by a blank line and "
                    "'input' when there is one) and the completion is 'output'"),
)


def detect_mapping(row: dict, declared: DatasetFormat | None = None) -> Mapping | None:
    """The mapping a row's keys point to (one whose target is the declared format, when one is declared)."""
    return next((m for m in MAPPINGS if m.detect(row) and declared in (None, m.target)), None)


UNKNOWN_FORMAT = ("cannot tell the dataset format: expected 'messages', 'prompt'/'completion', "
                  "'prompt'/'chosen'/'rejected' or 'prompt' with reward fields")
EMPTY_FILE = "the file is empty: no rows"


@dataclass
class ValidationResult:
    format: DatasetFormat | None
    num_rows: int
    size_bytes: int
    errors: list[Violation]
    truncated: bool  # more errors existed than were kept
    mapping: Mapping | None = None  # the other tool's format the rows were mapped from

    @property
    def valid(self) -> bool:
        return not self.errors and not self.truncated


def validate_jsonl(source: str | os.PathLike | BinaryIO, declared: DatasetFormat | None = None, *,
                   max_errors: int = 100) -> ValidationResult:
    """Checks every row of a JSONL dataset against `declared`, or against the format detected from the first row.

    Keeps the first `max_errors` errors (truncated=True when there were more) but always reads to the end, so
    num_rows and size_bytes describe the whole file. A file object is read from its current position and not closed.
    """
    if max_errors < 0:
        raise ValueError(f"max_errors must be >= 0, got {max_errors}")
    fmt = DatasetFormat(declared) if declared is not None else None
    declared_fmt = fmt
    origin = f"declared as {fmt.value}" if fmt is not None else ""
    mapping: Mapping | None = None
    first = True
    errors: list[Violation] = []
    truncated = False
    num_rows = 0

    def add(row: int, field: str, reason: str) -> None:
        nonlocal truncated
        if len(errors) < max_errors:
            errors.append(Violation(row=row, field=field, reason=reason))
        else:
            truncated = True

    with _open_binary(source) as f:
        lines = _LineReader(f)
        for lineno, line, nbytes in lines:
            num_rows += 1
            if line is None:
                add(lineno, "", f"too long: {nbytes:,} bytes; the limit is {MAX_ROW_BYTES:,} bytes per row")
                continue
            row, reason = _parse_object(line)
            if row is None:
                add(lineno, "", reason)
                continue
            if first:  # the first row that is an object decides whether the file is mapped
                first = False
                mapping = detect_mapping(row, declared_fmt)
                if mapping is not None:
                    fmt = mapping.target
                    origin = f"mapped from {mapping.name} (detected from row {lineno})"
            if mapping is not None:
                for field_, reason in _mapped_problems(mapping, row, origin):
                    add(lineno, field_, reason)
                continue
            if fmt is None:
                fmt = detect_format(row)
                if fmt is None:
                    add(lineno, "", UNKNOWN_FORMAT)
                    continue
                origin = f"detected as {fmt.value} from row {lineno}"
            for field_, reason in _check_row(fmt, row, origin):
                add(lineno, field_, reason)
        size_bytes = lines.bytes_read

    if num_rows == 0:
        add(0, "", EMPTY_FILE)
    return ValidationResult(format=fmt, num_rows=num_rows, size_bytes=size_bytes, errors=errors, truncated=truncated,
                            mapping=mapping)


def _mapped_problems(mapping: Mapping, row: dict, origin: str) -> list[tuple[str, str]]:
    """A source row's problems: the mapping's own checks, then the target format's on the mapped row (named by the
    source's fields)."""
    problems: list[tuple[str, str]] = []
    mapped = mapping.convert(row, problems)
    if problems:
        return problems
    return [(mapping.source_path(f), reason) for f, reason in _check_row(mapping.target, mapped, origin)]


def mapped_lines(source: str | os.PathLike | BinaryIO, mapping: Mapping) -> Iterator[bytes]:
    """The JSONL lines of a file that validate_jsonl found valid under `mapping`, each row mapped."""
    with _open_binary(source) as f:
        for _, line, _ in _LineReader(f):
            row, _ = _parse_object(line)
            yield json.dumps(mapping.convert(row, []), ensure_ascii=False).encode() + b"\n"


def read_rows(path: str | os.PathLike | BinaryIO, offset: int = 0, limit: int = 10) -> list[dict]:
    """Rows offset .. offset+limit-1 (0-based, blank lines not counted) as dicts, for previews of a stored dataset."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rows: list[dict] = []
    if limit == 0:
        return rows
    with _open_binary(path) as f:
        for index, (lineno, line, _) in enumerate(_LineReader(f)):
            if index < offset:
                continue
            if line is None:
                raise ValueError(f"row {lineno} is longer than {MAX_ROW_BYTES // (1 << 20)} MiB")
            row, reason = _parse_object(line)
            if row is None:
                raise ValueError(f"row {lineno}: {reason}")
            rows.append(row)
            if len(rows) == limit:
                break
    return rows


def detect_format(row: dict) -> DatasetFormat | None:
    """The format a row's keys point to, or None when they point to none."""
    if "chosen" in row or "rejected" in row:
        return DatasetFormat.DPO
    if "completion" in row:
        return DatasetFormat.SFT_PROMPT_COMPLETION
    if "messages" in row:
        messages = row["messages"]
        if isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            return DatasetFormat.SFT_CHAT
        return DatasetFormat.RFT
    if "prompt" in row:
        return DatasetFormat.RFT
    return None


# ---------------------------------------------------------------------------------------------------------------
# Reading lines
# ---------------------------------------------------------------------------------------------------------------
@contextmanager
def _open_binary(source: str | os.PathLike | BinaryIO) -> Iterator[BinaryIO]:
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb", buffering=_READ_BUFFER) as f:
            yield f
    else:
        yield source


class _LineReader:
    """Yields (line_number, line, size) for each non-blank line. When the row (terminator aside) is longer than
    MAX_ROW_BYTES, line is None and size is the row's exact length in bytes.

    The line keeps its terminator (JSON treats "\\r\\n" as whitespace, so stripping it would only copy the line).
    At most about MAX_ROW_BYTES bytes of a line are held at once; the rest of a longer one is read and dropped.
    """

    def __init__(self, f: BinaryIO):
        self._f = f
        self.bytes_read = 0

    def __iter__(self) -> Iterator[tuple[int, bytes | None, int]]:
        readline = self._f.readline
        limit = MAX_ROW_BYTES + len(_BOM) + 2  # room for a BOM and "\r\n" around a line of exactly MAX_ROW_BYTES
        lineno = 0
        while line := readline(limit):
            lineno += 1
            self.bytes_read += len(line)
            nbytes = len(line)
            if nbytes == limit and not line.endswith(b"\n"):
                if lineno == 1 and line.startswith(_BOM):
                    nbytes -= len(_BOM)
                tail = line[-2:]  # enough to see a "\r\n" split across two reads
                while not tail.endswith(b"\n") and (chunk := readline(_DRAIN_CHUNK)):
                    nbytes += len(chunk)
                    self.bytes_read += len(chunk)
                    tail = tail[-1:] + chunk[-2:]
                yield lineno, None, nbytes - _terminator_len(tail)
                continue
            if lineno == 1 and line.startswith(_BOM):
                line = line[len(_BOM):]
                nbytes -= len(_BOM)
            if nbytes > MAX_ROW_BYTES and nbytes - _terminator_len(line) > MAX_ROW_BYTES:
                yield lineno, None, nbytes - _terminator_len(line)
                continue
            if not line or line.isspace():
                continue
            yield lineno, line, nbytes


def _terminator_len(line: bytes) -> int:
    return 2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON: {name} is not a JSON value (JSON has no NaN or Infinity)")


# json.loads would build a new decoder per row when given parse_constant; build it once.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_object(line: bytes) -> tuple[dict | None, str]:
    """The line as a dict, or (None, reason)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 at byte {e.start + 1} of the line ({e.reason}); save the file as UTF-8"
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        # Past the end of the row, json only skipped the line terminator: report the end of the row instead.
        column = min(e.pos, len(text.rstrip("\r\n"))) + 1
        return None, f"invalid JSON: {e.msg} at column {column}"
    except ValueError as e:  # from _reject_constant
        return None, str(e)
    except RecursionError:
        return None, "invalid JSON: nested too deeply"
    if not isinstance(value, dict):
        return None, f"expected a JSON object, got {_type_name(value)}"
    return value, ""


# ---------------------------------------------------------------------------------------------------------------
# Checking rows. Each check appends (field, reason) pairs to `problems`.
# ---------------------------------------------------------------------------------------------------------------
def _check_row(fmt: DatasetFormat, row: dict, origin: str) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    shape = _shape(row)
    if shape is not None and shape not in _ACCEPTED_SHAPES[fmt]:
        looks_like = detect_format(row)
        problems.append(("", f"looks like {looks_like.value} ({_LOOKS_LIKE[looks_like]}), but the dataset was "
                             f"{origin}; all rows must use the same format"))
        return problems
    _CHECKS[fmt](row, problems)
    return problems


def _shape(row: dict) -> str | None:
    if "chosen" in row or "rejected" in row:
        return "chosen"
    for key in ("completion", "messages", "prompt"):
        if key in row:
            return key
    return None


def _check_sft_chat(row: dict, problems: list) -> None:
    messages = row.get("messages", _MISSING)
    if messages is _MISSING:
        problems.append(("messages", "missing required field"))
        return
    _check_messages(messages, "messages", problems)
    if isinstance(messages, list) and messages and not any(
            isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)
            and m["content"].strip() for m in messages):
        problems.append(("messages", "no assistant message with non-empty content: an sft_chat row needs at least "
                                     "one assistant reply to train on"))
    elif isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            and messages[0].get("role") == "assistant":
        problems.append(("messages[0].role", "a conversation cannot start with an assistant message: begin with a "
                                             "system or user message"))


def _check_prompt_completion(row: dict, problems: list) -> None:
    _check_string(row, "prompt", problems, non_empty=False)
    _check_string(row, "completion", problems, non_empty=True)


def _check_dpo(row: dict, problems: list) -> None:
    ok = True
    for key in ("prompt", "chosen", "rejected"):
        before = len(problems)
        value = row.get(key, _MISSING)
        if value is _MISSING:
            problems.append((key, "missing required field"))
        elif isinstance(value, str):
            _check_string(row, key, problems, non_empty=True)
        elif isinstance(value, list):
            _check_messages(value, key, problems)
        else:
            problems.append((key, f"expected a string or a list of messages, got {_type_name(value)}"))
        ok = ok and len(problems) == before
    if ok and isinstance(row["chosen"], str) != isinstance(row["rejected"], str):
        problems.append(("rejected", "must have the same form as 'chosen' (both strings or both lists of messages)"))
    elif ok and row["chosen"] == row["rejected"]:
        problems.append(("rejected", "is identical to 'chosen': a preference pair needs two different responses"))


def _check_rft(row: dict, problems: list) -> None:
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt and has_messages:
        problems.append(("", "has both 'prompt' and 'messages': an rft row needs exactly one of them"))
    elif has_prompt:
        _check_string(row, "prompt", problems, non_empty=True)
    elif has_messages:
        _check_messages(row["messages"], "messages", problems)
    else:
        problems.append(("", "missing required field: an rft row needs 'prompt' or 'messages'"))


_CHECKS = {
    DatasetFormat.SFT_CHAT: _check_sft_chat,
    DatasetFormat.SFT_PROMPT_COMPLETION: _check_prompt_completion,
    DatasetFormat.DPO: _check_dpo,
    DatasetFormat.RFT: _check_rft,
}


def _check_string(obj: dict, key: str, problems: list, *, non_empty: bool, path: str = "") -> None:
    path = path or key
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        problems.append((path, "missing required field"))
    elif not isinstance(value, str):
        problems.append((path, f"expected a string, got {_type_name(value)}"))
    elif non_empty and not value.strip():
        got = "an empty string" if not value else "only whitespace"
        problems.append((path, f"expected a non-empty string, got {got}"))


def _check_messages(value: Any, path: str, problems: list) -> None:
    if not isinstance(value, list):
        problems.append((path, f"expected a list of messages, got {_type_name(value)}"))
        return
    if not value:
        problems.append((path, "expected at least one message, got an empty list"))
        return
    for i, message in enumerate(value):
        if isinstance(message, dict):
            role = message.get("role")
            if type(role) is str and role in ROLES and type(message.get("content")) is str:
                continue  # the common case: nothing to report, no paths to build
        _check_message(message, f"{path}[{i}]", problems)


def _check_message(message: Any, path: str, problems: list) -> None:
    if not isinstance(message, dict):
        problems.append((path, f"expected a message object with 'role' and 'content', got {_type_name(message)}"))
        return
    role = message.get("role", _MISSING)
    if role is _MISSING:
        problems.append((f"{path}.role", "missing required field"))
    elif not isinstance(role, str):
        problems.append((f"{path}.role", f"expected a string, got {_type_name(role)}"))
    elif role not in ROLES:
        hint = "; roles are lowercase" if role.lower() in ROLES else ""
        problems.append((f"{path}.role", f"unknown role {_short(role)!r} (expected one of: {', '.join(ROLES)}){hint}"))
    _check_string(message, "content", problems, non_empty=False, path=f"{path}.content")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
