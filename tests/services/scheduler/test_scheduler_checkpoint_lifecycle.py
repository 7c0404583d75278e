"""CheckpointService's lifecycle RPCs on an in-process scheduler (SQLite, a real blob store, two accounts): paged
listing, deletion (blobs another row names stay; a deployment or open session using it refuses, naming it),
TTL (unreadable once expired, then swept), publishing (another account reads, never changes), and every bad input
naming its field."""
from __future__ import annotations

import time

import pytest

from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.schema import Checkpoint, Deployment, TrainingSession, new_id, utcnow
from services.scheduler.app import build
from services.scheduler.checkpoints import CheckpointCore
from services.scheduler.settings import SchedulerSettings
from trainyard import Client, TrainyardError


@pytest.fixture()
def env(tmp_path):
    settings = SchedulerSettings(data_dir=tmp_path / "data", host="127.0.0.1", scheduler_port=0, grpc_workers=4,
                                 shutdown_grace_s=0, builtin_tiny_models=False, reaper_interval_s=0.2)
    migrate(settings.database_url)
    db = Database(settings.database_url)
    alice, _, alice_key = create_account(db, "alice")
    _, _, bob_key = create_account(db, "bob")
    blobs = BlobStore(settings.blob_dir)
    server = build(settings)
    server.start()
    url = f"127.0.0.1:{server.port}"
    with Client(url=url, api_key=alice_key) as a, Client(url=url, api_key=bob_key) as b:
        yield db, blobs, alice.id, a, b
    server.stop()
    db.dispose()


def _checkpoint(db, blobs, tmp_path, account_id: str, content: bytes, session_id: str | None = None,
                shared: bytes = b"shared config") -> Checkpoint:
    src = tmp_path / new_id("src")
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(content)
    (src / "adapter_config.json").write_bytes(shared)
    ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, base_model="tiny", created_at=utcnow(),
                      session_id=session_id, files=[f.to_json() for f in blobs.put_tree(src)])
    with db.session() as s:
        s.add(ckpt)
    return ckpt


def _code(call) -> str:
    with pytest.raises(TrainyardError) as exc:
        call()
    return exc.value.code


def test_listing_pages_newest_first(env, tmp_path):
    db, blobs, alice, a, _ = env
    made = [_checkpoint(db, blobs, tmp_path, alice, b"w%d" % i) for i in range(5)]
    page = a.checkpoints_page(limit=2, offset=1)
    assert page.total == 5 and [c.id for c in page.checkpoints] == [made[3].id, made[2].id]
    assert [c.id for c in a.list_checkpoints()] == [c.id for c in made]  # no limit: all, oldest first
    c = page.checkpoints[0]
    assert (c.checkpoint_type, c.size_bytes, c.public, c.account_id) == ("training", 2 + 13, False, alice)
    assert not c.HasField("expires_at")
    with pytest.raises(TrainyardError, match="limit"):
        a.checkpoints_page(limit=1001)


def test_delete_keeps_blobs_other_rows_name_and_refuses_checkpoints_in_use(env, tmp_path):
    db, blobs, alice, a, b = env
    gone = _checkpoint(db, blobs, tmp_path, alice, b"only mine")
    other = _checkpoint(db, blobs, tmp_path, alice, b"another")  # names the same adapter_config.json blob
    own = {f.path: f.sha256 for f in a.get_checkpoint(gone.id).files}
    assert _code(lambda: b.delete_checkpoint(gone.id)) == "NOT_FOUND"
    a.delete_checkpoint(gone.id)
    assert _code(lambda: a.get_checkpoint(gone.id)) == "NOT_FOUND"
    assert not blobs.path(own["adapter_model.safetensors"]).exists()
    assert blobs.path(own["adapter_config.json"]).exists()  # still named by the other checkpoint
    assert _code(lambda: a.delete_checkpoint(gone.id)) == "NOT_FOUND"

    with db.session() as s:
        s.add(Deployment(id=new_id("dep"), account_id=alice, name="served", checkpoint_id=other.id,
                         base_model="tiny", status="ready"))
    with pytest.raises(TrainyardError, match="deployment 'served'") as exc:
        a.delete_checkpoint(other.id)
    assert exc.value.code == "FAILED_PRECONDITION"

    sess = new_id("sess")
    state = _checkpoint(db, blobs, tmp_path, alice, b"state", session_id=sess)
    with db.session() as s:
        s.add(TrainingSession(id=sess, account_id=alice, base_model="tiny", lora_rank=4, lora_alpha=32.0,
                              state_checkpoint_id=state.id))
    with pytest.raises(TrainyardError, match=f"session {sess}"):
        a.delete_checkpoint(state.id)
    with db.session() as s:
        s.get(TrainingSession, sess).closed_at = utcnow()
    a.delete_checkpoint(state.id)


def test_a_checkpoint_once_served_by_a_deleted_deployment_deletes_and_sweeps(env, tmp_path):
    """A deleted deployment stays as history naming its checkpoint; deleting the checkpoint (or its expiry) then
    must not fail on that reference (it was an INTERNAL foreign-key error), and the history stops naming it."""
    db, blobs, alice, a, _ = env
    deleted, expired = (_checkpoint(db, blobs, tmp_path, alice, b"was served %d" % i) for i in range(2))
    with db.session() as s:
        for i, ckpt in enumerate((deleted, expired)):
            s.add(Deployment(id=new_id("dep"), account_id=alice, name=f"old-{i}", checkpoint_id=ckpt.id,
                             base_model="tiny", status="deleted", deleted_at=utcnow()))
    a.delete_checkpoint(deleted.id)
    assert _code(lambda: a.get_checkpoint(deleted.id)) == "NOT_FOUND"
    a.set_checkpoint_ttl(expired.id, 1)
    time.sleep(1.1)
    CheckpointCore(db, blobs).sweep_expired()
    with db.session() as s:
        assert s.get(Checkpoint, expired.id) is None
        assert {d.name: d.checkpoint_id for d in s.query(Deployment).filter(Deployment.account_id == alice)} == {
            "old-0": None, "old-1": None}


def test_ttl_makes_a_checkpoint_unreadable_then_the_sweep_removes_it(env, tmp_path):
    db, blobs, alice, a, _ = env
    ckpt = _checkpoint(db, blobs, tmp_path, alice, b"short-lived")
    weights = next(f.sha256 for f in a.get_checkpoint(ckpt.id).files if f.path == "adapter_model.safetensors")
    set_at = time.time()
    assert 3599 <= a.set_checkpoint_ttl(ckpt.id, 3600).expires_at.seconds - set_at <= 3601
    assert not a.set_checkpoint_ttl(ckpt.id, None).HasField("expires_at")  # None clears it
    for bad in (0, -1, 10**12):
        with pytest.raises(TrainyardError, match="ttl_seconds"):
            a.set_checkpoint_ttl(ckpt.id, bad)

    a.set_checkpoint_ttl(ckpt.id, 1)
    time.sleep(1.1)
    # Unreadable at once, whatever the sweep has done yet.
    assert _code(lambda: a.get_checkpoint(ckpt.id)) == "NOT_FOUND"
    assert _code(lambda: a.download_checkpoint(ckpt.id, tmp_path / "dl")) == "NOT_FOUND"
    assert ckpt.id not in [c.id for c in a.list_checkpoints()]
    deadline = time.monotonic() + 10
    while blobs.path(weights).exists():  # the reaper's sweep, every reaper_interval_s
        assert time.monotonic() < deadline, "the expired checkpoint was not swept"
        time.sleep(0.1)
    with db.session() as s:
        assert s.get(Checkpoint, ckpt.id) is None


def test_sweep_keeps_expired_checkpoints_in_use(env, tmp_path):
    db, blobs, alice, a, _ = env
    ckpt = _checkpoint(db, blobs, tmp_path, alice, b"served")
    with db.session() as s:
        s.add(Deployment(id=new_id("dep"), account_id=alice, name="keep", checkpoint_id=ckpt.id, base_model="tiny",
                         status="ready"))
    a.set_checkpoint_ttl(ckpt.id, 1)
    time.sleep(1.1)
    assert CheckpointCore(db, blobs).sweep_expired() == 0
    with db.session() as s:
        assert s.get(Checkpoint, ckpt.id) is not None
    assert _code(lambda: a.get_checkpoint(ckpt.id)) == "NOT_FOUND"  # but unreadable all the same


def test_published_checkpoints_are_readable_not_changeable_by_other_accounts(env, tmp_path):
    db, blobs, alice, a, b = env
    ckpt = _checkpoint(db, blobs, tmp_path, alice, b"public weights")
    assert _code(lambda: b.get_checkpoint(ckpt.id)) == "NOT_FOUND"
    assert _code(lambda: b.publish_checkpoint(ckpt.id)) == "NOT_FOUND"
    assert a.publish_checkpoint(ckpt.id).public
    seen = b.get_checkpoint(ckpt.id)
    assert seen.public and seen.account_id == alice
    out = b.download_checkpoint(ckpt.id, tmp_path / "theirs")
    assert (out / "adapter_model.safetensors").read_bytes() == b"public weights"
    assert ckpt.id not in [c.id for c in b.list_checkpoints()]  # listed by its owner only
    for change in (lambda: b.delete_checkpoint(ckpt.id), lambda: b.set_checkpoint_ttl(ckpt.id, 60),
                   lambda: b.publish_checkpoint(ckpt.id, public=False)):
        assert _code(change) == "NOT_FOUND"
    assert not a.publish_checkpoint(ckpt.id, public=False).public
    assert _code(lambda: b.get_checkpoint(ckpt.id)) == "NOT_FOUND"
    assert _code(lambda: b.download_checkpoint(ckpt.id, tmp_path / "again")) == "NOT_FOUND"


def test_cli_publishes_expires_and_deletes(env, tmp_path):
    from click.testing import CliRunner

    from trainyard.cli.main import cli

    db, blobs, alice, a, b = env
    ckpt = _checkpoint(db, blobs, tmp_path, alice, b"via the cli")
    cli_env = {"TRAINYARD_URL": a.config.url, "TRAINYARD_API_KEY": a.config.api_key}

    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, ["checkpoints", *args], env=cli_env)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    assert run("publish", ckpt.id) == f"{ckpt.id} is public" and b.get_checkpoint(ckpt.id).public
    assert run("publish", ckpt.id, "--undo") == f"{ckpt.id} is private"
    assert run("ttl", ckpt.id, "3600").startswith(f"{ckpt.id} expires 20")
    assert run("ttl", ckpt.id) == f"{ckpt.id} expires never"
    assert run("delete", ckpt.id) == f"deleted {ckpt.id}"
    assert _code(lambda: a.get_checkpoint(ckpt.id)) == "NOT_FOUND"
