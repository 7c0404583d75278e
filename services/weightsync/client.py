"""Client side of weight sync: publish a directory as a version; fetch a version into a directory.

fetch_version resumes a cut transfer from the last verified byte: each chunk is checked against its sha256 before it
is written, each file against the sha256 the version's manifest names as it streams in, and after a failure the next
request starts at (path, offset) of the first byte not yet verified. The server verifies what it reads too: a
damaged stored file ends the stream with DATA_LOSS, which is final, not retried.
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
                timeout_s: float = 600, ephemeral: bool = False) -> pb.WeightVersion:
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file())
    specs = [pb.WeightFile(path=p.relative_to(directory).as_posix(), sha256=sha256_file(p), size_bytes=p.stat().st_size)
             for p in files]

    def requests() -> Iterator[pb.PublishVersionRequest]:
        yield pb.PublishVersionRequest(header=pb.PublishVersionHeader(
            lineage=lineage, parent_id=parent_id, kind=kind, base_model=base_model, files=specs,
            metadata=metadata or {}, ephemeral=ephemeral))
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
    """Download every file of version into dest: each chunk checked on arrival, each file against the sha256 the
    version names as its bytes stream in (no second read); resumes after a cut from the last verified byte. A file
    that arrives whole with other bytes is fetched again; DATA_LOSS (the server's stored copy is damaged) is not."""
    dest.mkdir(parents=True, exist_ok=True)
    sizes = {f.path: f.size_bytes for f in version.files}
    expected = {f.path: f.sha256 for f in version.files}
    order = [f.path for f in version.files]
    done = {p: 0 for p in order}
    hashes = {p: hashlib.sha256() for p in order}
    for attempt in range(1, max_attempts + 1):
        start = next((p for p in order if done[p] < sizes[p]), None)
        if start is None:
            break
        try:
            req = pb.FetchVersionRequest(id=version.id, from_path=start, from_offset=done[start])
            mismatch = None
            for chunk in stub.FetchVersion(req, metadata=auth_metadata(api_key), timeout=timeout_s):
                if mismatch is not None:  # the server read its copy whole and went on: the transfer damaged it
                    break
                if (chunk.path not in done or hashlib.sha256(chunk.data).hexdigest() != chunk.sha256
                        or chunk.offset != done[chunk.path] or done[chunk.path] + len(chunk.data) > sizes[chunk.path]):
                    raise OSError(f"corrupt or out-of-order chunk of {chunk.path} at {chunk.offset}")
                target = dest / chunk.path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "r+b" if target.exists() and chunk.offset else "wb") as f:
                    f.seek(chunk.offset)
                    f.write(chunk.data)
                done[chunk.path] += len(chunk.data)
                hashes[chunk.path].update(chunk.data)
                metrics.WEIGHT_FETCH_BYTES.labels("files").inc(len(chunk.data))
                if done[chunk.path] == sizes[chunk.path] and hashes[chunk.path].hexdigest() != expected[chunk.path]:
                    got = hashes[chunk.path].hexdigest()
                    done[chunk.path], hashes[chunk.path] = 0, hashlib.sha256()  # the next attempt fetches it again
                    # Raised only after the server's verdict on the file: DATA_LOSS, if its stored copy is damaged.
                    mismatch = OSError(f"{chunk.path}: checksum mismatch after transfer (sha256 {got}, the version "
                                       f"names {expected[chunk.path]})")
            if mismatch is not None:
                raise mismatch
        except grpc.RpcError as exc:
            if attempt == max_attempts or exc.code() not in RESUMABLE:
                raise
        except OSError:
            if attempt == max_attempts:
                raise
    missing = [p for p in order if done[p] < sizes[p]]
    if missing:
        raise OSError(f"{missing[0]}: transfer ended at {done[missing[0]]} of {sizes[missing[0]]} bytes")
    for p in order:
        if sizes[p] == 0:
            if hashes[p].hexdigest() != expected[p]:
                raise OSError(f"{p}: checksum mismatch (an empty file, the version names {expected[p]})")
            (dest / p).parent.mkdir(parents=True, exist_ok=True)
            (dest / p).touch()
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
