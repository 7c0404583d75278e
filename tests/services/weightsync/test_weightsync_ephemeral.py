"""Ephemeral weight versions (services/weightsync/store.py, "Ephemeral versions"): a lineage keeps its
max_ephemeral newest ones; publishing another deletes the older ones (their blobs too, unless another row names
them, and the cached deltas from or to them), a deleted one is refused naming it as replaced, durable versions are
never touched, and DeleteEphemeralVersions deletes all of a lineage's."""
from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save
from sqlalchemy import select

from services.common import fsck
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import FailedPrecondition, NotFound
from services.common.schema import WeightDelta
from services.weightsync.store import Chunk, FileSpec, PublishHeader, WeightStore

FILE = "model.safetensors"
KEEP = 3


@pytest.fixture()
def env(tmp_path):
    url = f"sqlite:///{tmp_path / 'trainyard.db'}"
    migrate(url)
    db = Database(url)
    alice, bob = create_account(db, "alice")[0].id, create_account(db, "bob")[0].id
    store = WeightStore(db, BlobStore(tmp_path / "blobs"), max_ephemeral=KEEP)
    yield store, alice, bob
    db.dispose()


def publish(store: WeightStore, account: str, step: int, *, ephemeral: bool, lineage: str = "sess") -> str:
    """A full-weight version whose tensor depends on step (the same step: the same bytes, the same blob)."""
    data = save({"w": torch.full((64,), float(step))})
    latest = store.latest(account, lineage)
    header = PublishHeader(lineage=lineage, parent_id=latest.id if latest else "", kind="full", base_model="tiny",
                           files=[FileSpec(FILE, hashlib.sha256(data).hexdigest(), len(data))], metadata={},
                           ephemeral=ephemeral)
    return store.publish(account, header, [Chunk(FILE, 0, data, hashlib.sha256(data).hexdigest())]).id


def blob(store: WeightStore, account: str, version: str) -> str:
    return store.get(account, version).files[0]["sha256"]


def test_a_lineage_keeps_its_newest_ephemeral_versions_and_releases_the_rest(env):
    store, alice, _ = env
    durable = publish(store, alice, 0, ephemeral=False)
    shared = publish(store, alice, 0, ephemeral=True)  # the durable version's bytes: one blob for both rows
    ephemeral = [shared] + [publish(store, alice, step, ephemeral=True) for step in range(1, 10)]
    gone, kept = ephemeral[:-KEEP], ephemeral[-KEEP:]
    assert [v.id for v in store.list(alice, "sess")] == [durable, *kept]
    assert [store.get(alice, v).version for v in kept] == [9, 10, 11]  # numbering goes on through the deleted ones
    for version in gone:
        with pytest.raises(FailedPrecondition, match=f"ephemeral weight version '{version}' .* was replaced by newer "
                                                     r"ones .*save_weights_for_sampler\(name\) keeps one"):
            store.get(alice, version)
        with pytest.raises(FailedPrecondition, match=version):
            list(store.fetch(alice, version))
    # Every blob left is one a listed version names (the durable one kept the blob it shares), and nothing else.
    report = fsck.check(store.blobs, store.db)
    assert report.findings == [] and report.blobs == 1 + KEEP
    assert store.blobs.exists(blob(store, alice, durable))
    assert b"".join(c.data for c in store.fetch(alice, kept[-1])) == save({"w": torch.full((64,), 9.0)})


def test_durable_versions_are_never_deleted_and_do_not_count(env):
    store, alice, _ = env
    versions = []
    for step in range(8):
        versions.append(publish(store, alice, 100 + step, ephemeral=step % 2 == 1))
    durable, ephemeral = versions[0::2], versions[1::2]
    # 4 durable and 4 ephemeral versions: the oldest ephemeral one went, every durable one stays.
    assert [v.id for v in store.list(alice, "sess")] == sorted(durable + ephemeral[1:], key=versions.index)


def test_deltas_from_or_to_a_deleted_version_are_dropped(env):
    store, alice, _ = env
    first = publish(store, alice, 1, ephemeral=True)
    second = publish(store, alice, 2, ephemeral=True)
    delta = store.delta_file(alice, first, store.get(alice, second))
    assert store.blobs.exists(delta["sha256"])
    for step in range(3, 3 + KEEP):
        publish(store, alice, step, ephemeral=True)
    with store.db.session() as s:
        assert list(s.scalars(select(WeightDelta))) == []
    assert not store.blobs.exists(delta["sha256"])
    with pytest.raises(FailedPrecondition, match=first):
        store.delta_file(alice, first, store.latest(alice, "sess"))


def test_deleting_a_lineages_ephemeral_versions_is_the_owners_alone(env):
    store, alice, bob = env
    durable = publish(store, alice, 0, ephemeral=False)
    for step in range(1, 3):
        publish(store, alice, step, ephemeral=True)
    with pytest.raises(NotFound):
        store.delete_ephemeral(bob, "sess")
    assert len(store.list(alice, "sess")) == 3
    assert store.delete_ephemeral(alice, "sess") == 2
    assert [v.id for v in store.list(alice, "sess")] == [durable]
    report = fsck.check(store.blobs, store.db)
    assert report.findings == [] and report.blobs == 1
    assert store.delete_ephemeral(alice, "sess") == 0
    with pytest.raises(NotFound):
        store.delete_ephemeral(alice, "no-such-lineage")
