"""Dataset uploads: stream to a staging file while hashing, validate every row, then store — or store nothing.

Order of an upload: header -> bytes to a staging file (size-capped, sha256 on the fly) -> full validation -> rows
of another tool's format mapped into a second staging file (dataset_formats.MAPPINGS) -> de-duplication against the account's live datasets -> atomic blob commit -> row insert. Any failure before the row
insert removes the staging file, and a failed insert removes the blob it had just created (BlobStore.saving), so a
rejected upload leaves the store and the database as they were.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from services.common import blobrefs
from services.common.blobstore import BlobStore, TooLarge
from services.common.db import Database
from services.common.errors import FailedPrecondition, InvalidArgument, not_found
from services.common.quotas import check_quota, quota_reached
from services.common.schema import Account, Dataset, Job, new_id, utcnow
from services.scheduler.dataset_formats import (DatasetFormat, Mapping, ValidationResult, mapped_lines, read_rows,
                                                validate_jsonl)


@dataclass
class UploadHeader:
    name: str
    format: DatasetFormat | None
    filename: str


@dataclass
class Staged:
    path: Path
    sha256: str
    size_bytes: int


class DatasetStore:
    def __init__(self, db: Database, blobs: BlobStore, max_bytes: int, max_per_account: int = 1000,
                 max_mb_per_account: int = 51_200):
        self.db = db
        self.blobs = blobs
        self.max_bytes = max_bytes
        self.max_per_account = max_per_account
        self.max_mb_per_account = max_mb_per_account

    # -- upload ------------------------------------------------------------------------------------------------
    def stage(self, chunks: Iterable[bytes]) -> Staged:
        """Write the upload to a staging file; the caller must unlink it (commit() moves it into the store)."""
        try:
            path, digest, size = self.blobs.stage(chunks, max_bytes=self.max_bytes)
        except TooLarge:
            raise InvalidArgument(f"the file is larger than the {self.max_bytes // (1 << 20)} MB limit (raise "
                                  "TRAINYARD_MAX_DATASET_MB on the scheduler to allow it)", field="file") from None
        return Staged(path=path, sha256=digest, size_bytes=size)

    def validate(self, header: UploadHeader, chunks: Iterable[bytes]) -> ValidationResult:
        staged = self.stage(chunks)
        try:
            return validate_jsonl(staged.path, header.format)
        finally:
            staged.path.unlink(missing_ok=True)

    def upload(self, account_id: str, header: UploadHeader, chunks: Iterable[bytes]) -> tuple[Dataset, bool]:
        """(the dataset, whether the account already had it)."""
        dataset, dedup, _ = self.upload_mapped(account_id, header, chunks)
        return dataset, dedup

    def upload_mapped(self, account_id: str, header: UploadHeader,
                      chunks: Iterable[bytes]) -> tuple[Dataset, bool, Mapping | None]:
        """As upload, and the mapping applied to the rows (None: they were in one of our formats)."""
        with self.db.session() as s:  # refused before the bytes travel when the count is already reached
            self._check_quotas(s, account_id, 0)
        staged = self.stage(chunks)
        try:
            result = validate_jsonl(staged.path, header.format)
            if not result.valid:
                raise InvalidArgument(violations=result.errors, truncated=result.truncated)
            if result.mapping is not None:  # the mapped rows are what is stored
                original, staged = staged, self.stage(mapped_lines(staged.path, result.mapping))
                original.path.unlink(missing_ok=True)
            dataset, dedup = self._store(account_id, header, staged, result)
            return dataset, dedup, result.mapping
        finally:
            staged.path.unlink(missing_ok=True)

    def _store(self, account_id: str, header: UploadHeader, staged: Staged,
               result: ValidationResult) -> tuple[Dataset, bool]:
        fmt = result.format.value
        existing = self._live_by_sha(account_id, staged.sha256, fmt)
        if existing is not None:
            return existing, True
        with self.db.session() as s:  # before storing anything; checked again with the row, under the lock
            self._check_quotas(s, account_id, staged.size_bytes)
        name = (header.name or Path(header.filename).stem or "dataset")[:256]
        row = Dataset(id=new_id("ds"), account_id=account_id, name=name,
                      filename=header.filename, format=fmt, num_rows=result.num_rows,
                      size_bytes=staged.size_bytes, sha256=staged.sha256, created_at=utcnow())
        with self.blobs.saving(blobrefs.checker(self.db)) as save:  # a failed insert takes its new blob back
            save.commit(staged.path, staged.sha256)
            try:
                with self.db.session() as s:
                    s.get(Account, account_id, with_for_update=True)  # one account's uploads count one at a time
                    self._check_quotas(s, account_id, staged.size_bytes)
                    s.add(row)
            except IntegrityError:  # the same content raced in from another upload: that one wins
                existing = self._live_by_sha(account_id, staged.sha256, fmt)
                if existing is None:
                    raise
                return existing, True
        return row, False

    def _check_quotas(self, s, account_id: str, adding_bytes: int) -> None:
        """Quotas on the account's live datasets: their count, and their bytes with adding_bytes more."""
        count, size = s.execute(select(func.count(), func.coalesce(func.sum(Dataset.size_bytes), 0)).where(
            Dataset.account_id == account_id, Dataset.deleted_at.is_(None))).one()
        check_quota("max_datasets_per_account", self.max_per_account, count,
                    "the account has that many datasets; delete one first")
        limit = self.max_mb_per_account * (1 << 20)
        if size + adding_bytes > limit:
            raise quota_reached("max_dataset_mb_per_account", self.max_mb_per_account,
                                f"the account's datasets hold {size / (1 << 20):.1f} MB and this one "
                                f"{adding_bytes / (1 << 20):.1f} MB more; delete some first")

    def _live_by_sha(self, account_id: str, sha: str, fmt: str) -> Dataset | None:
        with self.db.session() as s:
            return s.scalar(select(Dataset).where(Dataset.account_id == account_id, Dataset.sha256 == sha,
                                                  Dataset.format == fmt, Dataset.deleted_at.is_(None)))

    # -- reads ---------------------------------------------------------------------------------------------------
    def get(self, account_id: str, dataset_id: str) -> Dataset:
        with self.db.session() as s:
            d = s.get(Dataset, dataset_id) if dataset_id else None
            if d is None or d.account_id != account_id or d.deleted_at is not None:
                raise not_found("dataset", dataset_id)
            return d

    def list(self, account_id: str, offset: int, limit: int) -> tuple[list[Dataset], int | None]:
        with self.db.session() as s:
            rows = list(s.scalars(select(Dataset).where(Dataset.account_id == account_id, Dataset.deleted_at.is_(None))
                                  .order_by(Dataset.created_at.desc(), Dataset.id).offset(offset).limit(limit + 1)))
        more = len(rows) > limit
        return rows[:limit], (offset + limit if more else None)

    def preview(self, account_id: str, dataset_id: str, offset: int, limit: int) -> tuple[Dataset, list[dict]]:
        if offset < 0:
            raise InvalidArgument(f"must be >= 0, got {offset}", field="offset")
        if limit < 0 or limit > 100:
            raise InvalidArgument(f"must be between 0 and 100 (0 = 10), got {limit}", field="limit")
        d = self.get(account_id, dataset_id)
        with self.blobs.open_verified(d.sha256, f"dataset {d.id}", size=d.size_bytes) as f:
            rows = read_rows(f, offset=offset, limit=limit or 10)
        return d, rows

    def path(self, d: Dataset) -> Path:
        return self.blobs.path(d.sha256)

    def delete(self, account_id: str, dataset_id: str) -> Dataset:
        with self.db.session() as s:
            d = s.get(Dataset, dataset_id) if dataset_id else None
            if d is None or d.account_id != account_id or d.deleted_at is not None:
                raise not_found("dataset", dataset_id)
            active = s.scalar(select(Job.id).where(Job.dataset_id == d.id, Job.status.in_(("queued", "running"))))
            if active is not None:
                raise FailedPrecondition(f"dataset '{d.id}' is used by job '{active}', which has not finished; "
                                         "cancel the job or wait for it")
            d.deleted_at = utcnow()  # the blob stays: finished jobs and checkpoints still name it
            return d

