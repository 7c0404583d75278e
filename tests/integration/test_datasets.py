"""Dataset uploads over gRPC: streaming, validation, de-duplication, and nothing stored on rejection."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.data import big_chat_file, chat_rows, jsonl
from trainyard import TrainyardError

pytestmark = pytest.mark.integration


def stored_state(stack, client) -> tuple[set[str], set[Path]]:
    """What an upload could change: the account's datasets and the object store's blobs."""
    blobs = {p for p in (stack.data_dir / "blobs" / "sha256").rglob("*") if p.is_file()} \
        if (stack.data_dir / "blobs" / "sha256").exists() else set()
    return {d.id for d in client.list_datasets()}, blobs


def test_upload_each_format_and_preview(client):
    cases = {
        "sft_chat": chat_rows(3),
        "sft_prompt_completion": [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}],
        "dpo": [{"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."}],
        "rft": [{"prompt": "What is 7*6?", "ground_truth": "42"}, {"messages": [{"role": "user", "content": "1+1?"}],
                                                                   "ground_truth": 2}],
    }
    for fmt, rows in cases.items():
        ds, dedup = client.upload_dataset(jsonl(rows), name=f"ds-{fmt}")
        assert not dedup
        assert (ds.num_rows, client_format(ds)) == (len(rows), fmt)
        assert client.preview_dataset(ds.id, 0, 10) == rows
    # Offsets and limits page through rows.
    ds, _ = client.upload_dataset(jsonl(chat_rows(30)), name="thirty")
    assert client.preview_dataset(ds.id, offset=28, limit=10) == chat_rows(30)[28:]


def client_format(ds) -> str:
    from trainyard.client import format_name

    return format_name(ds.format)


@pytest.mark.parametrize("content, expect", [
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": [\n',
     ("row 2", "invalid JSON")),
    (b'{"messages": [{"role": "bot", "content": "hi"}]}\n', ("row 1", "unknown role 'bot'")),
    (b'{"text": "no known fields"}\n', ("row 1", "cannot tell the dataset format")),
    (b"", ("file is empty",)),
    (b"\n\n  \n", ("file is empty",)),
    (b'{"prompt": "p", "completion": "c"}\n{"prompt": "p", "chosen": "a", "rejected": "b"}\n', ("row 2",)),
], ids=["malformed-jsonl", "wrong-schema", "unknown-format", "empty", "blank-lines", "mixed-formats"])
def test_bad_files_are_rejected_and_nothing_is_stored(stack, client, content, expect):
    before = stored_state(stack, client)
    with pytest.raises(TrainyardError) as exc:
        client.upload_dataset(content, name="bad")
    assert exc.value.code == "INVALID_ARGUMENT"
    text = exc.value.message + " ".join(f"row {v.row} {v.field} {v.reason}" for v in exc.value.violations)
    for needle in expect:
        assert needle in text, text
    assert stored_state(stack, client) == before


def test_declared_format_is_enforced(client):
    with pytest.raises(TrainyardError) as exc:
        client.upload_dataset(jsonl(chat_rows(2)), format="dpo")
    assert exc.value.code == "INVALID_ARGUMENT" and exc.value.violations


def test_sixty_megabyte_upload_streams_in_chunks(stack, client, tmp_path):
    path = tmp_path / "big.jsonl"
    rows = big_chat_file(path, 60 * 1024 * 1024)
    sent = []
    ds, dedup = client.upload_dataset(path, progress=sent.append)
    assert not dedup and ds.num_rows == rows and ds.size_bytes == path.stat().st_size
    assert len(sent) > 15  # 1 MiB chunks: far more data than one gRPC message allows
    import hashlib

    assert ds.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (stack.data_dir / "blobs" / "sha256" / ds.sha256[:2] / ds.sha256[2:4] / ds.sha256).stat().st_size \
        == ds.size_bytes
    again, dedup = client.upload_dataset(path)
    assert dedup and again.id == ds.id


def test_sixty_megabyte_file_with_a_bad_last_row_stores_nothing(stack, client, tmp_path):
    path = tmp_path / "big-bad.jsonl"
    rows = big_chat_file(path, 60 * 1024 * 1024, break_last=True)
    before = stored_state(stack, client)
    with pytest.raises(TrainyardError) as exc:
        client.upload_dataset(path)
    assert exc.value.code == "INVALID_ARGUMENT"
    assert exc.value.violations[0].row == rows
    assert stored_state(stack, client) == before


def test_validate_reports_without_storing(stack, client):
    before = stored_state(stack, client)
    rows = [json.dumps(r) for r in chat_rows(3)] + ["not json", '{"messages": []}']
    report = client.validate_dataset("\n".join(rows).encode())
    assert not report.valid and [v.row for v in report.violations] == [4, 5]
    assert stored_state(stack, client) == before


def test_dedup_delete_and_reupload(client):
    content = jsonl(chat_rows(5)) + b"\n"
    ds, dedup = client.upload_dataset(content, name="first")
    assert not dedup
    same, dedup = client.upload_dataset(content, name="second")
    assert dedup and same.id == ds.id and same.name == "first"
    client.delete_dataset(ds.id)
    with pytest.raises(TrainyardError) as exc:
        client.get_dataset(ds.id)
    assert exc.value.code == "NOT_FOUND"
    fresh, dedup = client.upload_dataset(content, name="third")
    assert not dedup and fresh.id != ds.id


def test_unknown_dataset_id_is_not_found(client):
    for call in (client.get_dataset, client.preview_dataset, client.delete_dataset):
        with pytest.raises(TrainyardError) as exc:
            call("ds_doesnotexist")
        assert exc.value.code == "NOT_FOUND"


def test_same_content_as_another_format_is_another_dataset(client):
    content = jsonl(chat_rows(3) + [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant",
                                                                                     "content": "y"}],
                                     "ground_truth": "y"}])
    chat, _ = client.upload_dataset(content, name="as-chat")
    rft, dedup = client.upload_dataset(content, name="as-rft", format="rft")
    assert not dedup and rft.id != chat.id and client_format(rft) == "rft" and client_format(chat) == "sft_chat"
    again, dedup = client.upload_dataset(content, format="rft")
    assert dedup and again.id == rft.id
