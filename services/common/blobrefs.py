"""Which rows name which blobs of the object store (services/common/blobstore.py).

Every column that holds a blob's sha256 is listed here, once: what a failed save may remove (BlobStore.saving) and
what `trainyard admin fsck` calls orphans both come from it. A new column naming blobs must be added here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy import String, cast, or_, select

from services.common.db import Database
from services.common.schema import Checkpoint, Dataset, Evaluator, WeightDelta, WeightVersion

# JSON manifests [{path, sha256, size_bytes}]: (model, column, how fsck names the row's part)
MANIFESTS = ((Checkpoint, "files", "checkpoint"), (Checkpoint, "state", "checkpoint state"),
             (WeightVersion, "files", "weight version"))
# Columns holding one digest (_all names their rows)
DIGESTS = (Dataset, WeightDelta, Evaluator)


@dataclass(frozen=True)
class Reference:
    """One row's use of a blob."""

    what: str  # "checkpoint ckpt_x file adapter_model.safetensors", "dataset ds_y"
    size_bytes: int | None = None  # what the row says the blob holds (manifests only)

    def __str__(self) -> str:
        return self.what


def references(db: Database) -> dict[str, list[Reference]]:
    """Every blob some row names -> the rows naming it."""
    out: dict[str, list[Reference]] = {}
    for digest, ref in _all(db):
        out.setdefault(digest, []).append(ref)
    return out


def referenced(db: Database, digests: set[str]) -> set[str]:
    """Those of digests some row names."""
    if not digests:
        return set()
    found: set[str] = set()
    with db.session() as s:
        for model in DIGESTS:
            found.update(s.scalars(select(model.sha256).where(model.sha256.in_(digests))))
        for model, column, _ in MANIFESTS:
            col = getattr(model, column)
            # A text match narrows the rows; their parsed manifests decide.
            for manifest in s.scalars(select(col).where(or_(*(cast(col, String).contains(d) for d in digests)))):
                found.update(f["sha256"] for f in manifest or [] if f["sha256"] in digests)
    return found


def checker(db: Database) -> Callable[[set[str]], set[str]]:
    """referenced() bound to db, as BlobStore.saving takes it."""
    return lambda digests: referenced(db, digests)


def _all(db: Database) -> Iterator[tuple[str, Reference]]:
    with db.session() as s:
        for d in s.scalars(select(Dataset)):
            yield d.sha256, Reference(f"dataset {d.id} (account {d.account_id})", d.size_bytes)
        for e in s.scalars(select(Evaluator)):
            yield e.sha256, Reference(f"evaluator {e.id} {e.name}@{e.version} (account {e.account_id})", e.size_bytes)
        for w in s.scalars(select(WeightDelta)):
            yield w.sha256, Reference(f"weight delta {w.base_version_id} -> {w.version_id}", w.size_bytes)
        for model, column, kind in MANIFESTS:
            for row_id, account_id, manifest in s.execute(select(model.id, model.account_id, getattr(model, column))):
                for f in manifest or []:
                    yield f["sha256"], Reference(f"{kind} {row_id} (account {account_id}) file {f['path']}",
                                                 int(f["size_bytes"]))
