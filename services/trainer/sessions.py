"""Training API sessions (protos/trainyard/v1/trainer.proto): models, optimizers and strictly ordered calls.

Models (services/trainer/bases.py): every LoRA session on a base model directory is a named adapter (its session
id, with its own rank, alpha, targets and seed) in ONE shared frozen copy of that base; a full-parameter session
trains a private copy. Each session has its own AdamW. A call holds the model's lock with the session's adapter
active only while it computes (per micro-batch for Forward/ForwardBackward), so sessions of any accounts, ranks and
optimizer settings interleave call by call, and a session's numbers do not depend on the others: interleaved
sessions end with bitwise the weights and logprobs each gets alone (float32, CPU, fixed thread count; tested).
Closing a session removes its adapter and frees its optimizer and gradients; the base is dropped with its last
session. Sessions of another account are NOT_FOUND.

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
happened. A transient failure to publish weights is UNAVAILABLE and also leaves the session usable. Any other
failure marks the session failed; later calls get FAILED_PRECONDITION rather than run on state that may be
half-updated. Calls on a closed session are FAILED_PRECONDITION.

Gradients accumulate across ForwardBackward calls until OptimStep (which applies them and clears them); LoadState
clears them too. Every session trains through the engine (services/trainer/engine/): the losses and their batch
factor are its losses.py; micro-batching and the exactness of unary vs streamed calls, its forward_backward.py; the
optimizer step, its optim.py; saved states, its checkpoint.py (the format managed jobs use too). LoRA defaults and
request checks: services/trainer/session_spec.py. This module speaks no protocol: the servicer (servicer.py) converts
requests into the plain values and DatumInputs it takes.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.lora import LoraConfig, apply_lora, remove_adapter, set_trainable
from services.common import registry
from services.common.blobstore import BlobStore, StoredFile
from services.common.calls import NEVER, Cancellation
from services.common.db import Database
from services.common.errors import Cancelled, FailedPrecondition, InvalidArgument, TrainyardError, not_found
from services.common.quotas import check_quota
from services.common.schema import Checkpoint, TrainingSession, new_id, utcnow
from services.trainer.bases import ModelHolder, ModelPool
from services.trainer.datums import DatumInput, check_datum
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.checkpoint import (
    STATE_DIR, WEIGHTS_DIR, CheckpointMismatch, EngineCheckpoint, is_training_state, read_checkpoint,
)
from services.trainer.engine.forward_backward import LossCall, check_loss_request, run_call
from services.trainer.session_spec import (
    CreateSpec, LoraSpec, check_create_matches_state, resolve_lora, state_mismatch,
)

WEIGHTS_PREFIX = "trainyard://weights/"
STATE_PREFIX = "trainyard://state/"
# Files GetTokenizer sends when the base model has them; a full-parameter SaveWeights copies them (and the
# generation config) next to the weights, so the saved directory is a complete Hugging Face model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
MODEL_EXTRA_FILES = (*TOKENIZER_FILES, "generation_config.json")


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
    weight_version_id: str = ""
    running: bool = False  # a call holds the turn (next_seq_id) and is computing
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


# A Training API session's AdamW defaults (Tinker's): what OptimStep applies for the fields a request leaves unset.
SESSION_ADAMW = AdamW(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


def _state_checkpoint_id(path: str, field_name: str) -> str:
    if not path.startswith(STATE_PREFIX) or len(path) == len(STATE_PREFIX):
        raise InvalidArgument(f"must be '{STATE_PREFIX}<checkpoint id>' (the path SaveState returned), got {path!r}",
                              field=field_name)
    return path[len(STATE_PREFIX):]


class SessionManager:
    def __init__(self, db: Database, blobs: BlobStore, publish, order_timeout_s: float = 600.0,
                 deterministic: bool = False, micro_batch_tokens: int = 2048, device: str | None = None,
                 max_sessions_per_account: int = 64):
        self.db = db
        self.blobs = blobs
        # (api_key, session, directory, kind "lora_adapter" | "full") -> version id; Unavailable when it cannot
        self.publish = publish
        self.order_timeout_s = order_timeout_s
        # Batch-invariant numerics (services/trainer/engine/forward_backward.py): logprobs bitwise the deterministic
        # rollout's.
        self.deterministic = deterministic
        self.micro_batch_tokens = micro_batch_tokens
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.pool = ModelPool(self.device)
        self.max_sessions_per_account = max_sessions_per_account
        self._sessions: dict[str, Session] = {}
        self._creating: Counter[str] = Counter()  # sessions being built, per account (they count against the quota)
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def create(self, account_id: str, spec: CreateSpec) -> Session:
        if spec.full_parameter and spec.lora is not None and not spec.from_state:
            raise InvalidArgument("must be unset for a full-parameter session", field="lora")
        if spec.with_optimizer and not spec.from_state:
            raise InvalidArgument("only applies with from_state", field="with_optimizer")
        with self._lock:  # room for one more open session of the account, held while it is built
            open_now = sum(1 for sess in self._sessions.values() if sess.account_id == account_id)
            check_quota("max_sessions_per_account", self.max_sessions_per_account,
                        open_now + self._creating[account_id],
                        "the account has that many open training sessions on this trainer; close one first")
            self._creating[account_id] += 1
        try:
            return self._create(account_id, spec)
        finally:
            with self._lock:
                self._creating[account_id] -= 1

    def _create(self, account_id: str, spec: CreateSpec) -> Session:
        with contextlib.ExitStack() as stack:
            saved = None
            if spec.from_state:
                saved = stack.enter_context(self._saved_state(account_id, spec.from_state, "from_state"))
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
            sess = self._build(account_id, name, path, lora, seed, saved, spec)
        row = TrainingSession(id=sess.id, account_id=account_id, base_model=name,
                              lora_rank=lora.rank if lora else 0, lora_alpha=lora.alpha if lora else 0.0,
                              target_modules=list(lora.target_modules) if lora else [], seed=seed,
                              full_parameter=lora is None, from_state=spec.from_state, created_at=sess.created_at)
        try:
            with self.db.session() as s:
                s.add(row)
        except BaseException:
            self._free(sess)
            raise
        with self._lock:
            self._sessions[sess.id] = sess
        return sess

    def _build(self, account_id: str, name: str, path: str, lora: LoraConfig | None, seed: int,
               saved: EngineCheckpoint | None, spec: CreateSpec) -> Session:
        """Load (or share) the model, add the session's adapter or make every weight trainable, restore a saved
        state; on any failure nothing stays behind."""
        sess_id = new_id("sess")
        if lora is None:
            model = None
            if saved is not None:  # the state's weights are the session's model
                try:
                    model = self.pool.load(str(saved.weights_dir), full_parameter=True)
                except ValueError as exc:
                    raise InvalidArgument(str(exc), field="from_state") from None
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
                       engine=engine, created_at=utcnow(), from_state=spec.from_state,
                       num_trainable=engine.num_trainable)
        if saved is not None:
            try:
                with sess.use():  # a full-parameter model was built from the state's weights
                    engine.restore(saved, weights=lora is not None, optimizer=spec.with_optimizer)
            except CheckpointMismatch as exc:
                self._free(sess)
                raise InvalidArgument(str(exc), field="from_state") from None
            except BaseException:
                self._free(sess)
                raise
        return sess

    def get(self, account_id: str, session_id: str) -> Session:
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is not None and sess.account_id == account_id:
            return sess
        row = self._row(account_id, session_id)
        if row.closed_at is not None:
            raise FailedPrecondition(f"session '{session_id}' is closed")
        raise FailedPrecondition(f"session '{session_id}' is no longer loaded (the trainer restarted); create a new "
                                 "session (from a SaveState path to continue)")

    def _row(self, account_id: str, session_id: str) -> TrainingSession:
        with self.db.session() as s:
            row = s.get(TrainingSession, session_id) if session_id else None
            if row is None or row.account_id != account_id:
                raise not_found("session", session_id)
            s.expunge(row)
        return row

    def describe(self, account_id: str, session_id: str) -> SessionInfo:
        """GetSession: a loaded session as it is now; a closed one (or one a restarted trainer lost) from its row."""
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is not None and sess.account_id == account_id:
            return self.info(sess)
        row = self._row(account_id, session_id)
        return SessionInfo(id=row.id, base_model=row.base_model, lora_rank=row.lora_rank, lora_alpha=row.lora_alpha,
                           target_modules=list(row.target_modules), closed=row.closed_at is not None,
                           error="" if row.closed_at is not None else "no longer loaded (the trainer restarted)",
                           full_parameter=row.full_parameter, lineage=row.id, created_at=row.created_at)

    def close(self, account_id: str, session_id: str) -> Session:
        sess = self.get(account_id, session_id)
        with sess.cond:  # after the running call, if any; waiting ones then see closed
            sess.cond.wait_for(lambda: not sess.running)
            if sess.closed:
                raise FailedPrecondition(f"session '{session_id}' is closed")
            sess.closed = True
            sess.cond.notify_all()
        with self._lock:
            self._sessions.pop(session_id, None)
        self._free(sess)
        with self.db.session() as s:
            s.get(TrainingSession, session_id).closed_at = utcnow()
        return sess

    def _free(self, sess: Session) -> None:
        if not sess.full_parameter:
            with sess.holder.lock:
                remove_adapter(sess.holder.model, sess.id)
        self.pool.release(sess.holder, sess.id)
        sess.engine.release()

    # -- ordered calls ---------------------------------------------------------------------------------------------
    def _in_order(self, sess: Session, seq_id: int, fn, cancel: Cancellation = NEVER):
        """fn() in seq_id's turn, computed outside sess.cond holding the turn (`running`), so a waiting call whose
        client leaves (cancel) returns at once."""
        def wake() -> None:
            with sess.cond:
                sess.cond.notify_all()

        cancel.add_callback(wake)
        with sess.cond:
            first_free = sess.next_seq_id + sess.running
            if seq_id == 0:
                seq_id = first_free
            if seq_id < first_free:
                raise InvalidArgument(f"seq_id {seq_id} was already used; the session expects {first_free}",
                                      field="seq_id")
            turn = sess.cond.wait_for(lambda: (sess.next_seq_id == seq_id and not sess.running) or sess.closed
                                      or cancel.cancelled, self.order_timeout_s)
            if cancel.cancelled:
                raise Cancelled(f"the client left before seq_id {seq_id}'s turn; the seq_id was not used")
            if not turn:
                raise FailedPrecondition(f"seq_id {seq_id} waited {self.order_timeout_s:.0f}s for seq_id "
                                         f"{sess.next_seq_id}, which never arrived")
            if sess.closed:
                raise FailedPrecondition(f"session '{sess.id}' is closed")
            sess.running = True
        try:
            if sess.error:
                raise FailedPrecondition(f"session '{sess.id}' failed earlier ({sess.error}); create a new one")
            return fn()
        except TrainyardError:
            raise
        except Exception as exc:
            sess.error = f"seq_id {seq_id}: {type(exc).__name__}: {exc}"
            raise
        finally:
            with sess.cond:
                sess.next_seq_id = seq_id + 1
                sess.running = False
                sess.cond.notify_all()

    def _loss_call(self, sess: Session, loss_fn: str, config: dict, micro_batch_tokens: int, backward: bool,
                   prefix: str = "") -> LossCall:
        req = check_loss_request(loss_fn, config, micro_batch_tokens, self.micro_batch_tokens, prefix)
        return sess.engine.loss_call(req, backward=backward, deterministic=self.deterministic, lock=sess.use)

    def forward(self, account_id: str, session_id: str, seq_id: int, data: Iterable[DatumInput], loss_fn: str,
                loss_fn_config: dict[str, float], backward: bool, micro_batch_tokens: int = 0,
                streamed: bool = False, cancel: Cancellation = NEVER) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Forward (backward=False) or ForwardBackward: (per-datum logprobs, metrics). data is consumed in the
        call's turn: all of it checked before any compute, or, streamed (ForwardBackwardStream, whose loss settings
        are its header's), each datum as it arrives, its micro-batches running as soon as they are complete."""
        sess = self.get(account_id, session_id)

        def run():
            call = self._loss_call(sess, loss_fn, loss_fn_config, micro_batch_tokens, backward,
                                   prefix="header." if streamed else "")
            vocab_size = sess.holder.model.args.vocab_size
            datums = (check_datum(d, i, call.req.loss_fn, vocab_size) for i, d in enumerate(data))
            return run_call(call, datums if streamed else list(datums))

        return self._in_order(sess, seq_id, run, cancel)

    def optim_step(self, account_id: str, session_id: str, seq_id: int, adam: AdamW,
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
            with sess.use():
                norm = sess.engine.step(adam)
            return sess.optim_steps, {"grad_norm": float(norm), "learning_rate": adam.learning_rate}  # float() syncs

        return self._in_order(sess, seq_id, run, cancel)

    # -- weights and states ----------------------------------------------------------------------------------------
    def save_weights(self, account_id: str, api_key: str, session_id: str, seq_id: int,
                     name: str, cancel: Cancellation = NEVER) -> tuple[str, str, str]:
        """(checkpoint id, weight version id, path "trainyard://weights/<version id>")."""
        sess = self.get(account_id, session_id)

        def run():
            if len(name) > 256:
                raise InvalidArgument("at most 256 characters", field="name")
            kind = "full" if sess.full_parameter else "lora_adapter"
            with tempfile.TemporaryDirectory(prefix="weights-") as tmp:
                with sess.use():
                    sess.engine.save_weights(Path(tmp), base_model=sess.base_model)
                if sess.full_parameter:
                    for extra in MODEL_EXTRA_FILES:
                        if (Path(sess.model_path) / extra).is_file():
                            shutil.copyfile(Path(sess.model_path) / extra, Path(tmp) / extra)
                files = [f.to_json() for f in self.blobs.put_tree(tmp)]
                # A transient publishing failure is the publisher's Unavailable: the session's state is intact and
                # the caller can save again.
                version_id = self.publish(api_key, sess, Path(tmp), kind)
            ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, session_id=sess.id,
                              name=name or f"{sess.id}-step{sess.optim_steps}", step=sess.optim_steps, kind=kind,
                              base_model=sess.base_model, model_path="" if sess.full_parameter else sess.model_path,
                              files=files, final=True, metrics={}, created_at=utcnow())
            with self.db.session() as s:
                s.add(ckpt)
            sess.weight_version_id = version_id
            return ckpt.id, version_id, WEIGHTS_PREFIX + version_id

        return self._in_order(sess, seq_id, run, cancel)

    def save_state(self, account_id: str, session_id: str, seq_id: int, name: str,
                   cancel: Cancellation = NEVER) -> tuple[str, str]:
        """(checkpoint id, path "trainyard://state/<checkpoint id>"). The checkpoint's files are the weights (an
        adapter or a model directory, its kind), its state the optimizer and counters (engine/checkpoint.py)."""
        sess = self.get(account_id, session_id)

        def run():
            if len(name) > 256:
                raise InvalidArgument("at most 256 characters", field="name")
            with tempfile.TemporaryDirectory(prefix="state-") as tmp:
                with sess.use():
                    sess.engine.save(Path(tmp), base_model=sess.base_model,
                                     progress={"next_seq_id": sess.next_seq_id + 1})
                files = [f.to_json() for f in self.blobs.put_tree(Path(tmp) / WEIGHTS_DIR)]
                state = [f.to_json() for f in self.blobs.put_tree(Path(tmp) / STATE_DIR)]
            ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, session_id=sess.id,
                              name=name or f"{sess.id}-state-step{sess.optim_steps}", step=sess.optim_steps,
                              kind="full" if sess.full_parameter else "lora_adapter", base_model=sess.base_model,
                              model_path="" if sess.full_parameter else sess.model_path, files=files, state=state,
                              final=False, metrics={}, created_at=utcnow())
            with self.db.session() as s:
                s.add(ckpt)
            return ckpt.id, STATE_PREFIX + ckpt.id

        return self._in_order(sess, seq_id, run, cancel)

    def load_state(self, account_id: str, session_id: str, seq_id: int, path: str, with_optimizer: bool,
                   cancel: Cancellation = NEVER) -> Session:
        """Replace the session's weights (and with_optimizer its AdamW state and step count) with a saved state of
        the same base model, kind and LoRA config; pending gradients are dropped. Without with_optimizer the
        optimizer state stays as it is."""
        sess = self.get(account_id, session_id)

        def run():
            with self._saved_state(account_id, path, "path") as saved:
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

        return self._in_order(sess, seq_id, run, cancel)

    @contextlib.contextmanager
    def _saved_state(self, account_id: str, path: str, field_name: str) -> Iterator[EngineCheckpoint]:
        """A SaveState checkpoint of this account laid out in a temporary directory (NOT_FOUND for another
        account's)."""
        ckpt_id = _state_checkpoint_id(path, field_name)
        with self.db.session() as s:
            ckpt = registry.get_checkpoint(s, account_id, ckpt_id)
            files, state = list(ckpt.files), list(ckpt.state or [])
        if not is_training_state(f["path"] for f in state):
            raise InvalidArgument(f"checkpoint '{ckpt_id}' holds weights only, not a training state (save one with "
                                  "SaveState)", field=field_name)
        with tempfile.TemporaryDirectory(prefix="state-") as tmp:
            root = Path(tmp)
            self.blobs.materialize([StoredFile.from_json(f) for f in files], root / WEIGHTS_DIR)
            self.blobs.materialize([StoredFile.from_json(f) for f in state], root / STATE_DIR)
            try:
                saved = read_checkpoint(root)
            except CheckpointMismatch as exc:
                raise InvalidArgument(str(exc), field=field_name) from None
            yield saved

    # -- model facts -----------------------------------------------------------------------------------------------
    def tokenizer_files(self, account_id: str, session_id: str) -> list[Path]:
        sess = self.get(account_id, session_id)
        return [Path(sess.model_path) / n for n in TOKENIZER_FILES if (Path(sess.model_path) / n).is_file()]

    def info(self, sess: Session) -> SessionInfo:
        args = sess.holder.model.args
        lora = sess.lora
        return SessionInfo(id=sess.id, base_model=sess.base_model, lora_rank=lora.rank if lora else 0,
                           lora_alpha=lora.alpha if lora else 0.0,
                           target_modules=list(lora.target_modules) if lora else [], next_seq_id=sess.next_seq_id,
                           optim_steps=sess.optim_steps, closed=sess.closed, error=sess.error,
                           num_trainable_parameters=sess.num_trainable, full_parameter=sess.full_parameter,
                           lineage=sess.id, vocab_size=args.vocab_size, num_layers=args.num_layers,
                           hidden_size=args.hidden_size, architecture=args.architecture, created_at=sess.created_at)
