"""Evaluators as stored, versioned objects owned by an account: upload (validated, then version n+1 of its name),
list, get, lay out for a run (verified against the sha256 its row holds), and "test on N rows".

A reference to an evaluator is its name (the latest version), "name@N" (version N) or a version's id ("ev_..."): the
rules are services/common/evaluator_refs.py's.
Another account's evaluator is "not found", like any object of another account.
"""
from __future__ import annotations

import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, select

from services.common import blobrefs
from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.evaluator_refs import ID_PREFIX, find
from services.common.quotas import check_quota
from services.common.schema import Account, Evaluator, new_id, utcnow
from services.evaluators.package import Package, PackageError, lay_out, read_package
from services.evaluators.sandbox import EvaluatorError, Limits, Sandbox, SandboxUnavailable

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class RowResult:
    row: int  # 1-based position among the rows tested
    completion: str
    reward: float | None
    error: str = ""
    observation: str = ""  # environments: the first observation, reset(row)'s


@dataclass(frozen=True)
class EvaluationReport:
    evaluator: Evaluator | None  # None for an unsaved evaluator's test (test_content)
    results: list[RowResult]
    elapsed_s: float
    stderr_tail: str = ""
    summary: dict = field(default_factory=dict)


def load_evaluator(db: Database, blobs: BlobStore, account_id: str, ref: str, dest: Path) -> Evaluator:
    """Lay out the evaluator's code in dest (evaluator.py and its modules), verified against its row's sha256, for a
    Sandbox(dest) to run; returns its row. NotFound for another account's evaluator; DataLoss for damaged bytes."""
    with db.session() as s:
        row = find(s, account_id, ref)
    data = blobs.read_bytes(row.sha256, f"evaluator {row.id}", size=row.size_bytes)
    lay_out(read_package(data), dest)
    return row


def result_summary(results: Sequence[RowResult]) -> dict:
    rewards = [r.reward for r in results if r.reward is not None]
    return {"num_rows": len(results), "num_ok": len(rewards), "num_errors": len(results) - len(rewards),
            "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "reward_min": min(rewards, default=0.0), "reward_max": max(rewards, default=0.0)}


class EvaluatorStore:
    def __init__(self, db: Database, blobs: BlobStore, limits: Limits = Limits(), max_bytes: int = 1 << 20,
                 max_per_account: int = 1000):
        self.db = db
        self.blobs = blobs
        self.limits = limits
        self.max_bytes = max_bytes
        self.max_per_account = max_per_account

    # -- upload ----------------------------------------------------------------------------------------------------
    def upload(self, account_id: str, name: str, filename: str, content: bytes) -> Evaluator:
        """Check the bytes (size, a safe package, evaluator.py compiles and, loaded in the sandbox, defines reward_fn
        or Environment), store them, and record them as the next version of name."""
        if not NAME.fullmatch(name) or name.startswith(ID_PREFIX):
            raise InvalidArgument(f"{name!r} is not a name: 1-128 letters, digits, '.', '_' or '-', starting with a "
                                  f"letter or digit (and not with '{ID_PREFIX}')", field="name")
        if len(filename) > 256:
            raise InvalidArgument("at most 256 characters", field="filename")
        if not content:
            raise InvalidArgument("empty: upload evaluator.py or a .zip / .tar.gz holding it", field="content")
        with self.db.session() as s:  # refused before the sandbox runs when the count is already reached
            self._check_quota(s, account_id)
        package = self._package(content, "upload evaluator.py or a .zip / .tar.gz holding it")
        kind = self.check_loads(package)
        with self.blobs.saving(blobrefs.checker(self.db)) as save:
            digest, size = save.put_bytes(content)
            with self.db.session() as s:
                s.get(Account, account_id, with_for_update=True)  # one account's uploads number versions in turn
                self._check_quota(s, account_id)
                latest = s.scalar(select(func.max(Evaluator.version)).where(
                    Evaluator.account_id == account_id, Evaluator.name == name)) or 0
                row = Evaluator(id=new_id("ev"), account_id=account_id, name=name, version=latest + 1, kind=kind,
                                filename=filename or "evaluator.py", sha256=digest, size_bytes=size,
                                created_at=utcnow())
                s.add(row)
        return row

    def _check_quota(self, s, account_id: str) -> None:
        count = s.scalar(select(func.count()).select_from(Evaluator).where(Evaluator.account_id == account_id))
        check_quota("max_evaluator_versions_per_account", self.max_per_account, count,
                    "the account holds that many evaluator versions")

    def check_loads(self, package: Package) -> str:
        """Load the package in the sandbox: its kind, or INVALID_ARGUMENT with the Python error."""
        with tempfile.TemporaryDirectory(prefix="trainyard-evaluator-check-") as tmp:
            with Sandbox(lay_out(package, Path(tmp) / "code"), limits=self.limits) as sandbox:
                try:
                    return sandbox.kind
                except SandboxUnavailable as exc:
                    raise FailedPrecondition(str(exc)) from None
                except EvaluatorError as exc:
                    raise InvalidArgument(str(exc), field="content") from None

    # -- reads -----------------------------------------------------------------------------------------------------
    def get(self, account_id: str, ref: str) -> Evaluator:
        with self.db.session() as s:
            return find(s, account_id, ref)

    def list(self, account_id: str, name: str, offset: int, limit: int) -> tuple[list[Evaluator], int | None]:
        """The account's evaluators, every version, by name then newest version first (only name's when given)."""
        query = select(Evaluator).where(Evaluator.account_id == account_id)
        if name:
            query = query.where(Evaluator.name == name)
        with self.db.session() as s:
            rows = list(s.scalars(query.order_by(Evaluator.name, Evaluator.version.desc())
                                  .offset(offset).limit(limit + 1)))
        more = len(rows) > limit
        return rows[:limit], (offset + limit if more else None)

    # -- test on rows ----------------------------------------------------------------------------------------------
    def source(self, account_id: str, ref: str) -> tuple[Evaluator, bytes]:
        """A version's row and stored bytes, verified against its sha256 (DataLoss naming it when damaged)."""
        row = self.get(account_id, ref)
        return row, self.blobs.read_bytes(row.sha256, f"evaluator {row.id}", size=row.size_bytes)

    def test(self, account_id: str, ref: str, items: Sequence[tuple[str, dict]]) -> EvaluationReport:
        """Run the evaluator on (completion, row) items in the sandbox: a reward_fn scores each; an Environment
        starts an episode with reset(row) and takes the completion as its first action. Per-row errors are results,
        not failures."""
        with tempfile.TemporaryDirectory(prefix="trainyard-evaluator-test-") as tmp:
            row = load_evaluator(self.db, self.blobs, account_id, ref, Path(tmp) / "code")
            return self._run(Path(tmp) / "code", items, row,
                             lambda exc: FailedPrecondition(f"evaluator {row.name}@{row.version}: {exc}"))

    def test_content(self, content: bytes, items: Sequence[tuple[str, dict]]) -> EvaluationReport:
        """test() for an evaluator not stored: its bytes are checked as upload checks them (INVALID_ARGUMENT
        naming content), laid out in a temporary directory, run, and kept nowhere."""
        package = self._package(content, "give evaluator.py's source or a .zip / .tar.gz holding it")
        with tempfile.TemporaryDirectory(prefix="trainyard-evaluator-test-") as tmp:
            code = lay_out(package, Path(tmp) / "code")
            return self._run(code, items, None, lambda exc: InvalidArgument(str(exc), field="content"))

    def _package(self, content: bytes, what: str) -> Package:
        """The evaluator's files from uploaded bytes, checked as every entry point checks them (INVALID_ARGUMENT
        naming content): not empty (what to send instead), within max_bytes, a safe package."""
        if not content:
            raise InvalidArgument(f"empty: {what}", field="content")
        if len(content) > self.max_bytes:
            raise InvalidArgument(f"{len(content)} bytes is more than the {self.max_bytes >> 10} KB limit on an "
                                  "evaluator (raise TRAINYARD_MAX_EVALUATOR_KB on the scheduler)", field="content")
        try:
            return read_package(content)
        except PackageError as exc:
            raise InvalidArgument(str(exc), field="content") from None

    def _run(self, code: Path, items: Sequence[tuple[str, dict]], row: Evaluator | None,
             refused: Callable[[EvaluatorError], Exception]) -> EvaluationReport:
        """items through the evaluator laid out in code; one that does not load raises refused(its error)."""
        started = time.perf_counter()
        with Sandbox(code, limits=self.limits) as sandbox:
            try:
                kind = sandbox.kind
            except SandboxUnavailable as exc:
                raise FailedPrecondition(str(exc)) from None
            except EvaluatorError as exc:
                raise refused(exc) from None
            if kind == "reward_fn":
                scores = sandbox.score(items)
                results = [RowResult(i, c, s.value, s.error) for i, ((c, _), s) in enumerate(zip(items, scores), 1)]
            else:
                results = [_episode(sandbox, i, c, r) for i, (c, r) in enumerate(items, 1)]
            tail = sandbox.stderr_tail()
        return EvaluationReport(row, results, time.perf_counter() - started, tail, result_summary(results))


def _episode(sandbox: Sandbox, index: int, completion: str, row: dict) -> RowResult:
    try:
        observation = sandbox.reset(row)
    except EvaluatorError as exc:
        return RowResult(index, completion, None, str(exc))
    try:
        _, reward, _ = sandbox.step(completion)
    except EvaluatorError as exc:
        return RowResult(index, completion, None, str(exc), observation)
    return RowResult(index, completion, reward, "", observation)
