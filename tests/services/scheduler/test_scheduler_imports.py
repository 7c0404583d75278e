"""Which model directories an account may import (ImportModel, services/common/registry.py importable_dir): only under
model_import_roots (none when it is empty, the default), never the platform's data directory even inside a root,
never a directory another account imported; one message for "not allowed" and "not there"."""
from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from services.common import auth
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import InvalidArgument, NotFound
from services.scheduler.accounts import AccountCore
from services.scheduler.settings import SchedulerSettings


@pytest.fixture()
def env(tmp_path, tiny_model_dir):
    """roots/ holds the tiny model (public) and the data directory (a root holding the data volume, as a careless
    configuration might); outside/ holds another copy of the model."""
    data = tmp_path / "roots" / "data"
    url = f"sqlite:///{data / 'trainyard.db'}"
    data.mkdir(parents=True)
    migrate(url)
    db = Database(url)
    accounts = {name: auth.create_account(db, name)[0].id for name in ("alice", "bob")}
    shutil.copytree(tiny_model_dir, tmp_path / "roots" / "public")
    shutil.copytree(tiny_model_dir, tmp_path / "outside" / "model")
    # What the rollout keeps of another account's full-weight version: a complete model directory.
    shutil.copytree(tiny_model_dir, data / "rollout" / "full" / "wv_of_alice")
    core = AccountCore(db, BlobStore(data / "blobs"), [tmp_path / "roots"], [data, data / "blobs"])
    yield core, accounts, tmp_path
    db.dispose()


def _refusal(call) -> str:
    with pytest.raises(InvalidArgument) as exc:
        call()
    assert [v.field for v in exc.value.violations] == ["path"]
    return exc.value.violations[0].reason


def test_imports_stay_inside_the_roots_and_out_of_the_data(env):
    core, acct, root = env
    model = core.import_model(acct["alice"], "mine", str(root / "roots" / "public"))
    assert model.path == str((root / "roots" / "public").resolve())
    (root / "roots" / "link").symlink_to(root / "roots" / "data" / "rollout" / "full" / "wv_of_alice")
    (root / "roots" / "escape").symlink_to(root / "outside" / "model")
    refused = {
        "data": root / "roots" / "data" / "rollout" / "full" / "wv_of_alice",
        "link into data": root / "roots" / "link",
        "link out of the roots": root / "roots" / "escape",
        "dot-dot out of the roots": root / "roots" / ".." / "outside" / "model",
        "outside": root / "outside" / "model",
        "missing outside": root / "outside" / "nothing",
        "missing inside": root / "roots" / "nothing",
        "a file": root / "roots" / "public" / "config.json",
    }
    reasons = {what: _refusal(lambda p=p: core.import_model(acct["bob"], "x", str(p))).replace(str(p), "<path>")
               for what, p in refused.items()}
    assert len(set(reasons.values())) == 1, reasons  # nothing tells what exists where
    assert _refusal(lambda: core.import_model(acct["bob"], "x", "relative/path")).startswith("required")
    assert [m.name for m in core.list_models(acct["bob"])] == []


def test_an_empty_import_roots_allows_no_import(env, tmp_path):
    core, acct, root = env
    closed = AccountCore(core.db, core.blobs, [], core.private_dirs)
    assert "model_import_roots is empty" in _refusal(
        lambda: closed.import_model(acct["alice"], "x", str(root / "roots" / "public")))
    assert SchedulerSettings(data_dir=tmp_path / "d").model_import_roots == []


def test_an_import_belongs_to_the_importing_account(env):
    core, acct, root = env
    public = root / "roots" / "public"
    core.import_model(acct["alice"], "alices", str(public))
    assert core.import_model(acct["alice"], "alices", str(public)).name == "alices"  # again: the same model
    # Neither by name nor by path (nor a path around or inside it) can bob reach it.
    with pytest.raises(NotFound):
        core.get_model(acct["bob"], "alices")
    assert [m.name for m in core.list_models(acct["bob"])] == []
    inside = public / "nested"
    shutil.copytree(public, inside, ignore=shutil.ignore_patterns("nested"))
    for path in (public, root / "roots" / "link-to-public", inside):
        if path.name == "link-to-public":
            path.symlink_to(public)
        reason = _refusal(lambda p=path: core.import_model(acct["bob"], "bobs", str(p)))
        assert "not a model directory this account can import" in reason
    assert [m.name for m in core.list_models(acct["bob"])] == []


def test_the_admin_import_refuses_the_data_directory(env):
    """`trainyard admin import-model` shares a directory with every account: anywhere but the data directory, which
    holds the accounts' own weights."""
    from trainyard.cli.admin import admin

    core, acct, root = env
    data = root / "roots" / "data"
    cli_env = {"TRAINYARD_DATA_DIR": str(data), "TRAINYARD_DATABASE_URL": core.db.url}
    out = CliRunner().invoke(admin, ["import-model", str(data / "rollout" / "full" / "wv_of_alice")], env=cli_env)
    assert out.exit_code == 1 and "not a model directory" in out.output, out.output
    out = CliRunner().invoke(admin, ["import-model", str(root / "outside" / "model"), "--name", "shared"],
                             env=cli_env)
    assert out.exit_code == 0, out.output
    assert [m.name for m in core.list_models(acct["bob"])] == ["shared"]


def test_an_account_name_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    for bad in ("acme\n", "acme\x00", "a b"):
        with pytest.raises(InvalidArgument):
            auth.create_account(db, bad)
    db.dispose()
