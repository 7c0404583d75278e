"""Client side of weight sync: publish a directory as a version; fetch a version into a directory.

fetch_version resumes a cut transfer from the last verified byte: each chunk is checked against its sha256 before it
is written, and after a failure the next request starts at (path, offset) of the first byte not yet verified.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc

from services.common import metrics
from services.common.blobstore import CHUNK, sha256_file
from services.common.channels import auth_metadata
from trainyard.v1 import common_pb2, weightsync_pb2 as pb, weightsync_pb2_grpc as rpc

# A cut connection or a server restart is worth resuming from the last verified byte; a refusal is not.
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def publish_dir(stub: rpc.WeightSyncServiceStub, api_key: str, *, lineage: str, parent_id: str, kind: int,
                base_model: str, directory: Path, metadata: dict[str, str] | None = None,
                timeout_s: float = 600) -> pb.WeightVersion:
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file())
    specs = [pb.WeightFile(path=p.relative_to(directory).as_posix(), sha256=sha256_file(p), size_bytes=p.stat().st_size)
             for p in files]

    def requests() -> Iterator[pb.PublishVersionRequest]:
        yield pb.PublishVersionRequest(header=pb.PublishVersionHeader(
            lineage=lineage, parent_id=parent_id, kind=kind, base_model=base_model, files=specs,
            metadata=metadata or {}))
        for p, spec in zip(files, specs):
            offset = 0
            with open(p, "rb") as f:
                while data := f.read(CHUNK):
                    yield pb.PublishVersionRequest(chunk=common_pb2.FileChunk(
                        path=spec.path, offset=offset, data=data, sha256=hashlib.sha256(data).hexdigest()))
                    offset += len(data)

    return stub.PublishVersion(requests(), metadata=auth_metadata(api_key), timeout=timeout_s)


def fetch_version(stub: rpc.WeightSyncServiceStub, api_key: str, version: pb.WeightVersion, dest: Path,
                  max_attempts: int = 3, timeout_s: float = 600) -> Path:
    """Download every file of version into dest, verifying chunk and file checksums; resumes after a cut."""
    dest.mkdir(parents=True, exist_ok=True)
    order = [f.path for f in version.files]
    done: dict[str, int] = {p: 0 for p in order}
    for attempt in range(1, max_attempts + 1):
        start = next((p for p in order if done[p] < next(f.size_bytes for f in version.files if f.path == p)), None)
        if start is None:
            break
        try:
            req = pb.FetchVersionRequest(id=version.id, from_path=start, from_offset=done[start])
            for chunk in stub.FetchVersion(req, metadata=auth_metadata(api_key), timeout=timeout_s):
                if hashlib.sha256(chunk.data).hexdigest() != chunk.sha256 or chunk.offset != done[chunk.path]:
                    raise IOError(f"corrupt or out-of-order chunk of {chunk.path} at {chunk.offset}")
                target = dest / chunk.path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "r+b" if target.exists() and chunk.offset else "wb") as f:
                    f.seek(chunk.offset)
                    f.write(chunk.data)
                done[chunk.path] += len(chunk.data)
                metrics.WEIGHT_FETCH_BYTES.labels("files").inc(len(chunk.data))
        except grpc.RpcError as exc:
            if attempt == max_attempts or exc.code() not in RESUMABLE:
                raise
        except IOError:
            if attempt == max_attempts:
                raise
    for f in version.files:
        target = dest / f.path
        if f.size_bytes == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        if sha256_file(target) != f.sha256:
            raise IOError(f"{f.path}: checksum mismatch after transfer")
    return dest


def fetch_delta(stub: rpc.WeightSyncServiceStub, api_key: str, version_id: str, base_version_id: str,
                max_attempts: int = 3, timeout_s: float = 600) -> bytes:
    """The delta base_version_id -> version_id (codec.py's format), each chunk checked against its sha256 and the
    transfer resumed from the last verified byte after a cut connection."""
    data = bytearray()
    size = None
    for attempt in range(1, max_attempts + 1):
        try:
            req = pb.FetchVersionRequest(id=version_id, base_version_id=base_version_id, from_path="delta" if data
                                         else "", from_offset=len(data))
            for chunk in stub.FetchVersion(req, metadata=auth_metadata(api_key), timeout=timeout_s):
                if hashlib.sha256(chunk.data).hexdigest() != chunk.sha256 or chunk.offset != len(data):
                    raise IOError(f"corrupt or out-of-order delta chunk at {chunk.offset}")
                data += chunk.data
                size = chunk.file_size
                metrics.WEIGHT_FETCH_BYTES.labels("delta").inc(len(chunk.data))
            if size is not None and len(data) == size:
                return bytes(data)
            raise IOError(f"delta transfer ended at {len(data)} of {size} bytes")
        except grpc.RpcError as exc:
            if attempt == max_attempts or exc.code() not in RESUMABLE:
                raise
        except IOError:
            if attempt == max_attempts:
                raise
    raise IOError("unreachable")
