"""`trainyard admin fsck` (services/common/fsck.py): damaged blobs, orphans and rows naming missing blobs are found
and reported; with --quarantine, damaged blobs and orphans are moved aside, never deleted, and a blob a save names
meanwhile is left alone."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import delete

from services.common import auth, fsck
from services.common.blobstore import BlobStore, StoredFile
from services.common.db import Database, migrate
from services.common.schema import Checkpoint, Dataset, new_id, utcnow

pytestmark = pytest.mark.reliability

DATA = bytes(range(256)) * 5000


@pytest.fixture()
def env(tmp_path):
    url = f"sqlite:///{tmp_path / 'trainyard.db'}"
    migrate(url)
    db = Database(url)
    account = auth.create_account(db, "alice")[0].id
    yield db, BlobStore(tmp_path / "blobs"), account
    db.dispose()


def add_checkpoint(db: Database, account: str, files: list[StoredFile], state: list[StoredFile] = ()) -> str:
    row = Checkpoint(id=new_id("ckpt"), account_id=account, base_model="tiny", files=[f.to_json() for f in files],
                     state=[f.to_json() for f in state], created_at=utcnow())
    with db.session() as s:
        s.add(row)
    return row.id


def damaged_store(env, flip_byte):
    """A dataset blob intact, a checkpoint with a damaged file, a row naming a missing blob, an orphan blob and a
    stray file under sha256/."""
    db, store, account = env
    good, good_size = store.put_bytes(b'{"text": "fine"}\n')
    with db.session() as s:
        s.add(Dataset(id="ds_1", account_id=account, name="d", format="sft_chat", num_rows=1, size_bytes=good_size,
                      sha256=good, created_at=utcnow()))
    bad, bad_size = store.put_bytes(DATA)
    flip_byte(store.path(bad), 77)
    ckpt = add_checkpoint(db, account, [StoredFile("adapter_model.safetensors", bad, bad_size)],
                          state=[StoredFile("optimizer.pt", "e" * 64, 10)])
    orphan, _ = store.put_bytes(b"left by a killed save")
    stray = store.root / "sha256" / "ab" / "cd" / "not-a-digest"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"?")
    return ckpt, good, bad, orphan, stray


def test_fsck_reports_damage_orphans_and_missing_blobs_then_quarantines(env, flip_byte):
    db, store, _ = env
    ckpt, good, bad, orphan, stray = damaged_store(env, flip_byte)
    seen = []
    report = fsck.check(store, db, progress=seen.append)
    assert report.blobs == 4 and sum(seen) == report.bytes and report.damage
    assert {(f.kind, f.name) for f in report.findings} == {
        ("damaged", bad), ("damaged", "sha256/ab/cd/not-a-digest"), ("missing", "e" * 64), ("orphan", orphan)}
    by_name = {f.name: f for f in report.findings}
    assert by_name[bad].rows == (f"checkpoint {ckpt} (account {env[2]}) file adapter_model.safetensors",)
    assert by_name["e" * 64].rows == (f"checkpoint state {ckpt} (account {env[2]}) file optimizer.pt",)
    assert report.quarantined == [] and store.exists(bad) and store.exists(orphan)

    report = fsck.check(store, db, quarantine=True)
    assert sorted(p.name for p in report.quarantined) == sorted([bad, orphan, "not-a-digest"])
    assert not store.exists(bad) and not store.exists(orphan) and not stray.exists() and store.exists(good)
    note = json.loads((store.quarantine_dir / f"{bad}.json").read_text())
    assert note["found"] == "damaged" and note["rows"] == list(by_name[bad].rows)
    assert (store.quarantine_dir / orphan).read_bytes() == b"left by a killed save"  # moved, not deleted
    after = fsck.check(store, db, quarantine=True)  # what was damaged is missing now; nothing else to move
    assert {(f.kind, f.name) for f in after.findings} == {("missing", bad), ("missing", "e" * 64)}
    assert after.quarantined == []


def test_fsck_does_not_quarantine_a_blob_named_since_the_walk(env):
    """Rows are read before the walk, so a blob stored meanwhile looks orphaned; the second look under the store's
    exclusive lock finds its row and leaves it."""
    db, store, account = env
    digest, size = store.put_bytes(b"stored during the walk")
    files = fsck.blob_files(store)

    def walk_progress(_n: int) -> None:  # the row appears while fsck hashes
        if not walk_progress.done:
            add_checkpoint(db, account, [StoredFile("a", digest, size)])
            walk_progress.done = True

    walk_progress.done = False
    report = fsck.check(store, db, quarantine=True, files=files, progress=walk_progress)
    assert report.findings == [] and store.exists(digest)


def test_admin_fsck_command(env, flip_byte, tmp_path):
    from trainyard.cli.main import cli

    db, store, _ = env
    cli_env = {"TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_DATABASE_URL": db.url}
    _, good, bad, orphan, _ = damaged_store(env, flip_byte)
    result = CliRunner().invoke(cli, ["admin", "fsck"], env=cli_env)
    assert result.exit_code == 1, result.output
    assert f"damaged  {bad}: its {len(DATA)} bytes hash to" in result.output
    assert f"orphan   {orphan}: no row names it" in result.output and "missing  " + "e" * 64 in result.output
    assert "4 blobs, 1.2 MB: 2 damaged, 1 missing, 1 orphans" in result.output
    result = CliRunner().invoke(cli, ["admin", "fsck", "--quarantine"], env=cli_env)
    assert result.exit_code == 1 and f"moved 3 to {store.quarantine_dir}" in result.output, result.output
    with db.session() as s:  # the rows naming damage go; what stays is whole
        s.execute(delete(Checkpoint))
    store.put_bytes(b"a new orphan")
    result = CliRunner().invoke(cli, ["admin", "fsck"], env=cli_env)
    assert result.exit_code == 0 and "0 damaged, 0 missing, 1 orphans" in result.output, result.output
    assert store.exists(good)
