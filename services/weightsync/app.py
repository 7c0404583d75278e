"""The weight-sync process: versioned weights over gRPC (python -m services.weightsync), on the asyncio runner so
that WatchLineage streams hold no thread."""
from __future__ import annotations

import threading

from pydantic import Field

from services.common import calls, metrics
from services.common.aioserver import AsyncServer
from services.common.auth import current_caller
from services.common.blobstore import BlobStore
from services.common.calls import Wait
from services.common.config import TrainyardSettings
from services.common.db import Database
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.common.protoconv import ts
from services.common.streams import split_header
from services.weightsync.store import Chunk, FileSpec, PublishHeader, VersionQuotas, WeightStore
from services.weightsync.watch import LineageWatchers
from trainyard.v1 import common_pb2, weightsync_pb2 as pb, weightsync_pb2_grpc as rpc

KINDS = {pb.WEIGHT_KIND_LORA_ADAPTER: "lora_adapter", pb.WEIGHT_KIND_FULL: "full"}
KINDS_BACK = {v: k for k, v in KINDS.items()}


def version_pb(v) -> pb.WeightVersion:
    return pb.WeightVersion(id=v.id, lineage=v.lineage, version=v.version, parent_id=v.parent_id,
                            kind=KINDS_BACK[v.kind], base_model=v.base_model,
                            files=[pb.WeightFile(path=f["path"], sha256=f["sha256"], size_bytes=f["size_bytes"])
                                   for f in v.files],
                            metadata=v.meta, created_at=ts(v.created_at), ephemeral=v.ephemeral)


def lineage_pb(row, current, latest: int) -> pb.Lineage:
    return pb.Lineage(lineage=row.lineage, kind=KINDS_BACK[row.kind], base_model=row.base_model,
                      current=version_pb(current), latest_version=latest, updated_at=ts(row.updated_at))


def received(chunk: Chunk) -> Chunk:
    metrics.WEIGHTSYNC_BYTES.labels("received").inc(len(chunk.data))
    return chunk


class WeightSyncServicer(rpc.WeightSyncServiceServicer):
    """Served by the asyncio runner (services/common/aioserver.py), so that WatchLineage waits between versions on the
    event loop (services/weightsync/watch.py) rather than in a thread."""

    def __init__(self, store: WeightStore, watchers: LineageWatchers):
        self.store = store
        self.watchers = watchers

    def PublishVersion(self, request_iterator, context):
        h, chunks = split_header(request_iterator)
        header = PublishHeader(lineage=h.lineage, parent_id=h.parent_id, kind=KINDS.get(h.kind, ""),
                               base_model=h.base_model, metadata=dict(h.metadata), ephemeral=h.ephemeral,
                               files=[FileSpec(f.path, f.sha256, f.size_bytes) for f in h.files])
        return version_pb(self.store.publish(current_caller().account_id, header, (
            received(Chunk(path=c.path, offset=c.offset, data=c.data, sha256=c.sha256)) for c in chunks),
            calls.current()))

    def GetVersion(self, request, context):
        return version_pb(self.store.get(current_caller().account_id, request.id))

    def ListVersions(self, request, context):
        rows = self.store.list(current_caller().account_id, request.lineage)
        return pb.ListVersionsResponse(versions=[version_pb(v) for v in rows])

    def GetLineage(self, request, context):
        return lineage_pb(*self.store.lineage(current_caller().account_id, request.lineage))

    def WatchLineage(self, request, context):
        for state in self.watchers.watch(current_caller().account_id, request.lineage, context.is_active):
            yield state if isinstance(state, Wait) else lineage_pb(*state)

    def Rollback(self, request, context):
        return lineage_pb(*self.store.rollback(current_caller().account_id, request.lineage, request.version_id))

    def DeleteEphemeralVersions(self, request, context):
        return pb.DeleteEphemeralVersionsResponse(
            deleted=self.store.delete_ephemeral(current_caller().account_id, request.lineage))

    def FetchVersion(self, request, context):
        for c in self.store.fetch(current_caller().account_id, request.id, request.from_path, request.from_offset,
                                  request.base_version_id):
            metrics.WEIGHTSYNC_BYTES.labels("sent").inc(len(c.data))
            yield common_pb2.FileChunk(path=c.path, offset=c.offset, data=c.data, sha256=c.sha256,
                                       file_size=c.file_size)


class WeightSyncSettings(TrainyardSettings):
    watch_poll_s: float = Field(default=0.2, gt=0, description="How often WatchLineage looks for a new version.")
    # Quotas: weight versions one lineage, and one account in all, may hold (versions are kept: every one stays
    # fetchable and a rollback target). PublishVersion beyond either is RESOURCE_EXHAUSTED, before any byte travels.
    max_versions_per_lineage: int = Field(default=10_000, ge=1)
    max_versions_per_account: int = Field(default=100_000, ge=1)
    # Ephemeral versions (published for sampling only, services/weightsync/store.py) a lineage keeps: publishing
    # another deletes the oldest beyond this many (rows stay as tombstones, files go unless shared).
    max_ephemeral_versions_per_lineage: int = Field(default=4, ge=1)
    # Quota: WatchLineage streams one account may hold open (a rollout holds one per lineage deployment). They wait
    # on the event loop, no thread each; an idle one wakes every watch_heartbeat_s to look at its call.
    max_watches_per_account: int = Field(default=1024, ge=1)
    watch_heartbeat_s: float = Field(default=2.0, gt=0)


def build(settings: WeightSyncSettings) -> Server:
    settings.ensure_dirs()
    db = Database(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    blobs.sweep_staging()  # publishes cut by a killed weight-sync service
    store = WeightStore(db, blobs, VersionQuotas(settings.max_versions_per_lineage, settings.max_versions_per_account),
                        max_ephemeral=settings.max_ephemeral_versions_per_lineage)
    stopping = threading.Event()  # set at shutdown: WatchLineage streams end instead of holding the grace period
    watchers = LineageWatchers(store, settings.watch_poll_s, settings.watch_heartbeat_s, stopping,
                               settings.max_watches_per_account)
    spec = ServiceSpec(
        name="weightsync",
        register=lambda server: rpc.add_WeightSyncServiceServicer_to_server(WeightSyncServicer(store, watchers),
                                                                            server),
        service_names=[pb.DESCRIPTOR.services_by_name["WeightSyncService"].full_name],
        on_shutdown=db.dispose,
        stopping=stopping,
    )
    return service_server(spec, settings, settings.weightsync_port, db, server_cls=AsyncServer)


def main() -> None:
    run_service(WeightSyncSettings, build)


if __name__ == "__main__":
    main()
