"""What the weight-sync store reads is verified (services/weightsync/store.py): a version's damaged file, a damaged
delta base and a damaged cached delta each end the fetch with DataLoss naming the object; a damaged cached delta is
dropped (its blob quarantined), so the next fetch encodes it again instead of serving the damage forever."""
from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save
from sqlalchemy import select

from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import DataLoss
from services.common.schema import WeightDelta
from services.weightsync.codec import apply_delta
from services.weightsync.store import Chunk, FileSpec, PublishHeader, WeightStore

pytestmark = pytest.mark.reliability

FILE = "model.safetensors"


@pytest.fixture()
def env(tmp_path):
    url = f"sqlite:///{tmp_path / 'trainyard.db'}"
    migrate(url)
    db = Database(url)
    account = create_account(db, "alice")[0].id
    store = WeightStore(db, BlobStore(tmp_path / "blobs"))
    yield store, account
    db.dispose()


def weights(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = {"w": torch.randn(512, 256, generator=gen), "b": torch.randn(256, generator=gen)}
    w["w"][step, :8] += step  # each version changes a few elements
    return w


def publish(store: WeightStore, account: str, parent: str, tensors: dict) -> str:
    data = save(tensors)
    sha = hashlib.sha256(data).hexdigest()
    header = PublishHeader(lineage="run", parent_id=parent, kind="full", base_model="tiny",
                           files=[FileSpec(FILE, sha, len(data))], metadata={})
    step = 100_000
    chunks = [Chunk(FILE, i, data[i:i + step], hashlib.sha256(data[i:i + step]).hexdigest())
              for i in range(0, len(data), step)]
    return store.publish(account, header, chunks).id


def fetched(store: WeightStore, account: str, version: str, **kw) -> bytes:
    return b"".join(c.data for c in store.fetch(account, version, **kw))


def version_blob(store: WeightStore, account: str, version: str):
    return store.blobs.path(store.get(account, version).files[0]["sha256"])


def test_a_damaged_version_file_ends_the_fetch_with_data_loss(env, flip_byte):
    store, account = env
    v1 = publish(store, account, "", weights(1))
    whole = fetched(store, account, v1)
    flip_byte(version_blob(store, account, v1), -5)
    with pytest.raises(DataLoss, match=f"weight version {v1} file {FILE}: blob .* is damaged"):
        fetched(store, account, v1)
    with pytest.raises(DataLoss, match=f"weight version {v1} file {FILE}"):  # a resumed fetch checks all of it
        fetched(store, account, v1, from_path=FILE, from_offset=len(whole) - 100)


def test_a_damaged_delta_base_is_data_loss_naming_the_base(env, flip_byte):
    store, account = env
    v1 = publish(store, account, "", weights(1))
    v2 = publish(store, account, v1, weights(2))
    flip_byte(version_blob(store, account, v1), -5)
    with pytest.raises(DataLoss, match=f"weight version {v1} file {FILE}: blob .* is damaged"):
        fetched(store, account, v2, base_version_id=v1)


def test_a_damaged_cached_delta_is_dropped_and_encoded_again(env, flip_byte):
    store, account = env
    v1 = publish(store, account, "", weights(1))
    v2 = publish(store, account, v1, weights(2))
    delta = fetched(store, account, v2, base_version_id=v1)
    assert apply_delta(weights(1), delta)["w"].equal(weights(2)["w"])
    with store.db.session() as s:
        cached = s.scalars(select(WeightDelta)).one()
    flip_byte(store.blobs.path(cached.sha256), len(delta) // 2)
    with pytest.raises(DataLoss, match=f"delta from weight version {v1} to {v2}: blob {cached.sha256} is damaged"):
        fetched(store, account, v2, base_version_id=v1)
    with store.db.session() as s:
        assert s.scalars(select(WeightDelta)).all() == []
    assert (store.blobs.quarantine_dir / cached.sha256).is_file()
    assert fetched(store, account, v2, base_version_id=v1) == delta  # encoded again, whole
    with store.db.session() as s:  # the same bytes, so the same blob as before, now intact
        assert s.scalars(select(WeightDelta)).one().sha256 == cached.sha256
    assert store.blobs.exists(cached.sha256)
