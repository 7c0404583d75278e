"""Small dataset builders for the integration tests."""
from __future__ import annotations

import json


def chat_rows(n: int = 16) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(1, n + 1)]


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def big_chat_file(path, target_bytes: int, *, break_last: bool = False) -> int:
    """A valid sft_chat JSONL file of about target_bytes (rows are distinct); returns the number of rows."""
    pad = "x" * 500
    n = 0
    with open(path, "wb") as f:
        size = 0
        while size < target_bytes:
            line = json.dumps({"messages": [{"role": "user", "content": f"question {n} {pad}"},
                                            {"role": "assistant", "content": f"answer {n}"}]}).encode() + b"\n"
            f.write(line)
            size += len(line)
            n += 1
        if break_last:
            f.write(b'{"messages": [{"role": "user", "content": "unterminated"\n')
            n += 1
    return n
