"""Training API sessions (protos/trainyard/v1/trainer.proto): models, optimizers and strictly ordered calls.

Models (services/trainer/bases.py): every LoRA session on a base model directory is a named adapter (its session
id, with its own rank, alpha, targets and seed) in ONE shared frozen copy of that base; a full-parameter session
trains a private copy. Each session has its own AdamW. A call holds the model's lock with the session's adapter
active only while it computes (per micro-batch for Forward/ForwardBackward), so sessions of any accounts, ranks and
optimizer settings interleave call by call, and a session's numbers do not depend on the others: interleaved
sessions end with bitwise the weights and logprobs each gets alone (float32, CPU, fixed thread count; tested).
Closing a session removes its adapter and frees its optimizer and gradients; the base is dropped with its last
session. Sessions of another account are NOT_FOUND. On a torchrun group (services/trainer/group.py) every session
instead owns a model sharded over the group, and its engine is a GroupEngine: rank 0 runs this module unchanged and
every engine call becomes a command all ranks run.

Ordering: every call carries seq_id (0 = the next one); a session runs seq_id n only after n-1 finished (later ones
wait up to order_timeout_s, so clients may pipeline). A ForwardBackwardStream's turn starts when its header arrives
and its seq_id is the session's next; it keeps the turn until its last datum is in. A call whose client leaves (cancels,
or its deadline passes) while it waits for its turn returns at once (CANCELLED) without using its seq_id, so the
client may send that seq_id again; waiting costs the server nothing once the client is gone.

Failure: a call with bad input fails with INVALID_ARGUMENT naming the field ("data[2].loss_fn_inputs['advantages']")
in its turn, uses up its seq_id and changes nothing: every datum of a unary call is checked before any compute; a
stream checks each datum as it arrives, and a bad datum (or a stream the client cancels, CANCELLED) fails the call
after some of its micro-batches may have run: their gradients are dropped and the gradients held before the call are
restored exactly (services/trainer/engine/forward_backward.py), so the session goes on as if the call never
happened. An OptimStep whose gradient norm is NaN or infinite applies nothing and drops the gradients
(INVALID_ARGUMENT, engine/optim.py). A transient failure to publish weights is UNAVAILABLE and also leaves the
session usable, as does a database failure (a save whose checkpoint row cannot be written publishes nothing: the
row comes first). Any other failure marks the session failed; later calls get FAILED_PRECONDITION rather than run
on state that may be half-updated. Calls on a closed session are FAILED_PRECONDITION.

Restarts: a session outlives the trainer process. Its row records a saved state (a checkpoint in the engine's format:
weights, AdamW state, step count, pending gradients) and the seq_id it expects next from there, and a trainer
restores every open session from its row when it starts (`restore_all`, in the background; a call on a session not
restored yet restores it first), under the same id, so its lineage goes on and deployments following it keep
following. A state is recorded
  - by SaveState (the state it saves), and by SaveWeights when `state_with_weights` (its checkpoint then holds the
    state next to the weights, so every published version is a point the session can come back to);
  - every `state_every_steps` optimizer steps (that OptimStep also writes "<session>-autosave-step<k>");
  - at SIGTERM (`begin_shutdown`, then `record_all` once the calls in flight finished) for each session that ran a
    call since its last record ("<session>-shutdown-step<k>"); calls still waiting for their turn then fail with
    UNAVAILABLE, unrun, and the client sends them again to the restarted trainer.
A session never recorded comes back as it was created (a new adapter from its seed, or its from_state), at seq_id
1. So a graceful restart loses nothing. A crash (kill -9, a lost machine) takes a session back to its last record:
the calls after it are lost, the restored session expects the seq_id after the record again, and the SDK
(trainyard/ordered_calls.py) tells a client whose answered calls were lost. A session that had failed comes back at its
last record, before the failure; one that cannot be restored (its model or state is gone) answers
FAILED_PRECONDITION with the reason.

Gradients accumulate across ForwardBackward calls until OptimStep (which applies them and clears them); LoadState
clears them too. Every session trains through the engine (services/trainer/engine/): the losses and their batch
factor are its losses.py; micro-batching and the exactness of unary vs streamed calls, its forward_backward.py; the
optimizer step, its optim.py; saved states, its checkpoint.py (the format managed jobs use too). LoRA defaults and
request checks: services/trainer/session_spec.py. This module speaks no protocol: the servicer (servicer.py) converts
requests into the plain values and DatumInputs it takes.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy.exc
import torch

from models.lora import LoraConfig, apply_lora, remove_adapter, set_trainable
from services.common import logs, metrics, registry
from services.common.blobstore import BlobStore
from services.common.calls import NEVER, Cancellation
from services.common.db import Database
from services.common.errors import (
    Aborted, Cancelled, FailedPrecondition, InvalidArgument, TrainyardError, Unavailable, not_found,
)
from services.common.quotas import check_quota
from services.common.schema import TrainingSession, new_id, utcnow
from services.trainer.bases import ModelHolder, ModelPool
from services.trainer.datums import DatumInput, check_datum
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.checkpoint import CheckpointMismatch, EngineCheckpoint
from services.trainer.engine.optim import NonFiniteGradient
from services.trainer.engine.forward_backward import LossCall, check_loss_request, run_call
from services.trainer.session_spec import (
    CreateSpec, LoraSpec, check_create_matches_state, resolve_lora,
)
from services.trainer.session_states import (  # noqa: F401 - the prefixes and TOKENIZER_FILES are this API's too
    STATE_PREFIX, TOKENIZER_FILES, WEIGHTS_PREFIX, SessionStates, StateCalls, state_checkpoint_id,
)

log = logging.getLogger("trainyard.trainer.sessions")


@dataclass
class Session:
    id: str
    account_id: str
    base_model: str
    model_path: str
    holder: ModelHolder
    engine: TrainingEngine  # the session's trainable parameters, LoRA config and AdamW over the holder's model
    created_at: object
    from_state: str = ""
    num_trainable: int = 0
    next_seq_id: int = 1
    error: str = ""
    closed: bool = False
    # The newest version this session published to its lineage (the parent of its next); None when not known here
    # (a restored session): the lineage's newest, asked of the weight-sync service when it publishes.
    weight_version_id: str | None = ""
    # It may have published ephemeral versions (SaveWeights ephemeral; a restored session: not known), which its
    # close deletes.
    published_ephemeral: bool = False
    recorded_seq_id: int = 1  # next_seq_id as of the session's recorded state: a later one means unrecorded calls
    compute_s: float = 0.0  # compute of the calls since the last OptimStep (trainyard_training_step_seconds)
    restored_at: int = 0  # the seq_id a restarted trainer restored the session at (0: never restored)
    running: bool = False  # a call holds the turn (next_seq_id) and is computing
    last_request_at: object = None  # the newest call's arrival; its row's copy is written at most every TOUCH_S
    touched: float = -math.inf  # time.monotonic() of that write
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def lora(self) -> LoraConfig | None:  # None: full-parameter
        return self.engine.lora

    @property
    def seed(self) -> int:
        return self.engine.seed

    @property
    def optim_steps(self) -> int:
        return self.engine.steps

    @property
    def full_parameter(self) -> bool:
        return self.lora is None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.engine.params

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self.engine.optimizer

    def use(self):
        """The model with this session's weights active, held exclusively."""
        return self.holder.use(None if self.full_parameter else self.id)


@dataclass
class SessionInfo:
    """What GetSession reports of a session (the servicer turns it into trainer_pb2.Session)."""

    id: str
    base_model: str
    lora_rank: int
    lora_alpha: float
    target_modules: list[str]
    closed: bool
    error: str
    full_parameter: bool
    lineage: str
    created_at: object
    next_seq_id: int = 0
    optim_steps: int = 0
    num_trainable_parameters: int = 0
    vocab_size: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    architecture: str = ""
    last_request_at: object = None
    last_state_checkpoint_id: str = ""
    last_weights_checkpoint_id: str = ""


# How often a session's row learns of its latest call (TrainingSession.last_request_at; ListSessions reads it).
TOUCH_S = 60.0
MAX_LIST = 1000
# A Training API session's AdamW defaults (Tinker's): what OptimStep applies for the fields a request leaves unset.
SESSION_ADAMW = AdamW(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


class SessionManager(StateCalls):
    def __init__(self, db: Database, blobs: BlobStore, publish, order_timeout_s: float = 600.0,
                 deterministic: bool = False, micro_batch_tokens: int = 2048, device: str | None = None,
                 state_every_steps: int = 0, state_with_weights: bool = False, max_sessions_per_account: int = 64,
                 group=None, drop_ephemeral=None):
        self.db = db
        self.blobs = blobs
        self.states = SessionStates(db, blobs)
        # (api_key, session, directory, kind "lora_adapter" | "full") -> version id; Unavailable when it cannot
        self.publish = publish
        # (api_key, session) -> None: delete the ephemeral versions the session published (at its close); None: the
        # sessions publish nowhere that keeps them.
        self.drop_ephemeral = drop_ephemeral
        self.order_timeout_s = order_timeout_s
        # Batch-invariant numerics (services/trainer/engine/forward_backward.py): logprobs bitwise the deterministic
        # rollout's.
        self.deterministic = deterministic
        self.micro_batch_tokens = micro_batch_tokens
        # When states are recorded besides SaveState and shutdown (the module docstring; the trainer's settings).
        self.state_every_steps, self.state_with_weights = state_every_steps, state_with_weights
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.pool = ModelPool(self.device)
        # The torchrun group whose engines the sessions use (services/trainer/group.py's EngineGroup: each session
        # then owns its sharded model); None: this process holds the models (the shared bases of ModelPool).
        self.group = group
        self.max_sessions_per_account = max_sessions_per_account
        self._sessions: dict[str, Session] = {}
        self._creating: Counter[str] = Counter()  # sessions being built, per account (they count against the quota)
        self._lock = threading.Lock()
        # Sessions an earlier trainer held (open rows now): restored by restore_all or on first use. Sessions this
        # manager creates are never among them.
        self._to_restore = set(self.states.open_sessions())
        self._unrestorable: dict[str, str] = {}  # session id -> why it could not be restored
        self._restore_lock = threading.Lock()
        self._stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def create(self, account_id: str, spec: CreateSpec) -> Session:
        if spec.full_parameter and spec.lora is not None and not spec.from_state:
            raise InvalidArgument("must be unset for a full-parameter session", field="lora")
        if spec.with_optimizer and not spec.from_state:
            raise InvalidArgument("only applies with from_state", field="with_optimizer")
        from_ckpt = state_checkpoint_id(spec.from_state, "from_state") if spec.from_state else None
        with self._lock:  # room for one more open session of the account, held while it is built
            open_now = sum(1 for sess in self._sessions.values() if sess.account_id == account_id)
            check_quota("max_sessions_per_account", self.max_sessions_per_account,
                        open_now + self._creating[account_id],
                        "the account has that many open training sessions on this trainer; close one first")
            self._creating[account_id] += 1
        try:
            return self._create(account_id, spec, from_ckpt)
        finally:
            with self._lock:
                self._creating[account_id] -= 1

    def _create(self, account_id: str, spec: CreateSpec, from_ckpt: str | None) -> Session:
        with contextlib.ExitStack() as stack:
            saved = None
            if from_ckpt:
                saved = stack.enter_context(self.states.laid_out(account_id, from_ckpt, "from_state"))
                if spec.with_optimizer and not saved.has_optimizer:
                    raise InvalidArgument("the state holds no optimizer state", field="with_optimizer")
            base_name = saved.base_model if saved else spec.base_model
            with self.db.session() as s:
                model_row = registry.require_model(s, account_id, base_name,
                                                   field="from_state" if saved else "base_model")
                name, path = model_row.name, model_row.path
            if saved:
                check_create_matches_state(spec, saved, path)
                lora = saved.lora
            else:
                lora = None if spec.full_parameter else resolve_lora(spec.lora or LoraSpec(), path)
            seed = saved.seed if saved else spec.seed
            sess = self._build(new_id("sess"), account_id, name, path, lora, seed, saved, "from_state",
                               optimizer=spec.with_optimizer)
        sess.from_state = spec.from_state
        # Recorded as created: a restarted trainer builds it again from its seed, or from its from_state.
        row = TrainingSession(id=sess.id, account_id=account_id, base_model=name,
                              lora_rank=lora.rank if lora else 0, lora_alpha=lora.alpha if lora else 0.0,
                              target_modules=list(lora.target_modules) if lora else [], seed=seed,
                              full_parameter=lora is None, from_state=spec.from_state, created_at=sess.created_at,
                              state_checkpoint_id=from_ckpt, state_with_optimizer=spec.with_optimizer or not from_ckpt,
                              state_next_seq_id=1)
        try:
            with self.db.session() as s:
                s.add(row)
        except BaseException:
            self._free(sess)
            raise
        with self._lock:
            self._sessions[sess.id] = sess
        return sess

    def _build(self, sess_id: str, account_id: str, name: str, path: str, lora: LoraConfig | None, seed: int,
               saved: EngineCheckpoint | None, field_name: str, *, optimizer: bool,
               gradients: bool = False) -> Session:
        """Load (or share) the model, add the session's adapter or make every weight trainable, restore a saved
        state (its optimizer state and step count with optimizer, its pending gradients with gradients); on any
        failure nothing stays behind. A state that does not fit is INVALID_ARGUMENT naming field_name."""
        if self.group is not None:
            return self._build_on_group(sess_id, account_id, name, path, lora, seed, saved, field_name,
                                        optimizer=optimizer, gradients=gradients)
        if lora is None:
            model = None
            if saved is not None:  # the state's weights are the session's model
                try:
                    model = self.pool.load(str(saved.weights_dir), full_parameter=True)
                except ValueError as exc:
                    raise InvalidArgument(str(exc), field=field_name) from None
            holder = self.pool.private(path, sess_id, model)
            params = set_trainable(holder.model, "full")
        else:
            holder = self.pool.acquire_base(path, sess_id)
            try:
                with holder.lock:
                    params = apply_lora(holder.model, lora, adapter_name=sess_id, seed=seed)
            except BaseException:
                self.pool.release(holder, sess_id)
                raise
        # Every OptimStep sets the hyperparameters it applies; these only initialize the optimizer.
        engine = TrainingEngine(holder.model, params, optimizer=SESSION_ADAMW, device=self.device, lora=lora,
                                adapter=sess_id, seed=seed)
        sess = Session(id=sess_id, account_id=account_id, base_model=name, model_path=path, holder=holder,
                       engine=engine, created_at=utcnow(), num_trainable=engine.num_trainable)
        if saved is not None:
            try:
                with sess.use():  # a full-parameter model was built from the state's weights
                    engine.restore(saved, weights=lora is not None, optimizer=optimizer, gradients=gradients)
            except CheckpointMismatch as exc:
                self._free(sess)
                raise InvalidArgument(str(exc), field=field_name) from None
            except BaseException:
                self._free(sess)
                raise
        return sess

    def _build_on_group(self, sess_id: str, account_id: str, name: str, path: str, lora: LoraConfig | None,
                        seed: int, saved: EngineCheckpoint | None, field_name: str, *, optimizer: bool,
                        gradients: bool) -> Session:
        """_build on the group: the session's own sharded model on every rank (a full-parameter one from the state's
        weights, as on one process), its state restored there; held by rank 0's engine, not by the pool's bases."""
        model_dir = saved.weights_dir if saved is not None and lora is None else path
        try:
            engine = self.group.create(sess_id, model_dir, lora=lora, seed=seed, saved=saved,
                                       weights=lora is not None, optimizer=optimizer, gradients=gradients)
        except CheckpointMismatch as exc:
            raise InvalidArgument(str(exc), field=field_name) from None
        holder = self.pool.private(path, sess_id, engine.model)
        return Session(id=sess_id, account_id=account_id, base_model=name, model_path=path, holder=holder,
                       engine=engine, created_at=utcnow(), num_trainable=engine.num_trainable)

    def get(self, account_id: str, session_id: str) -> Session:
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is not None and sess.account_id == account_id:
            return sess
        row = self._row(account_id, session_id)
        if row.closed_at is not None:
            raise FailedPrecondition(f"session '{session_id}' is closed")
        sess = self._restore(session_id)
        if sess is None:
            raise FailedPrecondition(f"session '{session_id}' was lost when the trainer restarted "
                                     f"({self._lost_reason(session_id)}); create a new session (from a SaveState path "
                                     "to continue)")
        return sess

    def _lost_reason(self, session_id: str) -> str:
        return self._unrestorable.get(session_id, "this trainer does not hold it")

    def _row(self, account_id: str, session_id: str) -> TrainingSession:
        with self.db.session() as s:
            row = s.get(TrainingSession, session_id) if session_id else None
            if row is None or row.account_id != account_id:
                raise not_found("session", session_id)
            s.expunge(row)
        return row

    def describe(self, account_id: str, session_id: str) -> SessionInfo:
        """GetSession: a session as it is now (restored first if a restarted trainer has not yet); a closed one, or
        one that could not be restored, from its row."""
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is not None and sess.account_id == account_id:
            return self.info(sess)
        row = self._row(account_id, session_id)
        if row.closed_at is None and (sess := self._restore(session_id)) is not None:
            return self.info(sess)
        return self._row_info(row, "" if row.closed_at is not None else
                              f"lost when the trainer restarted ({self._lost_reason(session_id)})")

    def _row_info(self, row: TrainingSession, error: str) -> SessionInfo:
        state, weights = self.states.latest_checkpoints(row.id)
        return SessionInfo(id=row.id, base_model=row.base_model, lora_rank=row.lora_rank, lora_alpha=row.lora_alpha,
                           target_modules=list(row.target_modules), closed=row.closed_at is not None, error=error,
                           full_parameter=row.full_parameter, lineage=row.id, created_at=row.created_at,
                           last_request_at=row.last_request_at or row.created_at, last_state_checkpoint_id=state,
                           last_weights_checkpoint_id=weights)

    def list_sessions(self, account_id: str, limit: int, offset: int) -> tuple[list[SessionInfo], int]:
        """ListSessions: a page of the account's sessions, newest first, as their rows (and the live ones' latest
        calls) say -- no session is restored or loaded to list it."""
        if not 0 <= limit <= MAX_LIST:
            raise InvalidArgument(f"must be between 0 and {MAX_LIST}", field="limit")
        if offset < 0:
            raise InvalidArgument("must not be negative", field="offset")
        rows, total = self.states.rows(account_id, limit or 20, offset)
        out = []
        for row in rows:
            info = self._row_info(row, "")
            with self._lock:
                live = self._sessions.get(row.id)
            if live is not None:
                info.next_seq_id, info.optim_steps, info.error = live.next_seq_id, live.optim_steps, live.error
                info.last_request_at = live.last_request_at or info.last_request_at
            out.append(info)
        return out, total

    def close(self, account_id: str, session_id: str, api_key: str = "") -> SessionInfo:
        """Free the session; it is never restored again. One a restarted trainer has not restored (or could not)
        closes without being loaded. The ephemeral weight versions it published are deleted (with api_key, the
        caller's, as they were published)."""
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is None or sess.account_id != account_id:
            if self._row(account_id, session_id).closed_at is not None:
                raise FailedPrecondition(f"session '{session_id}' is closed")
            with self._restore_lock:  # not restored meanwhile, and not from now on
                with self._lock:
                    sess = self._sessions.get(session_id)
                if sess is None:
                    self._to_restore.discard(session_id)
                    self._unrestorable.pop(session_id, None)
                    self._mark_closed(session_id)
                    self._drop_ephemeral(api_key, session_id)
                    return self.describe(account_id, session_id)
        with sess.cond:  # after the running call, if any; waiting ones then see closed
            sess.cond.wait_for(lambda: not sess.running)
            if sess.closed:
                raise FailedPrecondition(f"session '{session_id}' is closed")
            sess.closed = True
            sess.cond.notify_all()
        with self._lock:
            self._sessions.pop(session_id, None)
        self._free(sess)
        self._mark_closed(session_id)
        if sess.published_ephemeral:
            self._drop_ephemeral(api_key, session_id)
        return self.info(sess)

    def _drop_ephemeral(self, api_key: str, session_id: str) -> None:
        """After the close: a failure (the weight-sync service away) leaves at most its lineage's few newest
        ephemeral versions, which is logged, not the close's failure."""
        if self.drop_ephemeral is None:
            return
        try:
            self.drop_ephemeral(api_key, session_id)
        except TrainyardError as exc:
            log.warning("session %s: its ephemeral weight versions were not deleted: %s", session_id, exc)

    def _mark_closed(self, session_id: str) -> None:
        with self.db.session() as s:
            s.get(TrainingSession, session_id).closed_at = utcnow()

    def _free(self, sess: Session) -> None:
        if not sess.full_parameter and self.group is None:
            with sess.holder.lock:
                remove_adapter(sess.holder.model, sess.id)
        self.pool.release(sess.holder, sess.id)
        sess.engine.release()

    # -- ordered calls ---------------------------------------------------------------------------------------------
    def _in_order(self, sess: Session, seq_id: int, fn, answered: int = 0, cancel: Cancellation = NEVER):
        """fn() in seq_id's turn, computed outside sess.cond while holding the turn (`running`), so a waiting call
        whose client leaves (cancel) returns at once, its seq_id unused. answered: the highest seq_id whose answer the
        client has (0: not told); one the session has not reached means those calls were lost with a restart, so the
        call fails at once (ABORTED) instead of waiting for seq_ids the client will not send again."""
        logs.annotate(session_id=sess.id)

        def wake() -> None:
            with sess.cond:
                sess.cond.notify_all()

        cancel.add_callback(wake)
        with sess.cond:
            if answered >= sess.next_seq_id:
                raise Aborted(f"session '{sess.id}' is at seq_id {sess.next_seq_id} (optimizer step "
                              f"{sess.optim_steps}) but the client has answers up to seq_id {answered}: a trainer "
                              "restart took the session back to its last recorded state and those calls were lost; "
                              f"go on at seq_id {sess.next_seq_id}")
            first_free = sess.next_seq_id + sess.running
            if seq_id == 0:
                seq_id = first_free
            if seq_id < first_free:
                raise InvalidArgument(f"seq_id {seq_id} was already used; the session expects {first_free}",
                                      field="seq_id")
            turn = sess.cond.wait_for(lambda: (sess.next_seq_id == seq_id and not sess.running) or sess.closed
                                      or cancel.cancelled or self._stopping.is_set(), self.order_timeout_s)
            if cancel.cancelled:
                raise Cancelled(f"the client left before seq_id {seq_id}'s turn; the seq_id was not used")
            if not turn:
                lost = (f" (the trainer restarted and restored this session at seq_id {sess.restored_at}: the "
                        "calls after its last recorded state were lost)" if sess.restored_at else "")
                raise FailedPrecondition(f"seq_id {seq_id} waited {self.order_timeout_s:.0f}s for seq_id "
                                         f"{sess.next_seq_id}, which never arrived{lost}")
            if sess.closed:
                raise FailedPrecondition(f"session '{sess.id}' is closed")
            if self._stopping.is_set():
                raise Unavailable(f"the trainer is restarting; seq_id {seq_id} did not run: send it again (the "
                                  f"session continues at seq_id {sess.next_seq_id} after the restart)")
            sess.running = True
        try:
            self._touch(sess)
            if sess.error:
                raise FailedPrecondition(f"session '{sess.id}' failed earlier ({sess.error}); create a new one")
            return fn()
        except (TrainyardError, sqlalchemy.exc.SQLAlchemyError):
            raise  # bad input, or the database failed (the model is only read or written before it): goes on
        except Exception as exc:
            sess.error = f"seq_id {seq_id}: {type(exc).__name__}: {exc}"
            raise
        finally:
            with sess.cond:
                sess.next_seq_id = seq_id + 1
                sess.running = False
                sess.cond.notify_all()

    def _touch(self, sess: Session) -> None:
        """Note the call's arrival (in the session's turn); the row hears of it at most every TOUCH_S."""
        sess.last_request_at = utcnow()
        if time.monotonic() - sess.touched >= TOUCH_S:
            sess.touched = time.monotonic()
            self.states.touch(sess.id)

    def _loss_call(self, sess: Session, loss_fn: str, config: dict, micro_batch_tokens: int, backward: bool,
                   prefix: str = "") -> LossCall:
        req = check_loss_request(loss_fn, config, micro_batch_tokens, self.micro_batch_tokens, prefix)
        return sess.engine.loss_call(req, backward=backward, deterministic=self.deterministic, lock=sess.use)

    def forward(self, account_id: str, session_id: str, seq_id: int, data: Iterable[DatumInput], loss_fn: str,
                loss_fn_config: dict[str, float], backward: bool, micro_batch_tokens: int = 0,
                streamed: bool = False, answered: int = 0,
                cancel: Cancellation = NEVER) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Forward (backward=False) or ForwardBackward: (per-datum logprobs, metrics). data is consumed in the
        call's turn: all of it checked before any compute, or, streamed (ForwardBackwardStream, whose loss settings
        are its header's), each datum as it arrives, its micro-batches running as soon as they are complete."""
        sess = self.get(account_id, session_id)

        def run():
            call = self._loss_call(sess, loss_fn, loss_fn_config, micro_batch_tokens, backward,
                                   prefix="header." if streamed else "")
            args = sess.holder.model.args
            datums = (check_datum(d, i, call.req.loss_fn, args.vocab_size, args.max_position_embeddings)
                      for i, d in enumerate(data))
            start = time.perf_counter()
            outputs, out_metrics = run_call(call, datums if streamed else list(datums))
            if backward:  # a streamed call's time includes waiting for its datums
                sess.compute_s += time.perf_counter() - start
                metrics.TRAINING_TOKENS.labels("session").inc(sum(o.shape[0] for o in outputs))
            return outputs, out_metrics

        return self._in_order(sess, seq_id, run, answered, cancel)

    def optim_step(self, account_id: str, session_id: str, seq_id: int, adam: AdamW, answered: int = 0,
                   cancel: Cancellation = NEVER) -> tuple[int, dict]:
        sess = self.get(account_id, session_id)
        checks = (("learning_rate", 0 < adam.learning_rate < 1, "> 0 and < 1"),
                  ("beta1", 0 <= adam.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= adam.beta2 < 1, "in [0, 1)"),
                  ("eps", adam.eps >= 0, ">= 0"), ("weight_decay", adam.weight_decay >= 0, ">= 0"),
                  ("grad_clip_norm", adam.grad_clip_norm >= 0, ">= 0 (0 = no clipping)"))

        def run():
            for name, ok, rule in checks:
                value = getattr(adam, name)
                if not (ok and math.isfinite(value)):
                    raise InvalidArgument(f"must be {rule}, got {value}", field=f"adam.{name}")
            start = time.perf_counter()
            with sess.use():
                try:
                    norm = float(sess.engine.step(adam))  # float() syncs
                except NonFiniteGradient as exc:
                    raise InvalidArgument(f"{exc}; the ForwardBackward calls since the last step overflowed (e.g. "
                                          "weights or advantages too large); the session goes on") from None
            metrics.TRAINING_STEP_SECONDS.labels("session").observe(sess.compute_s + time.perf_counter() - start)
            sess.compute_s = 0.0
            if self.state_every_steps and sess.optim_steps % self.state_every_steps == 0:
                self._record_step(sess)
            return sess.optim_steps, {"grad_norm": norm, "learning_rate": adam.learning_rate}

        return self._in_order(sess, seq_id, run, answered, cancel)

    # -- model facts -----------------------------------------------------------------------------------------------
    def tokenizer_files(self, account_id: str, session_id: str) -> list[Path]:
        sess = self.get(account_id, session_id)
        return [Path(sess.model_path) / n for n in TOKENIZER_FILES if (Path(sess.model_path) / n).is_file()]

    def info(self, sess: Session) -> SessionInfo:
        args = sess.holder.model.args
        state, weights = self.states.latest_checkpoints(sess.id)
        lora = sess.lora
        return SessionInfo(id=sess.id, base_model=sess.base_model, lora_rank=lora.rank if lora else 0,
                           lora_alpha=lora.alpha if lora else 0.0,
                           target_modules=list(lora.target_modules) if lora else [], next_seq_id=sess.next_seq_id,
                           optim_steps=sess.optim_steps, closed=sess.closed, error=sess.error,
                           num_trainable_parameters=sess.num_trainable, full_parameter=sess.full_parameter,
                           lineage=sess.id, vocab_size=args.vocab_size, num_layers=args.num_layers,
                           hidden_size=args.hidden_size, architecture=args.architecture, created_at=sess.created_at,
                           last_request_at=sess.last_request_at or sess.created_at,
                           last_state_checkpoint_id=state, last_weights_checkpoint_id=weights)
