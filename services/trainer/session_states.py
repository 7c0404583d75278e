"""Saved states of Training API sessions: SaveWeights, SaveState, LoadState, the automatic records, and restoring the
sessions an earlier trainer held (services/trainer/sessions.py's module docstring, "Restarts", says when states are
recorded and what a crash loses).

A state is a checkpoint row in the engine's format (services/trainer/engine/checkpoint.py): files = weights/ (an
adapter, or a model directory), state = state/ (engine_state.json, optimizer.pt, rng.pt, gradients.pt when gradients
were pending). The session's row records the newest one (`record`); that record is all a trainer needs to bring the
session back, whatever the engine wrote into the directory (a sharded engine writes its shards there, one record
still names them all).
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import sqlalchemy.exc
from sqlalchemy import func, select

from models.lora import LoraConfig
from services.common import blobrefs, logs, registry
from services.common.blobstore import BlobStore, StoredFile
from services.common.calls import NEVER, Cancellation
from services.common.db import Database
from services.common.errors import InvalidArgument
from services.common.schema import Checkpoint, TrainingSession, new_id, utcnow
from services.trainer.engine.checkpoint import (
    STATE_DIR, WEIGHTS_DIR, CheckpointMismatch, EngineCheckpoint, is_training_state, read_checkpoint,
)
from services.trainer.session_spec import state_mismatch

log = logging.getLogger("trainyard.trainer.sessions")

WEIGHTS_PREFIX = "trainyard://weights/"
STATE_PREFIX = "trainyard://state/"
# Files GetTokenizer sends when the base model has them; a full-parameter SaveWeights copies them (and the
# generation config) next to the weights, so the saved directory is a complete Hugging Face model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
MODEL_EXTRA_FILES = (*TOKENIZER_FILES, "generation_config.json")


def check_name(name: str) -> None:
    """A checkpoint name (Checkpoint.name, 256 characters), checked before a save does anything; NUL and other
    unstorable strings never get here (services/common/request_checks.py)."""
    if len(name) > 256:
        raise InvalidArgument(f"at most 256 characters, got {len(name)}", field="name")


def state_checkpoint_id(path: str, field_name: str) -> str:
    if not path.startswith(STATE_PREFIX) or len(path) == len(STATE_PREFIX):
        raise InvalidArgument(f"must be '{STATE_PREFIX}<checkpoint id>' (the path SaveState returned), got {path!r}",
                              field=field_name)
    return path[len(STATE_PREFIX):]


@dataclass(frozen=True)
class SaveOptions:
    """What a SaveState / SaveWeights keeps on its checkpoint besides the weights (checked by `check`)."""

    ttl_seconds: int | None = None
    user_metadata: tuple[tuple[str, str], ...] = ()

    def check(self) -> None:
        registry.check_ttl(self.ttl_seconds, "ttl_seconds")
        registry.check_user_metadata(dict(self.user_metadata), "user_metadata")

    def expires_at(self) -> datetime | None:
        return None if self.ttl_seconds is None else utcnow() + timedelta(seconds=self.ttl_seconds)


@dataclass(frozen=True)
class Recorded:
    """An open session's row as a restarted trainer reads it: what it was created as and its recorded state."""

    id: str
    account_id: str
    base_model: str
    lora_rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    seed: int
    full_parameter: bool
    created_at: object
    checkpoint_id: str | None  # None: the session as created (its adapter from seed, or every base weight)
    with_optimizer: bool
    next_seq_id: int  # 0: lost before states were recorded (migration 0005); not restorable
    # The checkpoint is one this session wrote (not the from_state it was created from): its pending gradients are
    # the session's.
    own_checkpoint: bool


class SessionStates:
    def __init__(self, db: Database, blobs: BlobStore):
        self.db, self.blobs = db, blobs

    @contextlib.contextmanager
    def laid_out(self, account_id: str, checkpoint_id: str, field_name: str) -> Iterator[EngineCheckpoint]:
        """A training state of this account laid out in a temporary directory (NOT_FOUND for another account's;
        INVALID_ARGUMENT naming field_name for a checkpoint holding no training state)."""
        with self.db.session() as s:
            ckpt = registry.readable_checkpoint(s, account_id, checkpoint_id)  # its own, or a published one
            files, state = list(ckpt.files), list(ckpt.state or [])
        if not is_training_state(f["path"] for f in state):
            raise InvalidArgument(f"checkpoint '{checkpoint_id}' holds weights only, not a training state (save one "
                                  "with SaveState)", field=field_name)
        with tempfile.TemporaryDirectory(prefix="state-", dir=self.blobs.staging_dir()) as tmp:
            root = Path(tmp)
            # Verified against the manifests while laid out: damaged bytes are DataLoss, before anything changes.
            self.blobs.materialize([StoredFile.from_json(f) for f in files], root / WEIGHTS_DIR,
                                   what=f"checkpoint {checkpoint_id}")
            self.blobs.materialize([StoredFile.from_json(f) for f in state], root / STATE_DIR,
                                   what=f"checkpoint {checkpoint_id} state")
            try:
                saved = read_checkpoint(root)
            except CheckpointMismatch as exc:
                raise InvalidArgument(str(exc), field=field_name) from None
            yield saved

    def store(self, root: Path, *, account_id: str, session, name: str, final: bool,
              options: SaveOptions = SaveOptions()) -> tuple[Checkpoint, set[str]]:
        """A checkpoint row of the directory the engine saved under root: weights/ as its files, state/ (when there
        is one) as its state; and the blobs the save created. A failure takes its new blobs back."""
        with self.blobs.saving(blobrefs.checker(self.db)) as save:
            files = [f.to_json() for f in save.put_tree(root / WEIGHTS_DIR)]
            state = [f.to_json() for f in save.put_tree(root / STATE_DIR)] if (root / STATE_DIR).is_dir() else []
            ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, session_id=session.id, name=name,
                              step=session.optim_steps, kind="full" if session.full_parameter else "lora_adapter",
                              base_model=session.base_model,
                              model_path="" if session.full_parameter else session.model_path, files=files,
                              state=state, final=final, metrics={}, created_at=utcnow(),
                              user_metadata=dict(options.user_metadata), expires_at=options.expires_at())
            with self.db.session() as s:
                s.add(ckpt)
        return ckpt, save.created

    def set_version(self, checkpoint_id: str, version_id: str) -> None:
        """A SaveWeights checkpoint names the weight version it published."""
        with self.db.session() as s:
            s.get(Checkpoint, checkpoint_id).weight_version_id = version_id

    def touch(self, session_id: str) -> None:
        """Note a call's arrival on the session's row. Only ListSessions reads it: a database that cannot take it
        now costs that note (the next comes a minute later), never the call."""
        try:
            with self.db.session() as s:
                s.get(TrainingSession, session_id).last_request_at = utcnow()
        except sqlalchemy.exc.SQLAlchemyError:
            log.warning("session %s: its last request time was not recorded", session_id, exc_info=True)

    def latest_checkpoints(self, session_id: str) -> tuple[str, str]:
        """(the session's newest training state's checkpoint id, its newest SaveWeights checkpoint id); "" when
        none (expired ones do not count)."""
        now = utcnow()
        live = (Checkpoint.expires_at.is_(None)) | (Checkpoint.expires_at > now)
        newest = (Checkpoint.created_at.desc(), Checkpoint.id.desc())
        with self.db.session() as s:
            state = s.scalar(select(Checkpoint.id).where(Checkpoint.session_id == session_id, live,
                                                         Checkpoint.weight_version_id == "")
                             .order_by(*newest).limit(1))
            weights = s.scalar(select(Checkpoint.id).where(Checkpoint.session_id == session_id, live,
                                                           Checkpoint.weight_version_id != "")
                               .order_by(*newest).limit(1))
        return state or "", weights or ""

    def rows(self, account_id: str, limit: int, offset: int) -> tuple[list[TrainingSession], int]:
        """A page of the account's session rows, newest first, and how many it has."""
        where = TrainingSession.account_id == account_id
        with self.db.session() as s:
            total = s.scalar(select(func.count()).select_from(TrainingSession).where(where))
            rows = list(s.scalars(select(TrainingSession).where(where)
                                  .order_by(TrainingSession.created_at.desc(), TrainingSession.id.desc())
                                  .limit(limit).offset(offset)))
            s.expunge_all()
        return rows, total

    def drop(self, checkpoint_id: str, created: set[str]) -> None:
        """Remove a checkpoint row no one saw (its save failed after it was written) and the blobs its save created
        that no other row names."""
        with self.db.session() as s:
            s.delete(s.get(Checkpoint, checkpoint_id))
        self.blobs.release(created, blobrefs.checker(self.db))

    def record(self, session_id: str, checkpoint_id: str, next_seq_id: int) -> None:
        """The session's row names checkpoint_id (and its optimizer state) as the state to restore, expecting
        next_seq_id next."""
        with self.db.session() as s:
            row = s.get(TrainingSession, session_id)
            row.state_checkpoint_id, row.state_next_seq_id, row.state_with_optimizer = checkpoint_id, next_seq_id, True

    def open_sessions(self) -> list[str]:
        """The ids of every session not closed, oldest first."""
        with self.db.session() as s:
            return list(s.scalars(select(TrainingSession.id).where(TrainingSession.closed_at.is_(None))
                                  .order_by(TrainingSession.created_at)))

    def recorded(self, session_id: str) -> Recorded | None:
        with self.db.session() as s:
            r = s.get(TrainingSession, session_id)
            if r is None or r.closed_at is not None:
                return None
            writer = s.scalar(select(Checkpoint.session_id).where(Checkpoint.id == r.state_checkpoint_id))
            return Recorded(id=r.id, account_id=r.account_id, base_model=r.base_model, lora_rank=r.lora_rank,
                            lora_alpha=r.lora_alpha, target_modules=tuple(r.target_modules), seed=r.seed,
                            full_parameter=r.full_parameter, created_at=r.created_at,
                            checkpoint_id=r.state_checkpoint_id, with_optimizer=r.state_with_optimizer,
                            next_seq_id=r.state_next_seq_id, own_checkpoint=writer == r.id)


class StateCalls:
    """SessionManager's calls on saved states and its restarts (a part of services/trainer/sessions.py's
    SessionManager, kept here to keep that file readable: it uses the manager's states, sessions, locks, _build,
    get and _in_order)."""

    # -- weights and states ----------------------------------------------------------------------------------------
    def save_weights(self, account_id: str, api_key: str, session_id: str, seq_id: int, name: str,
                     ephemeral: bool = False, answered: int = 0, cancel: Cancellation = NEVER,
                     options: SaveOptions = SaveOptions()) -> tuple[str, str, str]:
        """(checkpoint id, weight version id, path "trainyard://weights/<version id>"). With state_with_weights the
        checkpoint holds the session's state next to the weights and becomes its recorded state. ephemeral: the
        weights are only published, as an ephemeral version (kept while it is among the lineage's few newest ones,
        services/weightsync/store.py); no checkpoint, no recorded state, checkpoint id ""."""
        sess = self.get(account_id, session_id)

        def run():
            check_name(name)
            options.check()
            if ephemeral:
                with tempfile.TemporaryDirectory(prefix="weights-", dir=self.blobs.staging_dir()) as tmp:
                    directory = self._write_weights(sess, Path(tmp), full_model=True)
                    version_id = self.publish(api_key, sess, directory, _publish_kind(sess), ephemeral=True)
                sess.weight_version_id, sess.published_ephemeral = version_id, True
                return "", version_id, WEIGHTS_PREFIX + version_id
            ckpt, version_id = self._store_state(
                sess, name or f"{sess.id}-step{sess.optim_steps}", final=True,
                next_seq_id=sess.next_seq_id + 1 if self.state_with_weights else None,
                publish_kind=_publish_kind(sess), api_key=api_key, options=options)
            sess.weight_version_id = version_id
            return ckpt.id, version_id, WEIGHTS_PREFIX + version_id

        return self._in_order(sess, seq_id, run, answered, cancel)

    def save_state(self, account_id: str, session_id: str, seq_id: int, name: str,
                   answered: int = 0, cancel: Cancellation = NEVER,
                   options: SaveOptions = SaveOptions()) -> tuple[str, str]:
        """(checkpoint id, path "trainyard://state/<checkpoint id>"). The checkpoint's files are the weights (an
        adapter or a model directory, its kind), its state the optimizer and counters (engine/checkpoint.py); it
        becomes the session's recorded state."""
        sess = self.get(account_id, session_id)

        def run():
            check_name(name)
            options.check()
            ckpt, _ = self._store_state(sess, name or f"{sess.id}-state-step{sess.optim_steps}", final=False,
                                        next_seq_id=sess.next_seq_id + 1, options=options)
            return ckpt.id, STATE_PREFIX + ckpt.id

        return self._in_order(sess, seq_id, run, answered, cancel)

    def load_state(self, account_id: str, session_id: str, seq_id: int, path: str, with_optimizer: bool,
                   answered: int = 0, cancel: Cancellation = NEVER):
        """Replace the session's weights (and with_optimizer its AdamW state and step count) with a saved state of
        the same base model, kind and LoRA config; pending gradients are dropped. Without with_optimizer the
        optimizer state stays as it is."""
        sess = self.get(account_id, session_id)

        def run():
            with self.states.laid_out(account_id, state_checkpoint_id(path, "path"), "path") as saved:
                problem = state_mismatch(sess.full_parameter, sess.base_model, sess.lora, saved)
                if problem:
                    raise InvalidArgument(problem, field="path")
                if with_optimizer and not saved.has_optimizer:
                    raise InvalidArgument("the state holds no optimizer state", field="with_optimizer")
                with sess.use():
                    try:  # the engine checks everything before the first copy
                        sess.engine.restore(saved, weights=True, optimizer=with_optimizer)
                    except CheckpointMismatch as exc:
                        raise InvalidArgument(str(exc), field="path") from None
            return sess

        return self._in_order(sess, seq_id, run, answered, cancel)

    def _store_state(self, sess, name: str, *, final: bool, next_seq_id: int | None, publish_kind: str = "",
                     api_key: str = "", options: SaveOptions = SaveOptions()):
        """Save the session as a checkpoint: its state too when next_seq_id is given (then recorded as the
        session's, expecting that seq_id next), its weights only otherwise; with publish_kind its weights are then
        published (SaveWeights: the row comes first, so a database that refuses it publishes nothing, and a refused
        publish leaves no row and no blob only it named). No store lock is held across the publish: the weight-sync
        service saves under that lock too. (checkpoint row, version id or "")."""
        with tempfile.TemporaryDirectory(prefix="state-", dir=self.blobs.staging_dir()) as tmp:
            root = Path(tmp)
            if next_seq_id is None:
                self._write_weights(sess, root, full_model=bool(publish_kind))
            else:
                with sess.use():
                    sess.engine.save(root, base_model=sess.base_model, progress={"next_seq_id": next_seq_id})
                if publish_kind:
                    _copy_model_files(sess, root / WEIGHTS_DIR)
            ckpt, created = self.states.store(root, account_id=sess.account_id, session=sess, name=name, final=final,
                                              options=options)
            version_id = ""
            if publish_kind:
                try:
                    # A transient publishing failure is the publisher's Unavailable: the session's state is intact
                    # and the caller can save again. The version names its checkpoint, so sampling it follows the
                    # checkpoint's life (deleted, expired, published: services/rollout/sampling_core.py).
                    version_id = self.publish(api_key, sess, root / WEIGHTS_DIR, publish_kind,
                                              checkpoint_id=ckpt.id)
                    self.states.set_version(ckpt.id, version_id)
                except BaseException:
                    self.states.drop(ckpt.id, created)
                    raise
        if next_seq_id is not None:
            self.states.record(sess.id, ckpt.id, next_seq_id)
            sess.recorded_seq_id = next_seq_id
        return ckpt, version_id

    @staticmethod
    def _write_weights(sess, root: Path, *, full_model: bool) -> Path:
        """The session's weights saved under root/weights (full_model: a full-parameter session's as a complete
        Hugging Face model directory, for sampling); that directory."""
        with sess.use():
            sess.engine.save_weights(root / WEIGHTS_DIR, base_model=sess.base_model)
        if full_model:
            _copy_model_files(sess, root / WEIGHTS_DIR)
        return root / WEIGHTS_DIR

    def _record_step(self, sess) -> None:
        """The automatic record every state_every_steps optimizer steps, in the OptimStep's turn. Its failure (a
        full disk, the database away) does not fail the step, which is applied: the session keeps its previous
        record and the next interval tries again."""
        try:
            self._store_state(sess, f"{sess.id}-autosave-step{sess.optim_steps}", final=False,
                              next_seq_id=sess.next_seq_id + 1)
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("session %s: its state at optimizer step %d was not recorded", sess.id, sess.optim_steps)

    # -- restarts --------------------------------------------------------------------------------------------------
    def restore_all(self, stopping: threading.Event) -> None:
        """Restore every session an earlier trainer held, oldest first (a background task of the server)."""
        for session_id in self.states.open_sessions():
            if stopping.is_set():
                return
            if session_id in self._to_restore:
                self._restore(session_id)

    def _restore(self, session_id: str):
        """The session loaded again from its recorded state (None when it cannot be: the reason is kept)."""
        with self._restore_lock:
            with self._lock:
                if session_id in self._sessions:
                    return self._sessions[session_id]
            if session_id not in self._to_restore or session_id in self._unrestorable:
                return None
            rec = self.states.recorded(session_id)
            if rec is None or rec.next_seq_id == 0:
                self._unrestorable[session_id] = ("it was closed meanwhile" if rec is None else
                                                  "it was held by a trainer that did not record sessions")
                return None
            try:
                sess = self._rebuild(rec)
            except Exception as exc:  # noqa: BLE001 - the session stays unrestorable, the trainer serves on
                log.exception("session %s could not be restored", session_id)
                self._unrestorable[session_id] = f"{type(exc).__name__}: {exc}"
                return None
            with self._lock:
                self._sessions[sess.id] = sess
            with logs.scope(account_id=sess.account_id, session_id=sess.id):  # restore_all runs outside any call
                log.info("session %s restored at seq_id %d (optimizer step %d)", sess.id, sess.next_seq_id,
                         sess.optim_steps)
            return sess

    def _rebuild(self, rec: Recorded):
        with logs.scope(account_id=rec.account_id, session_id=rec.id), contextlib.ExitStack() as stack:
            saved = None
            if rec.checkpoint_id is not None:
                saved = stack.enter_context(self.states.laid_out(rec.account_id, rec.checkpoint_id, "state"))
            with self.db.session() as s:
                path = registry.require_model(s, rec.account_id, rec.base_model, field="base_model").path
            if saved is not None:
                lora = saved.lora
            elif rec.full_parameter:
                lora = None
            else:
                lora = LoraConfig(rank=rec.lora_rank, alpha=rec.lora_alpha, target_modules=rec.target_modules)
            sess = self._build(rec.id, rec.account_id, rec.base_model, path, lora, saved.seed if saved else rec.seed,
                               saved, "state", optimizer=rec.with_optimizer, gradients=rec.own_checkpoint)
        sess.created_at = rec.created_at
        sess.next_seq_id = sess.recorded_seq_id = rec.next_seq_id
        sess.weight_version_id, sess.restored_at, sess.published_ephemeral = None, rec.next_seq_id, True
        return sess

    def begin_shutdown(self) -> None:
        """SIGTERM: calls waiting for their turn, and calls arriving now, fail with UNAVAILABLE without running (the
        client sends them again after the restart); a call running goes on."""
        self._stopping.set()
        with self._lock:
            sessions = list(self._sessions.values())
        for sess in sessions:
            with sess.cond:
                sess.cond.notify_all()

    def record_all(self) -> None:
        """Record the state of every session that ran a call since its last record (once no call runs: at
        shutdown, after begin_shutdown and the server's grace period). A failed session keeps its last record."""
        with self._lock:
            sessions = list(self._sessions.values())
        for sess in sessions:
            with sess.cond, logs.scope(account_id=sess.account_id, session_id=sess.id):
                sess.cond.wait_for(lambda s=sess: not s.running)  # a call past the grace period finishes first
                if sess.closed or sess.error or sess.next_seq_id == sess.recorded_seq_id:
                    continue
                try:
                    self._store_state(sess, f"{sess.id}-shutdown-step{sess.optim_steps}", final=False,
                                      next_seq_id=sess.next_seq_id)
                except Exception:  # noqa: BLE001 - one session's failure must not cost the others their record
                    log.exception("session %s: not recorded for the restart; it comes back at its last record",
                                  sess.id)
                    continue
                log.info("session %s recorded at seq_id %d (optimizer step %d) for the restart", sess.id,
                         sess.next_seq_id, sess.optim_steps)


def _publish_kind(sess) -> str:
    return "full" if sess.full_parameter else "lora_adapter"


def _copy_model_files(sess, weights_dir: Path) -> None:
    """Next to a full-parameter session's weights, the base model's tokenizer and generation config: a complete
    Hugging Face model directory (a LoRA adapter needs none)."""
    if sess.full_parameter:
        for extra in MODEL_EXTRA_FILES:
            if (Path(sess.model_path) / extra).is_file():
                shutil.copyfile(Path(sess.model_path) / extra, weights_dir / extra)
