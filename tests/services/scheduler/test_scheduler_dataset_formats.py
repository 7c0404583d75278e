"""Tests for the JSONL dataset validator (services/scheduler/dataset_formats.py). CPU only, no services needed."""
from __future__ import annotations

import io
import json
import time

import pytest

from services.common.errors import Violation
from services.scheduler import dataset_formats as df
from services.scheduler.dataset_formats import (
    EMPTY_FILE,
    UNKNOWN_FORMAT,
    DatasetFormat,
    ValidationResult,
    read_rows,
    validate_jsonl,
)

F = DatasetFormat
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PC = {"prompt": "2+2=", "completion": "4"}
DPO = {"prompt": "Say hi", "chosen": "Hi!", "rejected": "Go away."}
RFT = {"prompt": "What is 2+2?", "ground_truth": "4"}


def jsonl(*rows: dict | str | bytes, end: bytes = b"\n") -> bytes:
    """Rows as JSONL: dicts are dumped, str and bytes are taken as the raw line."""
    out = []
    for row in rows:
        if isinstance(row, dict):
            row = json.dumps(row)
        out.append(row if isinstance(row, bytes) else row.encode())
    return end.join(out) + (end if rows else b"")


def check(*rows: dict | str | bytes, declared: DatasetFormat | None = None, **kwargs) -> ValidationResult:
    return validate_jsonl(io.BytesIO(jsonl(*rows)), declared, **kwargs)


def errs(result: ValidationResult) -> list[tuple[int, str, str]]:
    return [(e.row, e.field, e.reason) for e in result.errors]


def chat(*turns: tuple[str, str], **extra) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


# ---------------------------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row, expected", [
    (CHAT, F.SFT_CHAT),
    (PC, F.SFT_PROMPT_COMPLETION),
    (DPO, F.DPO),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, F.DPO),
    (RFT, F.RFT),
    ({"prompt": "p"}, F.RFT),
    (chat(("system", "s"), ("user", "u"), answer=42), F.RFT),  # messages without an assistant turn
])
def test_detects_format_from_first_row(row, expected):
    result = check(row, row)
    assert result.valid, errs(result)
    assert result.format is expected
    assert result.num_rows == 2


def test_detection_precedence_chosen_beats_completion_beats_messages():
    assert df.detect_format({"rejected": "x", "completion": "y", "messages": []}) is F.DPO
    assert df.detect_format({"completion": "y", "messages": CHAT["messages"]}) is F.SFT_PROMPT_COMPLETION
    assert df.detect_format({"messages": CHAT["messages"], "prompt": "p"}) is F.SFT_CHAT
    assert df.detect_format({"messages": "not a list"}) is F.RFT
    assert df.detect_format({"text": "x"}) is None


def test_undetectable_row_is_reported_and_detection_continues():
    result = check({"text": "hello"}, {"input": 1}, PC, PC)
    assert result.format is F.SFT_PROMPT_COMPLETION
    assert errs(result) == [(1, "", UNKNOWN_FORMAT), (2, "", UNKNOWN_FORMAT)]
    assert result.num_rows == 4


def test_detection_skips_rows_that_are_not_objects():
    result = check("{oops", "[1, 2]", CHAT, CHAT)
    assert result.format is F.SFT_CHAT
    assert [e.row for e in result.errors] == [1, 2]


def test_no_detectable_row_leaves_format_unknown():
    result = check({"a": 1}, {"b": 2})
    assert result.format is None
    assert not result.valid
    assert errs(result) == [(1, "", UNKNOWN_FORMAT), (2, "", UNKNOWN_FORMAT)]


def test_detected_row_is_itself_validated():
    result = check({"prompt": "p", "chosen": "a"}, DPO)
    assert result.format is F.DPO
    assert errs(result) == [(1, "rejected", "missing required field")]


# ---------------------------------------------------------------------------------------------------------------
# Mixed formats and declared formats
# ---------------------------------------------------------------------------------------------------------------
def test_row_of_another_format_names_detected_format_and_row():
    result = check("", {"x": 1}, CHAT, DPO, PC)
    assert result.format is F.SFT_CHAT
    assert errs(result) == [
        (2, "", UNKNOWN_FORMAT),
        (4, "", "looks like dpo ('prompt'/'chosen'/'rejected'), but the dataset was detected as sft_chat from "
                "row 3; all rows must use the same format"),
        (5, "", "looks like sft_prompt_completion ('prompt'/'completion'), but the dataset was detected as "
                "sft_chat from row 3; all rows must use the same format"),
    ]


@pytest.mark.parametrize("first, other, looks_like", [
    (PC, CHAT, "sft_chat"),
    (DPO, PC, "sft_prompt_completion"),
    (RFT, DPO, "dpo"),
    (CHAT, {"prompt": "p"}, "rft"),
    (PC, chat(("user", "u")), "rft"),
])
def test_mixed_formats_are_rejected(first, other, looks_like):
    result = check(first, other)
    assert len(result.errors) == 1
    error = result.errors[0]
    assert (error.row, error.field) == (2, "")
    assert error.reason.startswith(f"looks like {looks_like} (")
    assert f"detected as {df.detect_format(first).value} from row 1" in error.reason


def test_sft_chat_row_without_assistant_is_a_content_error_not_a_format_error():
    result = check(CHAT, chat(("user", "only a question")))
    assert errs(result) == [(2, "messages", "no assistant message with non-empty content: an sft_chat row needs "
                                            "at least one assistant reply to train on")]


def test_prompt_completion_row_missing_completion_is_a_field_error():
    result = check(PC, {"prompt": "p"})
    assert errs(result) == [(2, "completion", "missing required field")]


def test_rft_accepts_prompt_rows_and_messages_rows_with_assistant_turns():
    few_shot = chat(("user", "1+1?"), ("assistant", "2"), ("user", "2+2?"), ground_truth="4")
    result = check(RFT, few_shot, chat(("user", "3+3?"), ground_truth={"answer": 6, "tolerance": None}))
    assert result.valid, errs(result)
    assert result.format is F.RFT


def test_declared_format_is_checked_on_every_row():
    result = check(CHAT, PC, declared=F.RFT)
    assert result.format is F.RFT
    assert errs(result) == [(2, "", "looks like sft_prompt_completion ('prompt'/'completion'), but the dataset was "
                                    "declared as rft; all rows must use the same format")]


def test_declared_format_reports_rows_it_cannot_place_field_by_field():
    result = check({"text": "x"}, declared=F.SFT_PROMPT_COMPLETION)
    assert errs(result) == [(1, "prompt", "missing required field"), (1, "completion", "missing required field")]


def test_declared_format_accepts_the_string_value():
    result = check(DPO, declared="dpo")
    assert result.valid and result.format is F.DPO


def test_declared_format_must_be_known():
    with pytest.raises(ValueError):
        check(DPO, declared="ppo")


# ---------------------------------------------------------------------------------------------------------------
# Lines: JSON, UTF-8, blank lines, BOM, CRLF, empty files
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, reason", [
    ("[1, 2]", "expected a JSON object, got array"),
    ('"text"', "expected a JSON object, got string"),
    ("3.5", "expected a JSON object, got number"),
    ("true", "expected a JSON object, got boolean"),
    ("null", "expected a JSON object, got null"),
    ('{"prompt": "p",}', "invalid JSON: Expecting property name enclosed in double quotes at column 16"),
    ('{"prompt": "p"} {"prompt": "q"}', "invalid JSON: Extra data at column 17"),
    ('{"prompt": \'p\'}', "invalid JSON: Expecting value at column 12"),
    ('{"prompt": "p", "score": NaN}', "invalid JSON: NaN is not a JSON value (JSON has no NaN or Infinity)"),
    ('{"prompt": "p", "score": -Infinity}',
     "invalid JSON: -Infinity is not a JSON value (JSON has no NaN or Infinity)"),
    ("[" * 100_000, "invalid JSON: nested too deeply"),
])
def test_line_that_is_not_a_json_object(line, reason):
    result = check(RFT, line, RFT)
    assert errs(result) == [(2, "", reason)]
    assert result.num_rows == 3


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""])
def test_json_error_column_ignores_the_line_terminator(end):
    result = validate_jsonl(io.BytesIO(jsonl(PC) + b'{"prompt": "p", ' + end))
    assert errs(result) == [(2, "", "invalid JSON: Expecting property name enclosed in double quotes at column 17")]


def test_invalid_utf8_names_the_byte():
    result = check(RFT, b'{"prompt": "caf\xe9"}')
    assert errs(result) == [(2, "", "not valid UTF-8 at byte 16 of the line (invalid continuation byte); "
                                    "save the file as UTF-8")]


def test_non_ascii_utf8_is_fine():
    result = check({"prompt": "Grüße, 世界 🚀"}, {"prompt": "ok"})
    assert result.valid, errs(result)


def test_blank_lines_are_skipped_but_counted_in_line_numbers():
    data = b"\n   \n" + jsonl(PC) + b"\t\n\n" + jsonl({"prompt": "p", "completion": ""}) + b"\n \n"
    result = validate_jsonl(io.BytesIO(data))
    assert result.num_rows == 2
    assert errs(result) == [(6, "completion", "expected a non-empty string, got an empty string")]


@pytest.mark.parametrize("data", [b"", b"\n", b"  \n\t\n\r\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n\n"])
def test_empty_file(data):
    result = validate_jsonl(io.BytesIO(data))
    assert errs(result) == [(0, "", EMPTY_FILE)]
    assert result.num_rows == 0
    assert result.size_bytes == len(data)
    assert result.format is None
    assert not result.valid


def test_empty_file_keeps_declared_format():
    assert validate_jsonl(io.BytesIO(b""), F.DPO).format is F.DPO


def test_bom_at_file_start_is_tolerated():
    data = b"\xef\xbb\xbf" + jsonl(PC, PC)
    result = validate_jsonl(io.BytesIO(data))
    assert result.valid, errs(result)
    assert result.size_bytes == len(data)


def test_bom_later_in_the_file_is_an_error():
    result = validate_jsonl(io.BytesIO(jsonl(PC) + b"\xef\xbb\xbf" + jsonl(PC)))
    assert [(e.row, e.reason.split(":")[0]) for e in result.errors] == [(2, "invalid JSON")]


def test_crlf_line_endings_and_missing_final_newline():
    data = jsonl(CHAT, CHAT, end=b"\r\n") + b"\r\n" + json.dumps(CHAT).encode()
    result = validate_jsonl(io.BytesIO(data))
    assert result.valid, errs(result)
    assert result.num_rows == 3
    assert result.size_bytes == len(data)


def test_crlf_row_errors_name_the_right_line():
    data = jsonl(PC, "", {"prompt": 1, "completion": "c"}, end=b"\r\n")
    assert errs(validate_jsonl(io.BytesIO(data))) == [(3, "prompt", "expected a string, got number")]


def test_reads_a_path_or_a_file_object_from_its_position(tmp_path):
    data = jsonl(PC, PC, PC)
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    for source in (path, str(path)):
        result = validate_jsonl(source)
        assert (result.valid, result.num_rows, result.size_bytes) == (True, 3, len(data))
    f = io.BytesIO(b"junk\n" + data)
    f.readline()
    result = validate_jsonl(f)
    assert (result.valid, result.num_rows, result.size_bytes) == (True, 3, len(data))
    assert not f.closed


# ---------------------------------------------------------------------------------------------------------------
# Rows longer than MAX_ROW_BYTES
# ---------------------------------------------------------------------------------------------------------------
def test_row_over_16_mib_is_reported_and_the_rest_still_validated():
    huge = b'{"prompt": "' + b"a" * (16 * 1024 * 1024) + b'", "completion": "c"}'
    data = jsonl(PC, huge, {"prompt": 3, "completion": "c"})
    result = validate_jsonl(io.BytesIO(data))
    assert result.num_rows == 3
    assert result.size_bytes == len(data)
    assert errs(result) == [
        (2, "", f"too long: {len(huge):,} bytes; the limit is 16,777,216 bytes per row"),
        (3, "prompt", "expected a string, got number"),
    ]


def test_long_row_is_never_decoded(monkeypatch):
    decoded = []
    real_parse = df._parse_object
    monkeypatch.setattr(df, "_parse_object", lambda line: decoded.append(len(line)) or real_parse(line))
    monkeypatch.setattr(df, "MAX_ROW_BYTES", 1000)
    monkeypatch.setattr(df, "_DRAIN_CHUNK", 64)
    result = check(PC, "{" + "x" * 5000, PC)
    assert [e.row for e in result.errors] == [2]
    assert max(decoded) < 100


@pytest.mark.parametrize("extra, end, bom, too_long", [
    (0, b"\n", b"", False),
    (0, b"\r\n", b"", False),
    (0, b"\r\n", b"\xef\xbb\xbf", False),
    (0, b"", b"", False),
    (1, b"\n", b"", True),
    (1, b"\r\n", b"\xef\xbb\xbf", True),
    (1, b"", b"", True),
    (50, b"\n", b"", True),
])
def test_row_length_limit_boundary(monkeypatch, extra, end, bom, too_long):
    monkeypatch.setattr(df, "MAX_ROW_BYTES", 200)
    prefix, suffix = b'{"prompt": "', b'", "completion": "c"}'
    line = prefix + b"p" * (200 + extra - len(prefix) - len(suffix)) + suffix
    assert len(line) == 200 + extra
    data = bom + line + end + (jsonl(PC) if end else b"")  # without an end, the long row is the last one
    result = validate_jsonl(io.BytesIO(data))
    assert result.num_rows == (2 if end else 1)
    assert result.size_bytes == len(data)
    if too_long:
        assert errs(result) == [(1, "", f"too long: {200 + extra} bytes; the limit is 200 bytes per row")]
    else:
        assert result.valid, errs(result)


@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
@pytest.mark.parametrize("length", range(205, 230))
def test_long_row_length_is_exact_whatever_the_reads(monkeypatch, end, length):
    monkeypatch.setattr(df, "MAX_ROW_BYTES", 200)
    monkeypatch.setattr(df, "_DRAIN_CHUNK", 10)  # so "\r\n" sometimes straddles two reads
    data = b"x" * length + end + jsonl(PC)
    result = validate_jsonl(io.BytesIO(data))
    assert errs(result) == [(1, "", f"too long: {length} bytes; the limit is 200 bytes per row")]
    assert (result.num_rows, result.size_bytes) == (2, len(data))


# ---------------------------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------------------------
ROLE_REASON = "unknown role 'bot' (expected one of: system, user, assistant, tool)"


@pytest.mark.parametrize("messages, expected", [
    ("hi", [("messages", "expected a list of messages, got string")]),
    ({"role": "user"}, [("messages", "expected a list of messages, got object")]),
    ([], [("messages", "expected at least one message, got an empty list")]),
    ([{"role": "assistant", "content": "a"}, "hi"],
     [("messages[1]", "expected a message object with 'role' and 'content', got string")]),
    ([{"role": "assistant", "content": "a"}, {"content": "x"}], [("messages[1].role", "missing required field")]),
    ([{"role": "assistant", "content": "a"}, {"role": 1, "content": "x"}],
     [("messages[1].role", "expected a string, got number")]),
    ([{"role": "assistant", "content": "a"}, {"role": ["user"], "content": "x"}],
     [("messages[1].role", "expected a string, got array")]),
    ([{"role": "assistant", "content": "a"}, {"role": "bot", "content": "x"}], [("messages[1].role", ROLE_REASON)]),
    ([{"role": "assistant", "content": "a"}, {"role": "User", "content": "x"}],
     [("messages[1].role", "unknown role 'User' (expected one of: system, user, assistant, tool); "
                           "roles are lowercase")]),
    ([{"role": "assistant", "content": "a"}, {"role": "user"}], [("messages[1].content", "missing required field")]),
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": None}],
     [("messages[1].content", "expected a string, got null")]),
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
     [("messages[1].content", "expected a string, got array")]),
    ([{"role": "assistant", "content": "a"}, {"role": "bot"}],
     [("messages[1].role", ROLE_REASON), ("messages[1].content", "missing required field")]),
])
def test_message_list_errors(messages, expected):
    result = check({"messages": messages}, declared=F.SFT_CHAT)
    assert [(f, r) for _, f, r in errs(result)][:len(expected)] == expected
    assert all(e.row == 1 for e in result.errors)


def test_long_unknown_role_is_shortened_in_the_message():
    result = check(CHAT, chat(("user", "u"), ("r" * 500, "x"), ("assistant", "a")))
    assert errs(result) == [(2, "messages[1].role", f"unknown role '{'r' * 40}...' (expected one of: system, user, "
                                                    "assistant, tool)")]


def test_every_role_and_extra_keys_are_accepted():
    row = {"messages": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "weather?", "name": "alice"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "function": {"name": "get_weather"}}]},
        {"role": "tool", "content": "{\"temp\": 20}", "tool_call_id": "1"},
        {"role": "assistant", "content": "It is 20 degrees.", "weight": 1},
    ], "id": "conv-1", "meta": {"source": "synthetic"}}
    result = check(row)
    assert result.valid, errs(result)
    assert result.format is F.SFT_CHAT


def test_every_bad_message_is_reported_with_its_index():
    messages = [{"role": "user", "content": "u"}, {"role": "bot", "content": "x"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": 5}]
    result = check(CHAT, {"messages": messages})
    assert errs(result) == [(2, "messages[1].role", ROLE_REASON),
                            (2, "messages[3].content", "expected a string, got number")]


# ---------------------------------------------------------------------------------------------------------------
# Format rules
# ---------------------------------------------------------------------------------------------------------------
NO_ASSISTANT = ("messages", "no assistant message with non-empty content: an sft_chat row needs at least one "
                            "assistant reply to train on")


@pytest.mark.parametrize("row, expected", [
    (chat(("system", "s"), ("user", "u")), [NO_ASSISTANT]),
    (chat(("user", "u"), ("assistant", "")), [NO_ASSISTANT]),
    (chat(("user", "u"), ("assistant", "  \n")), [NO_ASSISTANT]),
    (chat(("user", "u"), ("assistant", ""), ("user", "again"), ("assistant", "ok")), []),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": None}]},
     [("messages[1].content", "expected a string, got null"), NO_ASSISTANT]),
    ({"conversation": CHAT["messages"]}, [("messages", "missing required field")]),
])
def test_sft_chat_rules(row, expected):
    result = check(row, declared=F.SFT_CHAT)
    assert [(f, r) for _, f, r in errs(result)] == expected


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "", "completion": "c"}, []),
    ({"prompt": "p", "completion": "c", "id": 7}, []),
    ({"completion": "c"}, [("prompt", "missing required field")]),
    ({"prompt": ["p"], "completion": "c"}, [("prompt", "expected a string, got array")]),
    ({"prompt": "p", "completion": ""}, [("completion", "expected a non-empty string, got an empty string")]),
    ({"prompt": "p", "completion": " \t"}, [("completion", "expected a non-empty string, got only whitespace")]),
    ({"prompt": "p", "completion": 4}, [("completion", "expected a string, got number")]),
    ({"prompt": None, "completion": {"text": "c"}},
     [("prompt", "expected a string, got null"), ("completion", "expected a string, got object")]),
])
def test_prompt_completion_rules(row, expected):
    result = check(row, declared=F.SFT_PROMPT_COMPLETION)
    assert [(f, r) for _, f, r in errs(result)] == expected


A = [{"role": "assistant", "content": "a"}]
B = [{"role": "assistant", "content": "b"}]


@pytest.mark.parametrize("row, expected", [
    (DPO, []),
    ({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "chosen": A, "rejected": B},
     []),
    ({"prompt": "p", "chosen": "a", "rejected": B},
     [("rejected", "must have the same form as 'chosen' (both strings or both lists of messages)")]),
    ({"chosen": "a", "rejected": "b"}, [("prompt", "missing required field")]),
    ({"prompt": "p", "rejected": "b"}, [("chosen", "missing required field")]),
    ({"prompt": "p", "chosen": "a"}, [("rejected", "missing required field")]),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, [("prompt", "expected a non-empty string, got an empty string")]),
    ({"prompt": 1, "chosen": "a", "rejected": "b"},
     [("prompt", "expected a string or a list of messages, got number")]),
    ({"prompt": [], "chosen": "a", "rejected": "b"}, [("prompt", "expected at least one message, got an empty list")]),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, [("chosen", "expected a non-empty string, got an empty string")]),
    ({"prompt": "p", "chosen": "a", "rejected": " "},
     [("rejected", "expected a non-empty string, got only whitespace")]),
    ({"prompt": "p", "chosen": [], "rejected": "b"}, [("chosen", "expected at least one message, got an empty list")]),
    ({"prompt": "p", "chosen": {"text": "a"}, "rejected": "b"},
     [("chosen", "expected a string or a list of messages, got object")]),
    ({"prompt": "p", "chosen": A, "rejected": [{"role": "bot", "content": "b"}]}, [("rejected[0].role", ROLE_REASON)]),
    ({"prompt": [{"role": "user"}], "chosen": A, "rejected": B}, [("prompt[0].content", "missing required field")]),
    ({"prompt": "p", "chosen": "same", "rejected": "same"},
     [("rejected", "is identical to 'chosen': a preference pair needs two different responses")]),
    ({"prompt": "p", "chosen": A, "rejected": [dict(A[0])]},
     [("rejected", "is identical to 'chosen': a preference pair needs two different responses")]),
])
def test_dpo_rules(row, expected):
    result = check(row, declared=F.DPO)
    assert [(f, r) for _, f, r in errs(result)] == expected


@pytest.mark.parametrize("row, expected", [
    (RFT, []),
    ({"prompt": "p", "ground_truth": [1, 2, {"x": None}], "difficulty": 0.5, "tags": ["math"]}, []),
    ({"messages": [{"role": "user", "content": "u"}], "ground_truth": None}, []),
    ({"prompt": ""}, [("prompt", "expected a non-empty string, got an empty string")]),
    ({"prompt": 5}, [("prompt", "expected a string, got number")]),
    ({"messages": []}, [("messages", "expected at least one message, got an empty list")]),
    ({"messages": [{"role": "bot", "content": "x"}]}, [("messages[0].role", ROLE_REASON)]),
    ({"prompt": "p", "messages": [{"role": "user", "content": "u"}]},
     [("", "has both 'prompt' and 'messages': an rft row needs exactly one of them")]),
    ({"ground_truth": "4"}, [("", "missing required field: an rft row needs 'prompt' or 'messages'")]),
])
def test_rft_rules(row, expected):
    result = check(row, declared=F.RFT)
    assert [(f, r) for _, f, r in errs(result)] == expected


def test_rft_reward_fields_are_kept_in_previews(tmp_path):
    row = {"prompt": "p", "ground_truth": {"answers": [1, 2]}, "rubric": "exact"}
    path = tmp_path / "rft.jsonl"
    path.write_bytes(jsonl(row))
    assert validate_jsonl(path).valid
    assert read_rows(path) == [row]


# ---------------------------------------------------------------------------------------------------------------
# Error limits and summaries
# ---------------------------------------------------------------------------------------------------------------
def test_max_errors_truncates_but_counts_every_row():
    result = check(PC, *(["not json"] * 20), PC, max_errors=5)
    assert len(result.errors) == 5
    assert [e.row for e in result.errors] == [2, 3, 4, 5, 6]
    assert result.truncated
    assert result.num_rows == 22


def test_exactly_max_errors_is_not_truncated():
    result = check(PC, "x", "y", max_errors=2)
    assert len(result.errors) == 2 and not result.truncated


def test_max_errors_zero_keeps_none_but_still_invalid():
    result = check(PC, "x", max_errors=0)
    assert result.errors == [] and result.truncated and not result.valid
    assert check(PC, max_errors=0).valid


def test_default_keeps_100_errors():
    result = check(*(["x"] * 150))
    assert len(result.errors) == 100 and result.truncated and result.num_rows == 150


def test_negative_max_errors_is_rejected():
    with pytest.raises(ValueError, match="max_errors"):
        check(PC, max_errors=-1)


def test_row_error_is_immutable_and_result_validity():
    error = Violation(row=1, field="", reason="x")
    with pytest.raises(AttributeError):
        error.row = 2
    assert ValidationResult(F.RFT, 1, 10, [], False).valid
    assert not ValidationResult(F.RFT, 1, 10, [error], False).valid


# ---------------------------------------------------------------------------------------------------------------
# Previews
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def preview_file(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(25)]
    data = b"\xef\xbb\xbf" + b"\r\n".join(json.dumps(r).encode() + (b"\r\n\n  " if i % 3 == 0 else b"")
                                         for i, r in enumerate(rows)) + b"\r\n"
    path = tmp_path / "preview.jsonl"
    path.write_bytes(data)
    return path, rows


def test_read_rows_windows(preview_file):
    path, rows = preview_file
    assert read_rows(path) == rows[:10]
    assert read_rows(path, offset=10, limit=5) == rows[10:15]
    assert read_rows(str(path), offset=20, limit=100) == rows[20:]
    assert read_rows(path, offset=25) == []
    assert read_rows(path, offset=3, limit=0) == []


def test_read_rows_rejects_negative_offset_or_limit(preview_file):
    path, _ = preview_file
    with pytest.raises(ValueError, match="offset"):
        read_rows(path, offset=-1)
    with pytest.raises(ValueError, match="limit"):
        read_rows(path, limit=-1)


def test_read_rows_only_parses_the_window(tmp_path, monkeypatch):
    monkeypatch.setattr(df, "MAX_ROW_BYTES", 100)
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl("not json", "x" * 500, PC, PC, "{broken"))
    assert read_rows(path, offset=2, limit=2) == [PC, PC]
    with pytest.raises(ValueError, match="row 5: invalid JSON"):
        read_rows(path, offset=2, limit=3)
    with pytest.raises(ValueError, match="row 2 is longer than"):
        read_rows(path, offset=1)


# ---------------------------------------------------------------------------------------------------------------
# Large files
# ---------------------------------------------------------------------------------------------------------------
def _write_large(path, target_bytes: int = 60_000_000) -> int:
    """A ~60 MB sft_chat file made of 1,000 distinct rows repeated; returns the number of rows written."""
    lines = []
    for i in range(1000):
        row = chat(("system", "You are a helpful assistant."), ("user", f"Question {i}: " + "word " * (i % 50 + 5)),
                   ("assistant", f"Answer {i}: " + "token " * (i % 70 + 5)))
        lines.append(json.dumps(row))
    block = ("\n".join(lines) + "\n").encode()
    repeats = target_bytes // len(block) + 1
    with open(path, "wb") as f:
        for _ in range(repeats):
            f.write(block)
    return repeats * len(lines)


@pytest.fixture(scope="module")
def large_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("large") / "big.jsonl"
    return path, _write_large(path)


def test_60mb_valid_file(large_file):
    path, num_rows = large_file
    start = time.perf_counter()
    result = validate_jsonl(path)
    elapsed = time.perf_counter() - start
    assert result.valid, result.errors[:5]
    assert result.format is F.SFT_CHAT
    assert result.num_rows == num_rows
    assert result.size_bytes == path.stat().st_size >= 60_000_000
    assert elapsed < 15, f"validating {result.size_bytes:,} bytes took {elapsed:.1f} s"


def test_60mb_file_with_broken_last_row(large_file, tmp_path):
    path, num_rows = large_file
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(path.read_bytes() + b'{"messages": [{"role": "user", "content": "cut off')
    result = validate_jsonl(broken)
    assert result.num_rows == num_rows + 1
    assert [(e.row, e.field) for e in result.errors] == [(num_rows + 1, "")]
    assert result.errors[0].reason.startswith("invalid JSON: Unterminated string")



def test_chat_cannot_start_with_the_assistant(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"},
                                             {"role": "user", "content": "yo"}]}) + "\n")
    result = validate_jsonl(path)
    assert [(e.row, e.field) for e in result.errors] == [(1, "messages[0].role")]


# ---------------------------------------------------------------------------------------------------------------
# Mappings from other tools' formats (ShareGPT, Alpaca)
# ---------------------------------------------------------------------------------------------------------------
def sharegpt(*turns: tuple[str, str], **extra) -> dict:
    return {"conversations": [{"from": s, "value": v} for s, v in turns], **extra}


def mapped(data: bytes, result: ValidationResult) -> list[dict]:
    return [json.loads(line) for line in df.mapped_lines(io.BytesIO(data), result.mapping)]


def test_sharegpt_rows_are_mapped_to_sft_chat():
    data = jsonl(sharegpt(("system", "Be brief."), ("human", "hi"), ("gpt", "hello"), id="a1"))
    result = validate_jsonl(io.BytesIO(data))
    assert result.valid and result.format is F.SFT_CHAT and result.mapping.name == "sharegpt"
    assert result.mapping.summary.startswith("sharegpt -> sft_chat")
    assert mapped(data, result) == [{"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}], "id": "a1"}]
    # The mapped rows are themselves a valid sft_chat file.
    again = validate_jsonl(io.BytesIO(b"".join(df.mapped_lines(io.BytesIO(data), result.mapping))))
    assert again.valid and again.format is F.SFT_CHAT and again.mapping is None


def test_alpaca_rows_are_mapped_to_prompt_completion_with_the_input_after_the_instruction():
    data = jsonl({"instruction": "Add.", "input": "2 3", "output": "5"}, {"instruction": "Say hi.", "output": "hi"},
                 {"instruction": "Say yo.", "input": "  ", "output": "yo"})
    result = validate_jsonl(io.BytesIO(data))
    assert result.valid and result.format is F.SFT_PROMPT_COMPLETION and result.mapping.name == "alpaca"
    assert mapped(data, result) == [{"prompt": "Add.\n\n2 3", "completion": "5"},
                                    {"prompt": "Say hi.", "completion": "hi"},
                                    {"prompt": "Say yo.", "completion": "yo"}]


def test_mapped_rows_problems_name_the_original_line_and_field():
    result = check(sharegpt(("human", "hi"), ("gpt", "hello")),
                   sharegpt(("bot", "hi"), ("gpt", "x")),
                   sharegpt(("gpt", "first")),
                   sharegpt(("human", "hi"), ("human", "no reply")),
                   {"conversations": "hi"},
                   {"conversations": [{"from": "human", "value": 3}]})
    assert errs(result) == [
        (2, "conversations[0].from", "unknown speaker 'bot' (expected one of: human, gpt, system)"),
        (3, "conversations[0].from", "a conversation cannot start with an assistant message: begin with a system "
                                     "or user message"),
        (4, "conversations", "no assistant message with non-empty content: an sft_chat row needs at least one "
                             "assistant reply to train on"),
        (5, "conversations", "expected a list of turns, got string"),
        (6, "conversations[0].value", "expected a string, got number"),
    ]
    result = check({"instruction": "a", "output": "b"}, {"instruction": "a"}, {"instruction": "", "output": "b"},
                   {"instruction": "a", "input": 3, "output": "b"})
    assert errs(result) == [(2, "output", "missing required field"),
                            (3, "instruction", "expected a non-empty string, got an empty string"),
                            (4, "input", "expected a string, got number")]


def test_a_mapping_applies_only_to_its_target_format():
    row = {"instruction": "a", "output": "b"}
    assert check(row, declared=F.SFT_PROMPT_COMPLETION).mapping.name == "alpaca"
    declared_other = check(row, declared=F.SFT_CHAT)
    assert declared_other.mapping is None and not declared_other.valid
    # Our own formats are never mapped, whatever free-form fields an rft row carries.
    assert check({"prompt": "p", "instruction": "x"}).mapping is None
    assert check(CHAT, {**CHAT, "conversations": []}).mapping is None
