"""No account can starve another on the weight-sync service: WatchLineage streams hold no thread (500 of them with
the default grpc_workers), PublishVersion's header checks are linear and its upload stops when the client leaves,
and weight versions and watchers are bounded per account (max_versions_per_lineage, max_versions_per_account,
max_watches_per_account). A real server in process, on SQLite."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.channels import auth_metadata
from services.common.db import Database, migrate
from services.common.errors import InvalidArgument, ResourceExhausted
from services.weightsync.app import WeightSyncSettings, build
from services.weightsync.client import publish_dir
from services.weightsync.store import FileSpec, PublishHeader, VersionQuotas, WeightStore, check_header
from services.weightsync.watch import LineageWatchers
from trainyard.v1 import common_pb2, weightsync_pb2_grpc
from trainyard.v1 import weightsync_pb2 as wpb

WATCHERS = 500


class Env:
    def __init__(self, root: Path):
        self.settings = WeightSyncSettings(data_dir=root, host="127.0.0.1", weightsync_port=0, shutdown_grace_s=0,
                                           watch_poll_s=0.05, max_versions_per_lineage=2,
                                           max_versions_per_account=4)
        migrate(self.settings.database_url)
        self.db = Database(self.settings.database_url)
        self.alice, _, self.key = create_account(self.db, "alice")
        self.server = build(self.settings)
        self.server.start()
        self.target = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = weightsync_pb2_grpc.WeightSyncServiceStub(self.channel)
        self.parents: dict[str, str] = {}
        self.root = root
        # An asyncio client's loop, closed after the server stops (gRPC hands it the last events of its calls then).
        self.client_loop = asyncio.new_event_loop()

    def publish(self, lineage: str, content: bytes) -> wpb.WeightVersion:
        directory = self.root / "src" / lineage / str(len(self.parents))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_model.safetensors").write_bytes(content)
        version = publish_dir(self.stub, self.key, lineage=lineage, parent_id=self.parents.get(lineage, ""),
                              kind=wpb.WEIGHT_KIND_LORA_ADAPTER, base_model="tiny", directory=directory)
        self.parents[lineage] = version.id
        return version

    def staged(self) -> list[Path]:
        """Staging files left in the store (each process stages in a directory of its own, holding its lock file)."""
        return [f for f in (self.settings.blob_dir / "tmp").rglob("*") if f.is_file() and f.name != ".lock"]

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
        self.client_loop.close()
        self.db.dispose()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("ws_fair"))
    yield e
    e.close()


def _threads(prefix: str) -> tuple[int, list[str]]:
    """The service's pool threads (named prefix_N) and its other threads, by name."""
    names = [t.name for t in threading.enumerate() if t.name.startswith(prefix)]
    pool = [n for n in names if n.startswith(prefix + "_")]
    return len(pool), sorted(n for n in names if not n.startswith(prefix + "_"))


@pytest.mark.reliability
def test_500_watchers_with_the_default_thread_count(env):
    assert env.settings.grpc_workers == 64
    first = env.publish("watched", b"v1")
    peak = {}

    async def watch_all():
        async with grpc.aio.insecure_channel(env.target) as channel:
            stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
            streams = [stub.WatchLineage(wpb.WatchLineageRequest(lineage="watched"),
                                         metadata=auth_metadata(env.key)) for _ in range(WATCHERS)]
            initial = await asyncio.gather(*(s.read() for s in streams))
            assert {s.current.id for s in initial} == {first.id}
            peak["threads"] = _threads("weightsync")
            second = await asyncio.to_thread(env.publish, "watched", b"v2")
            moved = await asyncio.wait_for(asyncio.gather(*(s.read() for s in streams)), timeout=60)
            assert {s.current.id for s in moved} == {second.id}
            for s in streams:
                s.cancel()

    env.client_loop.run_until_complete(watch_all())
    # The pool's threads (at most grpc_workers), the event loop's and the one lineage poller's: none per watcher.
    pool, others = peak["threads"]
    assert pool <= env.settings.grpc_workers, peak
    assert set(others) <= {"weightsync-loop", "weightsync-watch"} and len(others) == len(set(others)), peak


def test_publish_header_checks_are_linear():
    sha = "0" * 64
    files = [FileSpec(f"shard-{i // 100}/part-{i}/weights.safetensors", sha, 1) for i in range(4000)]
    started = time.process_time()
    check_header(PublishHeader("lin", "", "full", "", files, {}))
    assert time.process_time() - started < 2.0
    with pytest.raises(InvalidArgument, match=r"header.files\[4000\]"):  # nesting is still found, at the end too
        check_header(PublishHeader("lin", "", "full", "", files + [FileSpec("shard-3/part-350", sha, 1)], {}))


@pytest.mark.reliability
def test_publish_stops_when_its_client_leaves(env):
    sent_header, release = threading.Event(), threading.Event()
    header = wpb.PublishVersionHeader(lineage="left", kind=wpb.WEIGHT_KIND_LORA_ADAPTER, base_model="tiny", files=[
        wpb.WeightFile(path=f"part-{i}", sha256="0" * 64, size_bytes=1 << 20) for i in range(4000)])

    def requests():
        yield wpb.PublishVersionRequest(header=header)
        yield wpb.PublishVersionRequest(chunk=common_pb2.FileChunk(path="part-0", offset=0, data=b"x" * 1000,
                                                                   sha256=_sha(b"x" * 1000)))
        sent_header.set()
        release.wait(60)  # the client goes quiet, then leaves

    call = env.stub.PublishVersion.future(requests(), metadata=auth_metadata(env.key))
    assert sent_header.wait(30)
    time.sleep(0.3)
    call.cancel()
    release.set()
    deadline = time.monotonic() + 10
    while (env.staged() or env.server.account_calls.in_flight(env.alice.id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env.staged() == [] and env.server.account_calls.in_flight(env.alice.id) == 0
    assert list(env.stub.ListVersions(wpb.ListVersionsRequest(lineage="left"), metadata=auth_metadata(env.key))
                .versions) == []


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_weight_versions_are_bounded_per_lineage_and_account(env):
    env.publish("q1", b"1")
    env.publish("q1", b"2")
    with pytest.raises(grpc.RpcError) as refused:
        env.publish("q1", b"3")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota max_versions_per_lineage (2) reached" in refused.value.details()
    assert env.staged() == []  # refused before the bytes were kept
    with pytest.raises(grpc.RpcError) as refused:  # "watched" holds 2 versions and q1 2: the account 4
        env.publish("q2", b"1")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota max_versions_per_account (4) reached" in refused.value.details()


def test_watchers_are_bounded_per_account(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    alice, bob = create_account(db, "alice")[0].id, create_account(db, "bob")[0].id
    store = WeightStore(db, BlobStore(tmp_path / "blobs"), VersionQuotas())
    for account in (alice, bob):
        store.publish(account, PublishHeader("l", "", "lora_adapter", "tiny", [FileSpec("f", _sha(b""), 0)], {}), [])
    stopping = threading.Event()
    watchers = LineageWatchers(store, 0.05, 1.0, stopping, max_per_account=2)

    def active() -> bool:
        return True

    streams = [watchers.watch(alice, "l", active) for _ in range(2)]
    for stream in streams:
        next(stream)
    assert watchers.count(alice) == 2
    with pytest.raises(ResourceExhausted, match=r"quota max_watches_per_account \(2\) reached"):
        next(watchers.watch(alice, "l", active))
    next(watchers.watch(bob, "l", active))  # another account's quota is its own
    streams[0].close()
    next(watchers.watch(alice, "l", active))  # a closed stream frees its place
    stopping.set()
    db.dispose()
