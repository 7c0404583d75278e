"""Content-addressed object store on a directory: <root>/sha256/<ab>/<cd>/<hex digest>.

Writes go to a temporary file in the same directory tree, are fsynced and then renamed into place, so a reader (or a
crash) never sees a half-written blob, and writing content that already exists is a no-op. Checkpoints are sets of
files: a manifest [{path, sha256, size_bytes}] in the database names their blobs.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20


class TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"more than {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class StoredFile:
    path: str
    sha256: str
    size_bytes: int

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, d: dict) -> "StoredFile":
        return cls(path=d["path"], sha256=d["sha256"], size_bytes=int(d["size_bytes"]))


class BlobStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / "sha256" / sha256[:2] / sha256[2:4] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def staging_file(self) -> tuple[BinaryIO, Path]:
        """An open temporary file on the store's file system (so commit() is an atomic rename)."""
        fd, name = tempfile.mkstemp(dir=self.root / "tmp", prefix="upload-")
        return os.fdopen(fd, "wb"), Path(name)

    def commit(self, tmp_path: Path, sha256: str) -> Path:
        """Move a fully written, fsynced temporary file into place under its digest."""
        dest = self.path(sha256)
        if dest.exists():
            tmp_path.unlink(missing_ok=True)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp_path, 0o444)  # blobs are immutable; materialized hard links must not be written through
        os.replace(tmp_path, dest)
        return dest

    def stage(self, chunks: Iterable[bytes], max_bytes: int | None = None) -> tuple[Path, str, int]:
        """Write chunks to a fsynced staging file, hashing on the way: (path, sha256, size). The caller commits
        or unlinks it. More than max_bytes raises TooLarge and leaves nothing behind."""
        f, tmp = self.staging_file()
        h = hashlib.sha256()
        size = 0
        try:
            with f:
                for chunk in chunks:
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise TooLarge(max_bytes)
                    h.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, h.hexdigest(), size

    def put_stream(self, chunks: Iterable[bytes]) -> tuple[str, int]:
        tmp, digest, size = self.stage(chunks)
        self.commit(tmp, digest)
        return digest, size

    def put_file(self, src: str | os.PathLike) -> tuple[str, int]:
        with open(src, "rb") as f:
            return self.put_stream(iter(lambda: f.read(CHUNK), b""))

    def put_bytes(self, data: bytes) -> tuple[str, int]:
        return self.put_stream([data])

    def put_tree(self, directory: str | os.PathLike) -> list[StoredFile]:
        """Store every regular file under directory; returns the manifest (paths relative to directory)."""
        directory = Path(directory)
        out = []
        for p in sorted(directory.rglob("*")):
            if p.is_file():
                digest, size = self.put_file(p)
                out.append(StoredFile(path=p.relative_to(directory).as_posix(), sha256=digest, size_bytes=size))
        return out

    def open(self, sha256: str) -> BinaryIO:
        try:
            return open(self.path(sha256), "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"blob {sha256} is missing from the object store at {self.root}") from None

    def read_chunks(self, sha256: str, offset: int = 0, chunk_size: int = CHUNK) -> Iterator[bytes]:
        with self.open(sha256) as f:
            f.seek(offset)
            while chunk := f.read(chunk_size):
                yield chunk

    def materialize(self, files: Iterable[StoredFile], dest: str | os.PathLike) -> Path:
        """Lay the manifest's files out under dest (hard links when possible, else copies)."""
        dest = Path(dest)
        for sf in files:
            target = dest / sf.path
            if not target.resolve().is_relative_to(dest.resolve()):
                raise ValueError(f"manifest path escapes the destination: {sf.path}")
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                target.unlink()
            src = self.path(sf.sha256)
            if not src.is_file():
                raise FileNotFoundError(f"blob {sf.sha256} ({sf.path}) is missing from the object store")
            try:
                os.link(src, target)
            except OSError:
                shutil.copyfile(src, target)
        return dest


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()
