"""Content-addressed object store on a directory: <root>/sha256/<ab>/<cd>/<hex digest>.

Writes go to a temporary file in the same directory tree, are fsynced and then renamed into place, so a reader (or a
crash) never sees a half-written blob, and writing content that already exists is a no-op. Checkpoints are sets of
files: a manifest [{path, sha256, size_bytes}] in the database names their blobs.

Reads are verified: every read of a stored blob (read_verified, materialize, read_bytes) hashes the bytes as they
stream and raises DataLoss naming the caller's object when they do not hash to the blob's name, or when the blob is
missing. A read that starts at an offset hashes the bytes before it too, so the check always covers the whole blob.

Staging: each process writes its temporary files in a directory of its own, <root>/tmp/proc-<host>-<pid>-<random>/,
holding an exclusive flock on its .lock for as long as it lives. The kernel drops the lock when the process dies
(kill -9 included), so sweep_staging(), which every service writing blobs runs at start-up, removes exactly the
staging directories of dead processes, whichever service they belonged to.

Saves and garbage: a row naming blobs is written after the blobs are committed, so a crash in between leaves blobs no
row names (orphans, which `trainyard admin fsck` finds), never a row naming a missing blob. A save runs inside
saving(): it holds a shared flock on <root>/gc.lock from its first commit until its rows are written, and if it
fails, it takes the lock exclusively (waiting out the saves in flight, which may have reused its blobs) and removes
the blobs it created that no row names. fsck decides and moves orphans under the exclusive lock as well, so neither
ever removes a blob a save is about to name. A save holds the lock only over its own commits and row writes, never
across a call to another service: that service may need the lock exclusively before it answers.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from services.common.errors import DataLoss

CHUNK = 1 << 20
STAGING_PREFIX = "proc-"
LOCK_FILE = "gc.lock"
QUARANTINE_DIR = "quarantine"

log = logging.getLogger("trainyard.blobstore")

# (store root, pid) -> (the process's staging directory, the fd holding its lock). Keyed by pid so a forked child
# makes its own instead of writing into its parent's.
_staging: dict[tuple[Path, int], tuple[Path, int]] = {}
_staging_lock = threading.Lock()


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


class _Puts:
    """Writing files and trees on top of put_stream."""

    def put_stream(self, chunks: Iterable[bytes]) -> tuple[str, int]:
        raise NotImplementedError

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


class BlobStore(_Puts):
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / "sha256" / sha256[:2] / sha256[2:4] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    # -- staging -----------------------------------------------------------------------------------------------------
    def staging_dir(self) -> Path:
        """This process's staging directory (created and locked on first use): temporary files and scratch
        directories that must be on the store's file system, removed by sweep_staging() once the process is gone."""
        key = (self.root.resolve(), os.getpid())
        with _staging_lock:
            if key not in _staging:
                tmp = self.root / "tmp"
                new = Path(tempfile.mkdtemp(dir=tmp, prefix=".new-"))
                fd = os.open(new / ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                # Renamed into the swept namespace only once locked, so a sweep never sees it unlocked.
                final = tmp / f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-{new.name.removeprefix('.new-')}"
                new.rename(final)
                _staging[key] = (final, fd)
            return _staging[key][0]

    def sweep_staging(self) -> list[Path]:
        """Remove the staging directories of processes that have died (nobody holds their lock)."""
        removed = []
        for d in sorted((self.root / "tmp").glob(f"{STAGING_PREFIX}*")):
            try:
                fd = os.open(d / ".lock", os.O_RDWR | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive (this one's included: a second open file conflicts too)
            else:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
            finally:
                os.close(fd)
        if removed:
            log.info("removed the staging files of %d stopped processes from %s", len(removed), self.root / "tmp")
        return removed

    def staging_file(self) -> tuple[BinaryIO, Path]:
        """An open temporary file on the store's file system (so commit() is an atomic rename)."""
        fd, name = tempfile.mkstemp(dir=self.staging_dir(), prefix="upload-")
        return os.fdopen(fd, "wb"), Path(name)

    def commit(self, tmp_path: Path, sha256: str) -> bool:
        """Move a fully written, fsynced temporary file into place under its digest. True when this created the
        blob, False when it existed already (the temporary file is dropped)."""
        dest = self.path(sha256)
        if dest.exists():
            tmp_path.unlink(missing_ok=True)
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp_path, 0o444)  # blobs are immutable; materialized hard links must not be written through
        os.replace(tmp_path, dest)
        return True

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

    # -- saves and garbage -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, referenced: Callable[[set[str]], set[str]]) -> Iterator[Saving]:
        """A save: commit its blobs through the yielded Saving and write the rows naming them inside the block.
        If the block raises, the blobs it created that no row names are removed. referenced(digests) returns
        those of digests some row names (services/common/blobrefs.py)."""
        with open(self.root / LOCK_FILE, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            save = Saving(self)
            try:
                yield save
            except BaseException:
                if save.created:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # saves in flight may have reused these blobs: let them finish
                    self._drop_unreferenced(save.created, referenced)
                raise

    def release(self, digests: set[str], referenced: Callable[[set[str]], set[str]]) -> None:
        """Remove those of digests (a finished save's created blobs) that no row names any more: a save whose rows
        were withdrawn afterwards, e.g. because a call after it failed."""
        if digests:
            with self.exclusive():
                self._drop_unreferenced(digests, referenced)

    def _drop_unreferenced(self, digests: set[str], referenced: Callable[[set[str]], set[str]]) -> None:
        try:
            keep = referenced(digests)
        except Exception:  # the save's own error is the one to report; fsck finds what stays
            log.exception("could not check which of %d blobs of a failed save rows name; leaving them", len(digests))
            return
        for digest in digests - keep:
            self.path(digest).unlink(missing_ok=True)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No save is between committing blobs and writing the rows naming them while this is held."""
        with open(self.root / LOCK_FILE, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    @property
    def quarantine_dir(self) -> Path:
        return self.root / QUARANTINE_DIR

    def move_to_quarantine(self, name: str, note: dict, src: Path | None = None) -> Path:
        """Move the blob name (damaged, or named by no row; src: a file elsewhere under sha256/) to
        <root>/quarantine/, with note beside it as JSON; nothing is deleted. Hold exclusive() so no save reuses the
        blob meanwhile."""
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        dest = self.quarantine_dir / name
        n = 1
        while dest.exists():  # quarantined before, stored again since
            dest = self.quarantine_dir / f"{name}.{n}"
            n += 1
        os.replace(src or self.path(name), dest)
        dest.with_name(dest.name + ".json").write_text(json.dumps(note, indent=1, sort_keys=True) + "\n")
        return dest

    # -- verified reads ----------------------------------------------------------------------------------------------
    def read_verified(self, sha256: str, what: str, *, offset: int = 0, size: int | None = None,
                      chunk_size: int = CHUNK) -> Iterator[bytes]:
        """The blob's bytes from offset, hashed as they stream; after the last chunk, DataLoss naming what (the
        caller's object, e.g. "checkpoint ckpt_x file adapter_model.safetensors") if they are not the bytes the
        name (and size, when given) promise. Consumers act on the bytes only once the iterator is exhausted."""
        h = hashlib.sha256()
        n = 0
        with self._open(sha256, what) as f:
            while n < offset and (data := f.read(min(chunk_size, offset - n))):
                h.update(data)
                n += len(data)
            while data := f.read(chunk_size):
                h.update(data)
                n += len(data)
                yield data
        if h.hexdigest() != sha256 or (size is not None and n != size):
            expected = f"{size} bytes hashing to {sha256}" if size is not None else f"bytes hashing to {sha256}"
            raise DataLoss(f"{what}: blob {sha256} is damaged: read {n} bytes hashing to {h.hexdigest()}, "
                           f"expected {expected}")

    def _open(self, sha256: str, what: str) -> BinaryIO:
        try:
            return open(self.path(sha256), "rb")  # the caller's with-block closes it
        except FileNotFoundError:
            raise DataLoss(f"{what}: blob {sha256} is missing from the object store") from None

    @contextlib.contextmanager
    def open_verified(self, sha256: str, what: str, size: int | None = None) -> Iterator[BinaryIO]:
        """The blob as a binary file object for a reader that may stop early (a preview reading its first rows):
        leaving the block reads the rest, so the whole blob is hashed in that one pass, and raises DataLoss as
        read_verified does. What was read must not be acted on before the block is left."""
        chunks = self.read_verified(sha256, what, size=size)
        reader = io.BufferedReader(_ChunkReader(chunks), buffer_size=CHUNK)
        yield reader
        for _ in chunks:  # the rest, for the hash
            pass

    def read_bytes(self, sha256: str, what: str, size: int | None = None) -> bytes:
        return b"".join(self.read_verified(sha256, what, size=size))

    def materialize(self, files: Iterable[StoredFile], dest: str | os.PathLike, what: str = "") -> Path:
        """Lay the manifest's files out under dest (hard links when possible, else copies), each verified in the
        one pass over its bytes (the copy, or a read of the linked blob); DataLoss names what and the file."""
        dest = Path(dest)
        for sf in files:
            target = dest / sf.path
            if not target.resolve().is_relative_to(dest.resolve()):
                raise ValueError(f"manifest path escapes the destination: {sf.path}")
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                target.unlink()
            name = f"{what} file {sf.path}" if what else sf.path
            try:
                os.link(self.path(sf.sha256), target)
                copy = False
            except FileNotFoundError:
                raise DataLoss(f"{name}: blob {sf.sha256} is missing from the object store") from None
            except OSError:  # another file system, or no hard links: copy
                copy = True
            try:
                with open(target, "wb") if copy else contextlib.nullcontext() as out:
                    for chunk in self.read_verified(sf.sha256, name, size=sf.size_bytes):
                        if copy:
                            out.write(chunk)
            except DataLoss:
                target.unlink(missing_ok=True)
                raise
        return dest


class Saving(_Puts):
    """The blobs of one save (BlobStore.saving): what it commits, and which of those it created."""

    def __init__(self, store: BlobStore):
        self.store = store
        self.created: set[str] = set()

    def commit(self, tmp_path: Path, sha256: str) -> None:
        if self.store.commit(tmp_path, sha256):
            self.created.add(sha256)

    def put_stream(self, chunks: Iterable[bytes]) -> tuple[str, int]:
        tmp, digest, size = self.store.stage(chunks)
        self.commit(tmp, digest)
        return digest, size


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class _ChunkReader(io.RawIOBase):
    """A raw binary stream over an iterator of byte chunks (BlobStore.open_verified)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._pending = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self._pending:
            self._pending = next(self._chunks, b"")
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n
