"""The object store's integrity (services/common/blobstore.py, blobrefs.py, fsck.py): every read verifies the bytes
against the blob's name and fails with DataLoss naming the object; staging files of killed processes are swept at
start-up; a failed save takes back the blobs it created, never one another save is about to name."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common import auth, blobrefs
from services.common.blobstore import BlobStore, StoredFile
from services.common.db import Database, migrate
from services.common.errors import DataLoss
from services.common.schema import Checkpoint, new_id, utcnow

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[3]
DATA = bytes(range(256)) * 5000  # 1.28 MB: more than one read chunk


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


# -- verified reads --------------------------------------------------------------------------------------------------

def test_every_read_of_a_damaged_blob_is_data_loss_naming_the_object(tmp_path, flip_byte):
    store = BlobStore(tmp_path / "blobs")
    digest, size = store.put_bytes(DATA)
    assert b"".join(store.read_verified(digest, "checkpoint c1 file a.bin")) == DATA
    assert b"".join(store.read_verified(digest, "x", offset=1000)) == DATA[1000:]
    flip_byte(store.path(digest), -1)
    with pytest.raises(DataLoss, match=f"checkpoint c1 file a.bin: blob {digest} is damaged"):
        b"".join(store.read_verified(digest, "checkpoint c1 file a.bin"))
    flip_byte(store.path(digest), -1)  # repaired
    flip_byte(store.path(digest), 10)
    with pytest.raises(DataLoss):  # damage before the offset a resumed read starts at still counts
        b"".join(store.read_verified(digest, "x", offset=size // 2))
    other, _ = store.put_bytes(b"other")
    with pytest.raises(DataLoss, match="read 5 bytes .* expected 7 bytes"):  # the row's size counts too
        store.read_bytes(other, "x", size=7)
    with pytest.raises(DataLoss, match="weight version wv_1 file m.safetensors: blob 0{64} is missing"):
        store.read_bytes("0" * 64, "weight version wv_1 file m.safetensors")


def test_materialize_verifies_each_file_and_leaves_no_damaged_copy(tmp_path, flip_byte):
    store = BlobStore(tmp_path / "blobs")
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(DATA)
    (src / "sub" / "b.txt").write_text("fine")
    manifest = store.put_tree(src)
    out = store.materialize(manifest, tmp_path / "ok", what="checkpoint ckpt_1")
    assert (out / "a.bin").read_bytes() == DATA and (out / "sub" / "b.txt").read_text() == "fine"
    flip_byte(store.path(manifest[0].sha256), 123)
    with pytest.raises(DataLoss, match=f"checkpoint ckpt_1 file a.bin: blob {manifest[0].sha256} is damaged"):
        store.materialize(manifest, tmp_path / "bad", what="checkpoint ckpt_1")
    assert not (tmp_path / "bad" / "a.bin").exists()
    with pytest.raises(DataLoss, match="checkpoint ckpt_1 file gone.bin: blob f{64} is missing"):
        store.materialize([StoredFile("gone.bin", "f" * 64, 1)], tmp_path / "gone", what="checkpoint ckpt_1")


def test_materialize_across_file_systems_verifies_the_copy(tmp_path, flip_byte):
    """Where hard links cannot reach (another file system), the copy is the one verified pass."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second file system at /dev/shm")
    store = BlobStore(tmp_path / "blobs")
    digest, size = store.put_bytes(DATA)
    dest = Path(os.path.join(shm, f"ty-{os.getpid()}-{tmp_path.name}"))
    try:
        out = store.materialize([StoredFile("a.bin", digest, size)], dest, what="dataset ds_1")
        assert (out / "a.bin").read_bytes() == DATA and os.stat(out / "a.bin").st_nlink == 1  # a copy
        flip_byte(store.path(digest), 0)
        with pytest.raises(DataLoss, match="dataset ds_1 file a.bin"):
            store.materialize([StoredFile("a.bin", digest, size)], dest, what="dataset ds_1")
        assert not (dest / "a.bin").exists()
    finally:
        subprocess.run(["rm", "-rf", str(dest)], check=True)


# -- staging ---------------------------------------------------------------------------------------------------------

WRITER = """
import sys, time
from services.common.blobstore import BlobStore
f, tmp = BlobStore(sys.argv[1]).staging_file()
f.write(b"half of an upload")
f.flush()
print(tmp, flush=True)
time.sleep(600)
"""


def test_staging_files_of_killed_processes_are_swept_and_live_ones_kept(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(store.root)], stdout=subprocess.PIPE, text=True,
                                env=env) for _ in range(2)]
    try:
        staged = [Path(w.stdout.readline().strip()) for w in writers]
        assert all(p.is_file() and p.parent.parent == store.root / "tmp" for p in staged)
        writers[0].send_signal(signal.SIGKILL)  # no chance to clean up
        writers[0].wait()
        mine = store.staging_dir()
        assert store.sweep_staging() == [staged[0].parent]
        assert not staged[0].parent.exists()
        assert staged[1].is_file() and mine.is_dir()  # a live writer's and this process's own stay
        assert store.sweep_staging() == []
    finally:
        for w in writers:
            w.kill()
            w.wait()
            w.stdout.close()
    assert store.sweep_staging() == [staged[1].parent]


# -- failed saves ----------------------------------------------------------------------------------------------------

def test_a_failed_save_takes_back_only_the_blobs_it_created(env):
    db, store, account = env
    kept, _ = store.put_bytes(b"stored before the save")
    with pytest.raises(RuntimeError, match="insert failed"), store.saving(blobrefs.checker(db)) as save:
        created, _ = save.put_bytes(b"new in this save")
        again, _ = save.put_bytes(b"stored before the save")
        raise RuntimeError("insert failed")
    assert not store.exists(created) and store.exists(kept) and again == kept
    with store.saving(blobrefs.checker(db)) as save:  # a save that writes its row keeps its blobs
        digest, size = save.put_bytes(b"named")
        add_checkpoint(db, account, [StoredFile("a", digest, size)])
    assert store.exists(digest)


def test_a_failed_save_waits_for_a_save_that_reused_its_blob(env):
    """A creates a blob, B stores the same bytes (a no-op) and is about to write its row when A fails: A's cleanup
    waits for B, sees B's row and keeps the blob."""
    db, store, account = env
    a_committed, b_committed, b_go = threading.Event(), threading.Event(), threading.Event()
    result = {}

    def a():
        try:
            with store.saving(blobrefs.checker(db)) as save:
                result["shared"] = save.put_bytes(b"shared bytes")
                result["own"] = save.put_bytes(b"only a's")[0]
                a_committed.set()
                b_committed.wait(10)
                raise RuntimeError("a's insert failed")
        except RuntimeError:
            result["a_done"] = time.monotonic()

    def b():
        a_committed.wait(10)
        with store.saving(blobrefs.checker(db)) as save:
            digest, size = save.put_bytes(b"shared bytes")
            b_committed.set()
            b_go.wait(10)
            add_checkpoint(db, account, [StoredFile("w", digest, size)])
            result["b_done"] = time.monotonic()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    b_committed.wait(10)
    time.sleep(0.3)
    assert "a_done" not in result  # a's cleanup is waiting for b
    b_go.set()
    for t in threads:
        t.join(10)
    shared, _ = result["shared"]
    assert result["a_done"] > result["b_done"]
    assert store.exists(shared) and not store.exists(result["own"])
