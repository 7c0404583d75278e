"""Configuration, migrations, the object store, API keys and generated stubs."""
from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from services.common import auth
from services.common.blobstore import BlobStore, StoredFile, sha256_file
from services.common.config import TrainyardSettings
from services.common.db import Database, current_revision, make_engine, migrate
from services.common.errors import AlreadyExists, InvalidArgument, Unauthenticated
from services.common.schema import Base

ROOT = Path(__file__).resolve().parents[3]


def test_generated_stubs_match_the_protos(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = ROOT / "trainyard" / "v1" / path.name
        assert committed.exists() and filecmp.cmp(path, committed, shallow=False), \
            f"{committed.name} is stale: run python scripts/gen_protos.py"


def test_settings_precedence_env_over_file_over_defaults(tmp_path, monkeypatch):
    cfg = tmp_path / "trainyard.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'from-file'}\nscheduler_port: 6000\nrollout_port: 6002\n")
    monkeypatch.setenv("TRAINYARD_CONFIG", str(cfg))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_PORT", "7002")
    s = TrainyardSettings()
    assert s.scheduler_port == 6000 and s.rollout_port == 7002
    assert s.database_url == f"sqlite:///{tmp_path / 'from-file' / 'trainyard.db'}"
    assert s.blob_dir == tmp_path / "from-file" / "blobs"
    assert TrainyardSettings(rollout_port=1).rollout_port == 1
    monkeypatch.setenv("TRAINYARD_ROLLOUT_PORT", "not-a-port")
    with pytest.raises(ValueError, match="rollout_port"):
        TrainyardSettings()
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError, match="TRAINYARD_CONFIG"):
        TrainyardSettings()


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db' / 'trainyard.db'}"
    else:
        yield request.getfixturevalue("pg_url")


def test_fresh_database_upgrades_to_head_matching_the_models(fresh_db_url):
    migrate(fresh_db_url)
    migrate(fresh_db_url)  # idempotent
    from alembic.script import ScriptDirectory

    from services.common.db import alembic_config

    assert current_revision(fresh_db_url) == ScriptDirectory.from_config(alembic_config(fresh_db_url)).get_current_head()
    engine = make_engine(fresh_db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == [], diff


def test_accounts_and_keys(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    migrate(url)
    db = Database(url)
    account, key, secret = auth.create_account(db, "acme")
    assert secret.startswith("ty_") and key.prefix == secret[:10] and key.key_hash != secret
    caller = auth.KeyAuthenticator(db).authenticate(secret)
    assert (caller.account_id, caller.account_name) == (account.id, "acme")
    with pytest.raises(AlreadyExists):
        auth.create_account(db, "acme")
    with pytest.raises(InvalidArgument, match="name"):
        auth.create_account(db, "bad name")
    for bad in (None, "", "ty_nope"):
        with pytest.raises(Unauthenticated):
            auth.KeyAuthenticator(db).authenticate(bad)
    assert auth.key_from_metadata((("authorization", "Bearer abc"),)) == "abc"
    assert auth.key_from_metadata((("x-api-key", "xyz"),)) == "xyz"
    db.dispose()


def test_blob_store_is_content_addressed_and_atomic(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    digest, size = store.put_bytes(b"hello")
    assert size == 5 and store.exists(digest) and store.put_bytes(b"hello")[0] == digest
    assert oct(os.stat(store.path(digest)).st_mode & 0o777) == "0o444"

    def failing():
        yield b"partial"
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        store.put_stream(failing())
    assert [p.name for p in store.staging_dir().iterdir()] == [".lock"]  # nothing half-written remains
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub" / "b.bin").write_bytes(b"\0" * 10)
    manifest = store.put_tree(src)
    assert [f.path for f in manifest] == ["a.txt", "sub/b.bin"]
    out = store.materialize(manifest, tmp_path / "out")
    assert (out / "sub" / "b.bin").read_bytes() == b"\0" * 10
    assert sha256_file(out / "a.txt") == manifest[0].sha256
    with pytest.raises(ValueError, match="escapes"):
        store.materialize([StoredFile("../evil", manifest[0].sha256, 1)], tmp_path / "out2")
    with pytest.raises(ValueError, match="sha256"):
        store.path("../../etc/passwd")
