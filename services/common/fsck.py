"""The object store checked against the names of its blobs and against the rows naming them (`trainyard admin fsck`).

Findings:
- damaged: a blob whose bytes do not hash to its name, or a file under sha256/ that is not where its name (a sha256
  digest) puts it;
- missing: a row names a blob the store does not hold;
- orphan: a blob no row names (left by a process killed between storing blobs and writing the row naming them).
With quarantine, damaged blobs and orphans are moved to <blob_dir>/quarantine/, never deleted, each beside a JSON note
(what was found, when, and the rows that named it). The rows are read before the walk, so a blob stored meanwhile
can only look like an orphan; orphans are therefore checked against the rows again, and moved, under the store's
exclusive lock (BlobStore.exclusive), where no save is between storing a blob and writing the row that names it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from services.common import blobrefs
from services.common.blobstore import CHUNK, BlobStore
from services.common.db import Database


@dataclass(frozen=True)
class Finding:
    kind: str  # "damaged" | "missing" | "orphan"
    name: str  # the blob's name (its sha256), or the file's path under the store for a misplaced file
    detail: str
    rows: tuple[str, ...] = ()  # the rows naming the blob
    path: Path | None = None  # where the file is (damaged and orphan blobs)


@dataclass
class Report:
    blobs: int = 0
    bytes: int = 0
    findings: list[Finding] = field(default_factory=list)
    quarantined: list[Path] = field(default_factory=list)

    def of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    @property
    def damage(self) -> bool:
        """Stored data is lost: a damaged blob or a row naming a missing one (an orphan loses nothing)."""
        return any(f.kind in ("damaged", "missing") for f in self.findings)


def blob_files(store: BlobStore) -> list[Path]:
    return sorted(p for p in (store.root / "sha256").rglob("*") if p.is_file())


def check(store: BlobStore, db: Database, *, quarantine: bool = False,
          progress: Callable[[int], None] | None = None, files: list[Path] | None = None) -> Report:
    """Hash every blob file (progress(bytes) after each chunk), compare with the rows, and with quarantine move
    damaged blobs and orphans aside. files: the blob files (blob_files(store) when None)."""
    refs = blobrefs.references(db)  # before the walk: see the module docstring
    report = Report()
    held: dict[str, Path] = {}  # blobs whose bytes match their name
    damaged: list[Finding] = []
    for p in blob_files(store) if files is None else files:
        digest, size = _hash(p, progress)
        report.blobs += 1
        report.bytes += size
        rows = tuple(str(r) for r in refs.get(p.name, ()))
        if not _in_place(store, p):
            name = p.relative_to(store.root).as_posix()
            damaged.append(Finding("damaged", name, "not where a blob of that name belongs", rows, p))
        elif digest != p.name:
            damaged.append(Finding("damaged", p.name, f"its {size} bytes hash to {digest}", rows, p))
        else:
            held[p.name] = p
    damaged_names = {f.name for f in damaged}
    report.findings += damaged
    report.findings += [Finding("missing", d, "not in the object store", tuple(str(r) for r in rows))
                        for d, rows in sorted(refs.items()) if d not in held and d not in damaged_names]
    orphans = sorted(held.keys() - refs.keys())
    if quarantine:
        with store.exclusive():
            # Named by a row written since the walk, or taken back by a failed save: not orphans after all.
            orphans = sorted(d for d in set(orphans) - blobrefs.referenced(db, set(orphans)) if held[d].exists())
            for f in damaged:
                report.quarantined.append(_move(store, f))
            for d in orphans:
                report.quarantined.append(_move(store, Finding("orphan", d, "no row names it", (), held[d])))
    report.findings += [Finding("orphan", d, "no row names it", (), held[d]) for d in orphans]
    return report


def _hash(p: Path, progress: Callable[[int], None] | None) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(p, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest(), size


def _in_place(store: BlobStore, p: Path) -> bool:
    try:
        return store.path(p.name) == p
    except ValueError:  # the name is not a sha256 digest
        return False


def _move(store: BlobStore, f: Finding) -> Path:
    note = {"found": f.kind, "detail": f.detail, "rows": list(f.rows), "was": str(f.path),
            "at": datetime.now(UTC).isoformat(timespec="seconds")}
    return store.move_to_quarantine(f.path.name, note, src=f.path)
