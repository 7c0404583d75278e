"""Versioned weight store.

A lineage (for example one Training API session) is a chain of versions 1, 2, 3, ... Publishing names the parent it
was computed from; the parent must be the lineage's latest version, so two writers cannot fork a lineage silently.
Every file of a version is a content-addressed blob with its sha256 and size in the version's row.

Publish ordering: header (declares files and checksums) -> chunks of each file in declared order, offsets contiguous,
each chunk's own sha256 checked on arrival -> every file's sha256 and size checked -> blobs committed -> row inserted
(version = parent's + 1). Anything failing before the insert leaves no version and no partial blob; a failed insert
removes the blobs it had just created (BlobStore.saving).

Fetch ordering: every file (and every cached delta) is read verified against the sha256 its row names, so damage
at rest ends the stream with DATA_LOSS naming the version and file (or the delta) instead of reaching a consumer.

Ephemeral versions (published for sampling only: the Training API's save_weights_and_get_sampling_client) are
versions of the lineage like any other (numbered, parented, followed by lineage deployments, deltas between full
ones), but a lineage keeps only its `max_ephemeral` newest ones: the publish that inserts one deletes, in the same
transaction, the lineage's ephemeral versions older than the max_ephemeral newest (deleted_at set, their files and
cached deltas dropped from the rows), then releases those blobs unless another row still names them.
DeleteEphemeralVersions (the trainer, when the session closes) deletes all of a lineage's. A deleted version's row
stays: GetVersion, FetchVersion and a delta from it answer FAILED_PRECONDITION naming it as replaced; listings and
quotas leave it out. Durable versions never count against max_ephemeral and are never deleted by it.
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from safetensors.torch import load
from sqlalchemy import delete, func, or_, select, tuple_
from sqlalchemy.exc import IntegrityError

from services.common import blobrefs
from services.common.blobstore import BlobStore
from services.common.calls import NEVER, Cancellation
from services.common.db import Database
from services.common.errors import Cancelled, DataLoss, FailedPrecondition, InvalidArgument, not_found
from services.common.quotas import check_quota
from services.common.schema import Account, WeightDelta, WeightLineage, WeightVersion, new_id, utcnow
from services.weightsync.codec import iter_encode_delta

DELTA_FILE = "delta"  # the one file of a delta fetch (codec.py's format)
LINEAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
KINDS = ("lora_adapter", "full")


@dataclass
class FileSpec:
    path: str
    sha256: str
    size_bytes: int


@dataclass
class PublishHeader:
    lineage: str
    parent_id: str
    kind: str
    base_model: str
    files: list[FileSpec]
    metadata: dict[str, str]
    ephemeral: bool = False


@dataclass
class Chunk:
    path: str
    offset: int
    data: bytes
    sha256: str
    file_size: int = 0


def check_header(h: PublishHeader) -> None:
    if not LINEAGE_RE.fullmatch(h.lineage or ""):
        raise InvalidArgument("use 1-128 letters, digits, '.', '_', '-' or '/'", field="header.lineage")
    if h.kind not in KINDS:
        raise InvalidArgument(f"must be one of {', '.join(KINDS)}", field="header.kind")
    if len(h.base_model) > 128:
        raise InvalidArgument("at most 128 characters", field="header.base_model")
    if len(h.metadata) > 64 or any(len(k) > 128 or len(v) > 4096 for k, v in h.metadata.items()):
        raise InvalidArgument("at most 64 entries, keys up to 128 and values up to 4096 characters",
                              field="header.metadata")
    if not h.files:
        raise InvalidArgument("a version needs at least one file", field="header.files")
    # Linear in the header's size: each path is checked against the sets of paths and of their directories so far.
    paths: set[str] = set()
    dirs: set[str] = set()
    for i, f in enumerate(h.files):
        p = PurePosixPath(f.path)
        if (not f.path or len(f.path) > 512 or p.is_absolute() or p.as_posix() != f.path
                or any(part in (".", "..") for part in p.parts)):
            raise InvalidArgument(f"must be a normalized relative path, got {f.path!r}", field=f"header.files[{i}].path")
        parents = [q.as_posix() for q in p.parents][:-1]  # without the root "."
        if f.path in paths or f.path in dirs or any(q in paths for q in parents):
            raise InvalidArgument(f"{f.path!r} repeats or nests inside another file's path",
                                  field=f"header.files[{i}].path")
        if not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
            raise InvalidArgument("must be a lowercase hex sha256", field=f"header.files[{i}].sha256")
        if f.size_bytes < 0:
            raise InvalidArgument("must be >= 0", field=f"header.files[{i}].size_bytes")
        paths.add(f.path)
        dirs.update(parents)


@dataclass(frozen=True)
class VersionQuotas:
    """Weight versions an account may hold: per lineage and in all (WeightSyncSettings declares both)."""

    per_lineage: int = 10_000
    per_account: int = 100_000


class WeightStore:
    def __init__(self, db: Database, blobs: BlobStore, quotas: VersionQuotas = VersionQuotas(), max_ephemeral: int = 4):
        self.db = db
        self.blobs = blobs
        self.quotas = quotas
        self.max_ephemeral = max_ephemeral  # ephemeral versions a lineage keeps (the module docstring)

    def latest(self, account_id: str, lineage: str) -> WeightVersion | None:
        with self.db.session() as s:
            return s.scalar(select(WeightVersion).where(WeightVersion.account_id == account_id,
                                                        WeightVersion.lineage == lineage)
                            .order_by(WeightVersion.version.desc()).limit(1))

    def publish(self, account_id: str, header: PublishHeader, chunks: Iterable[Chunk],
                cancel: Cancellation = NEVER) -> WeightVersion:
        """Stops (CANCELLED, nothing stored) as soon as cancel fires: the client left."""
        check_header(header)
        parent = self._check_parent(account_id, header)
        with self.db.session() as s:  # before the bytes travel; checked again, serialized, when the row goes in
            self._check_quotas(s, account_id, header.lineage)
        staged: list[tuple[FileSpec, Path]] = []
        try:
            it = iter(chunks)
            for spec in header.files:
                if cancel.cancelled:
                    raise Cancelled("the client left during the upload; nothing was stored")
                f, tmp = self.blobs.staging_file()
                staged.append((spec, tmp))
                h = hashlib.sha256()
                received = 0
                with f:
                    while received < spec.size_bytes:
                        chunk = next(it, None)
                        if chunk is None:
                            raise InvalidArgument(f"stream ended after {received} of {spec.size_bytes} bytes of "
                                                  f"{spec.path}", field="chunk")
                        self._check_chunk(chunk, spec, received)
                        h.update(chunk.data)
                        f.write(chunk.data)
                        received += len(chunk.data)
                    f.flush()
                    os.fsync(f.fileno())
                if received != spec.size_bytes or h.hexdigest() != spec.sha256:
                    raise InvalidArgument(f"{spec.path}: received {received} bytes with sha256 {h.hexdigest()}, "
                                          f"header says {spec.size_bytes} bytes with {spec.sha256}", field="chunk")
            extra = next(it, None)
            if extra is not None:
                raise InvalidArgument(f"unexpected data after the declared files (path {extra.path!r})", field="chunk")
            row = WeightVersion(id=new_id("wv"), account_id=account_id, lineage=header.lineage,
                                version=(parent.version + 1) if parent else 1, parent_id=parent.id if parent else "",
                                kind=header.kind, base_model=header.base_model,
                                files=[{"path": f.path, "sha256": f.sha256, "size_bytes": f.size_bytes}
                                       for f in header.files], meta=dict(header.metadata),
                                ephemeral=header.ephemeral, created_at=utcnow())
            with self.blobs.saving(blobrefs.checker(self.db)) as save:  # a lost race takes the new blobs back
                for spec, tmp in staged:
                    save.commit(tmp, spec.sha256)
                released = self._insert(account_id, header, row)
        finally:
            for _, tmp in staged:
                tmp.unlink(missing_ok=True)
        self.blobs.release(released, blobrefs.checker(self.db))
        return row

    def _insert(self, account_id: str, header: PublishHeader, row: WeightVersion) -> set[str]:
        """Insert the version; with an ephemeral one, delete the lineage's ephemeral versions beyond max_ephemeral.
        Returns the blobs the deleted ones named (to release after the commit)."""
        try:
            with self.db.session() as s:
                s.get(Account, account_id, with_for_update=True)  # one account's publishes count one at a time
                self._check_quotas(s, account_id, header.lineage)
                s.add(row)
                s.flush()
                lineage = s.scalar(select(WeightLineage).where(WeightLineage.account_id == account_id,
                                                               WeightLineage.lineage == header.lineage))
                if lineage is None:
                    s.add(WeightLineage(id=new_id("wl"), account_id=account_id, lineage=header.lineage,
                                        kind=header.kind, base_model=header.base_model, current_version_id=row.id,
                                        created_at=row.created_at, updated_at=row.created_at))
                else:
                    lineage.current_version_id, lineage.updated_at = row.id, row.created_at
                if not row.ephemeral:
                    return set()
                beyond = select(WeightVersion.id).where(
                    WeightVersion.account_id == account_id, WeightVersion.lineage == header.lineage,
                    WeightVersion.ephemeral.is_(True), WeightVersion.deleted_at.is_(None),
                ).order_by(WeightVersion.version.desc()).offset(self.max_ephemeral)
                return self._delete_versions(s, list(s.scalars(beyond)))
        except IntegrityError:
            raise FailedPrecondition(f"lineage '{header.lineage}' gained version {row.version} while this one was "
                                     "uploading; publish again on top of the latest version") from None

    @staticmethod
    def _delete_versions(s, version_ids: list[str]) -> set[str]:
        """Mark the versions deleted, dropping their files and the cached deltas from or to them, in session s.
        Returns the blobs those named (release them after the commit: another row may name them too)."""
        if not version_ids:
            return set()
        digests: set[str] = set()
        now = utcnow()
        for v in s.scalars(select(WeightVersion).where(WeightVersion.id.in_(version_ids))):
            digests.update(f["sha256"] for f in v.files)
            v.files, v.deleted_at = [], now
        touching = or_(WeightDelta.base_version_id.in_(version_ids), WeightDelta.version_id.in_(version_ids))
        digests.update(s.scalars(select(WeightDelta.sha256).where(touching)))
        s.execute(delete(WeightDelta).where(touching))
        return digests

    def delete_ephemeral(self, account_id: str, lineage: str) -> int:
        """Delete every ephemeral version of the lineage (its session closed); how many there were. NOT_FOUND for a
        lineage the account does not have."""
        with self.db.session() as s:
            if not lineage or s.scalar(select(WeightLineage.id).where(WeightLineage.account_id == account_id,
                                                                      WeightLineage.lineage == lineage)) is None:
                raise not_found("lineage", lineage)
            ids = list(s.scalars(select(WeightVersion.id).where(
                WeightVersion.account_id == account_id, WeightVersion.lineage == lineage,
                WeightVersion.ephemeral.is_(True), WeightVersion.deleted_at.is_(None))))
            released = self._delete_versions(s, ids)
        self.blobs.release(released, blobrefs.checker(self.db))
        return len(ids)

    def _check_quotas(self, s, account_id: str, lineage: str) -> None:
        in_lineage = s.scalar(select(func.count()).select_from(WeightVersion).where(
            WeightVersion.account_id == account_id, WeightVersion.lineage == lineage,
            WeightVersion.deleted_at.is_(None)))
        check_quota("max_versions_per_lineage", self.quotas.per_lineage, in_lineage,
                    f"lineage '{lineage}' holds that many weight versions")
        in_account = s.scalar(select(func.count()).select_from(WeightVersion).where(
            WeightVersion.account_id == account_id, WeightVersion.deleted_at.is_(None)))
        check_quota("max_versions_per_account", self.quotas.per_account, in_account,
                    "the account holds that many weight versions")

    def _check_parent(self, account_id: str, header: PublishHeader) -> WeightVersion | None:
        parent = self.latest(account_id, header.lineage)
        latest_id = parent.id if parent else ""
        if header.parent_id != latest_id:
            where = f"version {parent.version} ({parent.id})" if parent else "no version yet"
            raise FailedPrecondition(f"stale parent {header.parent_id or '(none)'!r}: lineage '{header.lineage}' is at "
                                     f"{where}")
        return parent

    @staticmethod
    def _check_chunk(chunk: Chunk, spec: FileSpec, received: int) -> None:
        if chunk.path != spec.path:
            raise InvalidArgument(f"expected a chunk of {spec.path}, got {chunk.path!r}", field="chunk.path")
        if chunk.offset != received:
            raise InvalidArgument(f"{spec.path}: expected offset {received}, got {chunk.offset}", field="chunk.offset")
        if hashlib.sha256(chunk.data).hexdigest() != chunk.sha256:
            raise InvalidArgument(f"{spec.path}: chunk at offset {chunk.offset} failed its checksum",
                                  field="chunk.sha256")
        if received + len(chunk.data) > spec.size_bytes:
            raise InvalidArgument(f"{spec.path}: more bytes than the declared {spec.size_bytes}", field="chunk")

    def lineage(self, account_id: str, lineage: str) -> tuple[WeightLineage, WeightVersion, int]:
        """(lineage row, its current version, its newest version number)."""
        with self.db.session() as s:
            row = s.scalar(select(WeightLineage).where(WeightLineage.account_id == account_id,
                                                       WeightLineage.lineage == lineage)) if lineage else None
            if row is None:
                raise not_found("lineage", lineage)
            latest = s.scalar(select(WeightVersion.version).where(WeightVersion.account_id == account_id,
                                                                  WeightVersion.lineage == lineage)
                              .order_by(WeightVersion.version.desc()).limit(1))
            return row, s.get(WeightVersion, row.current_version_id), latest

    def rollback(self, account_id: str, lineage: str, version_id: str) -> tuple[WeightLineage, WeightVersion, int]:
        target = self.get(account_id, version_id)
        if target.lineage != lineage:
            raise InvalidArgument(f"version {version_id} belongs to lineage '{target.lineage}', not '{lineage}'",
                                  field="version_id")
        with self.db.session() as s:
            row = s.scalar(select(WeightLineage).where(WeightLineage.account_id == account_id,
                                                       WeightLineage.lineage == lineage).with_for_update())
            if row is None:
                raise not_found("lineage", lineage)
            row.current_version_id, row.updated_at = target.id, utcnow()
        return self.lineage(account_id, lineage)

    def lineage_markers(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], tuple]:
        """(current version id, updated at) of each (account, lineage) of keys, in one query (watch.py polls it)."""
        with self.db.session() as s:
            rows = s.execute(select(WeightLineage.account_id, WeightLineage.lineage, WeightLineage.current_version_id,
                                    WeightLineage.updated_at)
                             .where(tuple_(WeightLineage.account_id, WeightLineage.lineage).in_(keys))).all()
        return {(r.account_id, r.lineage): (r.current_version_id, r.updated_at) for r in rows}

    def get(self, account_id: str, version_id: str) -> WeightVersion:
        with self.db.session() as s:
            v = s.get(WeightVersion, version_id) if version_id else None
            if v is None or v.account_id != account_id:
                raise not_found("weight version", version_id)
        if v.deleted_at is not None:
            raise FailedPrecondition(
                f"ephemeral weight version '{v.id}' (lineage '{v.lineage}', version {v.version}) was replaced by "
                f"newer ones (a lineage keeps its {self.max_ephemeral} newest ephemeral versions, and none once its "
                "session is closed); save_weights_for_sampler(name) keeps one")
        return v

    def list(self, account_id: str, lineage: str) -> list[WeightVersion]:
        q = select(WeightVersion).where(WeightVersion.account_id == account_id, WeightVersion.deleted_at.is_(None))
        if lineage:
            q = q.where(WeightVersion.lineage == lineage)
        with self.db.session() as s:
            return list(s.scalars(q.order_by(WeightVersion.lineage, WeightVersion.version)))

    def fetch(self, account_id: str, version_id: str, from_path: str = "", from_offset: int = 0,
              base_version_id: str = "") -> Iterator[Chunk]:
        """The version's files (or, with base_version_id, the delta from that version) from (from_path,
        from_offset), each verified against its sha256 as it streams (the bytes before from_offset are read and
        hashed too): a file whose bytes do not match ends the stream with DataLoss after its last chunk. A damaged
        cached delta is dropped (its blob quarantined), so the next request encodes it again."""
        v = self.get(account_id, version_id)
        files = v.files
        if base_version_id:
            files = [self.delta_file(account_id, base_version_id, v)]
        paths = [f["path"] for f in files]
        if from_path and from_path not in paths:
            raise InvalidArgument(f"version {version_id} has no file {from_path!r}", field="from_path")
        if from_offset < 0:
            raise InvalidArgument("must be >= 0", field="from_offset")
        start = paths.index(from_path) if from_path else 0
        for i, f in enumerate(files[start:]):
            offset = from_offset if i == 0 else 0
            if offset > f["size_bytes"]:
                raise InvalidArgument(f"beyond the end of {f['path']} ({f['size_bytes']} bytes)", field="from_offset")
            what = (f"delta from weight version {base_version_id} to {version_id}" if base_version_id
                    else f"weight version {version_id} file {f['path']}")
            try:
                for data in self.blobs.read_verified(f["sha256"], what, offset=offset, size=f["size_bytes"]):
                    yield Chunk(path=f["path"], offset=offset, data=data, sha256=hashlib.sha256(data).hexdigest(),
                                file_size=f["size_bytes"])
                    offset += len(data)
            except DataLoss as exc:
                if base_version_id:
                    self._drop_delta(base_version_id, version_id, f["sha256"], str(exc))
                raise

    def delta_file(self, account_id: str, base_version_id: str, version: WeightVersion) -> dict:
        """The file entry {path: DELTA_FILE, sha256, size_bytes} of the delta base -> version, encoded on first
        request (services/weightsync/codec.py) and kept in the object store."""
        base = self.get(account_id, base_version_id)
        if base.lineage != version.lineage or base.kind != "full" or version.kind != "full":
            raise InvalidArgument("deltas exist between full-weight versions of one lineage; fetch this version "
                                  "without base_version_id", field="base_version_id")
        with self.db.session() as s:
            cached = s.scalar(select(WeightDelta).where(WeightDelta.base_version_id == base.id,
                                                        WeightDelta.version_id == version.id))
        if cached is None:
            old, new = self._tensors(base), self._tensors(version)
            if old.keys() != new.keys() or any(old[k].shape != new[k].shape or old[k].dtype != new[k].dtype
                                               for k in new):
                raise FailedPrecondition(f"versions {base.id} and {version.id} hold different tensors (names, shapes "
                                         "or dtypes); fetch the version whole")
            with self.blobs.saving(blobrefs.checker(self.db)) as save:
                digest, size = save.put_stream(iter_encode_delta(old, new))
                cached = WeightDelta(id=new_id("wd"), base_version_id=base.id, version_id=version.id, sha256=digest,
                                     size_bytes=size, created_at=utcnow())
                try:
                    with self.db.session() as s:
                        s.add(cached)
                except IntegrityError:  # encoded concurrently by another request: same bytes, same blob
                    pass
        return {"path": DELTA_FILE, "sha256": cached.sha256, "size_bytes": cached.size_bytes}

    def _drop_delta(self, base_version_id: str, version_id: str, sha256: str, reason: str) -> None:
        """Forget a cached delta whose blob failed verification and quarantine the blob, so the next request encodes
        the delta again instead of serving the damage forever."""
        with self.blobs.exclusive():
            with self.db.session() as s:
                s.execute(delete(WeightDelta).where(WeightDelta.base_version_id == base_version_id,
                                                    WeightDelta.version_id == version_id,
                                                    WeightDelta.sha256 == sha256))
            if self.blobs.exists(sha256):  # else: missing, e.g. quarantined by fsck already
                self.blobs.move_to_quarantine(sha256, {"reason": reason, "found_by": "weightsync fetch"})

    def _tensors(self, version: WeightVersion) -> dict:
        """The version's tensors by name, each file verified in the one read that loads it (DataLoss names the
        file). Sorted: safetensors hands them out in no fixed order, and the same pair must encode to the same
        delta bytes (a dropped delta encodes again to its old digest)."""
        tensors: dict = {}
        for f in version.files:
            if f["path"].endswith(".safetensors"):
                tensors.update(load(self.blobs.read_bytes(f["sha256"], f"weight version {version.id} file "
                                                                       f"{f['path']}", size=f["size_bytes"])))
        return dict(sorted(tensors.items()))
