"""Evaluators as stored, versioned objects owned by an account (services/evaluators/store.py), in process on SQLite:
upload checks, versions, references, ownership, verified layout, and "test on N rows" through the sandbox."""
from __future__ import annotations

import io
import tarfile
import zipfile

import pytest

from services.common import auth
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from services.evaluators.sandbox import Limits
from services.evaluators.store import EvaluatorStore, RowResult, load_evaluator

LIMITS = Limits(cpu_s=2, memory_mb=512, wall_s=10, max_processes=8)
EXACT = b'''\
def reward_fn(completion, row):
    return 1.0 if completion.strip() == str(row["answer"]) else 0.0
'''
ENVIRONMENT = b'''\
class Environment:
    def reset(self, row):
        self.answer = row["answer"]
        return "what is " + row["question"] + "?"

    def step(self, action):
        return "done", float(action.strip() == str(self.answer)), True
'''


def _zip(files: dict[str, bytes], links: tuple[str, ...] = ()) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o120777 << 16
            archive.writestr(info, "/etc/passwd")
    return out.getvalue()


def _tar(files: dict[str, bytes], link: str = "") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            archive.addfile(info)
    return out.getvalue()


@pytest.fixture()
def env(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    alice, _, _ = auth.create_account(db, "alice")
    bob, _, _ = auth.create_account(db, "bob")
    blobs = BlobStore(tmp_path / "blobs")
    yield EvaluatorStore(db, blobs, LIMITS, max_bytes=64 << 10), alice.id, bob.id
    db.dispose()


def test_versions_and_references(env, tmp_path):
    store, alice, _ = env
    first = store.upload(alice, "exact", "evaluator.py", EXACT)
    second = store.upload(alice, "exact", "evaluator.py", EXACT.replace(b"1.0 if", b"2.0 if"))
    other = store.upload(alice, "env", "env.py", ENVIRONMENT)
    assert (first.version, second.version, other.version) == (1, 2, 1)
    assert (first.kind, other.kind) == ("reward_fn", "environment")
    assert store.get(alice, "exact").id == second.id
    assert store.get(alice, "exact@1").id == first.id
    assert store.get(alice, first.id).version == 1
    rows, more = store.list(alice, "", 0, 50)
    assert [(r.name, r.version) for r in rows] == [("env", 1), ("exact", 2), ("exact", 1)] and more is None
    assert [r.version for r in store.list(alice, "exact", 0, 1)[0]] == [2]
    with pytest.raises(NotFound, match="evaluator 'exact@3' not found"):
        store.get(alice, "exact@3")
    with pytest.raises(InvalidArgument, match="evaluator: 'exact@x'"):
        store.get(alice, "exact@x")
    row = load_evaluator(store.db, store.blobs, alice, "exact@1", tmp_path / "laid")
    assert row.id == first.id and (tmp_path / "laid" / "evaluator.py").read_bytes() == EXACT


def test_another_account_cannot_read_list_test_or_use_it(env, tmp_path):
    store, alice, bob = env
    mine = store.upload(alice, "exact", "evaluator.py", EXACT)
    for ref in ("exact", "exact@1", mine.id):
        with pytest.raises(NotFound):
            store.get(bob, ref)
        with pytest.raises(NotFound):
            store.test(bob, ref, [("1", {"answer": 1})])
        with pytest.raises(NotFound):
            load_evaluator(store.db, store.blobs, bob, ref, tmp_path / "bob")
    assert store.list(bob, "", 0, 50) == ([], None)
    assert store.upload(bob, "exact", "evaluator.py", EXACT).version == 1  # bob's own name space


@pytest.mark.parametrize("name, content, field, message", [
    ("bad name!", EXACT, "name", "is not a name"),
    ("ev_x", EXACT, "name", "is not a name"),
    ("big", b"#" * (65 << 10), "content", "more than the 64 KB limit"),
    ("syntax", b"def reward_fn(c, row)\n    return 1\n", "content", "evaluator.py line 1: SyntaxError: expected ':'"),
    ("helper-syntax", _zip({"evaluator.py": EXACT, "lib/h.py": b"x = (\n"}), "content", "lib/h.py line 1"),
    ("dotdot", _zip({"evaluator.py": EXACT, "../escape.py": b""}), "content", "a path with '..'"),
    ("absolute", _zip({"evaluator.py": EXACT, "/etc/x.py": b""}), "content", "an absolute path"),
    ("zip-link", _zip({"evaluator.py": EXACT}, links=("passwd",)), "content", "holds a link: 'passwd'"),
    ("tar-link", _tar({"evaluator.py": EXACT}, link="passwd"), "content", "holds a link: 'passwd'"),
    ("no-entry", _zip({"reward.py": EXACT}), "content", "no evaluator.py at its top level"),
    ("nothing", b"x = 1\n", "content", "defines neither reward_fn(completion, row) nor class Environment"),
    ("numpy", b"import numpy\n", "content", "ModuleNotFoundError: No module named 'numpy' (line 1)"),
    ("raises", b"raise RuntimeError('no config')\n", "content", "RuntimeError: no config (line 1)"),
])
def test_upload_checks_name_the_field_and_store_nothing(env, tmp_path, name, content, field, message):
    store, alice, _ = env
    with pytest.raises(InvalidArgument) as exc:
        store.upload(alice, name, "x", content)
    assert [v.field for v in exc.value.violations] == [field] and message in exc.value.message, exc.value.message
    assert store.list(alice, "", 0, 50) == ([], None)
    assert not (tmp_path / "blobs" / "sha256").exists()


def test_packages_zip_and_tar_gz(env):
    store, alice, _ = env
    helper = {"scoring/__init__.py": b"", "scoring/parse.py": b"def last_int(t):\n    return int(t.split()[-1])\n"}
    source = b"from scoring.parse import last_int\n\ndef reward_fn(c, row):\n    return float(last_int(c) == row['a'])\n"
    for name, content in (("zipped", _zip({"evaluator.py": source, **helper})),
                          ("tarred", _tar({"./evaluator.py": source, **helper}))):
        assert store.upload(alice, name, f"{name}.pkg", content).kind == "reward_fn"
        report = store.test(alice, name, [("it is 4", {"a": 4}), ("it is 5", {"a": 4}), ("four", {"a": 4})])
        assert report.results == [
            RowResult(1, "it is 4", 1.0), RowResult(2, "it is 5", 0.0),
            RowResult(3, "four", None, "ValueError: invalid literal for int() with base 10: 'four' "
                                       "(scoring/parse.py line 2)")]
        assert report.summary == {"num_rows": 3, "num_ok": 2, "num_errors": 1, "reward_mean": 0.5,
                                  "reward_min": 0.0, "reward_max": 1.0}


def test_an_environment_is_tested_one_step_per_row(env):
    store, alice, _ = env
    store.upload(alice, "quiz", "evaluator.py", ENVIRONMENT)
    report = store.test(alice, "quiz", [("4", {"question": "2+2", "answer": 4}), ("5", {"question": "2+2"})])
    assert report.results[0] == RowResult(1, "4", 1.0, "", "what is 2+2?")
    assert report.results[1] == RowResult(2, "5", None, "reset: KeyError: 'answer' (line 3)")


def test_damaged_bytes_are_refused_when_read(env, tmp_path, flip_byte):
    store, alice, _ = env
    row = store.upload(alice, "exact", "evaluator.py", EXACT)
    flip_byte(store.blobs.path(row.sha256), 5)
    with pytest.raises(DataLoss, match=f"evaluator {row.id}"):
        load_evaluator(store.db, store.blobs, alice, "exact", tmp_path / "laid")


def test_the_version_quota(env):
    store, alice, bob = env
    store.max_per_account = 2
    store.upload(alice, "a", "evaluator.py", EXACT)
    store.upload(alice, "a", "evaluator.py", EXACT)
    with pytest.raises(ResourceExhausted, match=r"quota max_evaluator_versions_per_account \(2\) reached"):
        store.upload(alice, "b", "evaluator.py", EXACT)
    assert store.upload(bob, "a", "evaluator.py", EXACT).version == 1  # another account's quota is its own
