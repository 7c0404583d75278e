"""Training API sessions: a LoRA adapter over a frozen base, its optimizer, and strictly ordered calls.

Ordering: every call carries seq_id; a session runs seq_id n only after n-1 finished (later ones wait, so clients may
pipeline). A call with bad input fails with INVALID_ARGUMENT in its turn (its seq_id is used up, so later calls do
not wait for it) without touching any state, and the session goes on; a transient failure to publish weights is
UNAVAILABLE and also leaves the session usable; any other failure marks the session failed, and later calls are
refused with FAILED_PRECONDITION rather than run on state that may be half-updated.

cross_entropy, per datum (as the Tinker API defines it): loss = -sum_t weights[t] * logprob(target_tokens[t] | tokens[:t+1]),
where logprob is the model's log-softmax at position t (no temperature). Metrics: "loss:sum" over the batch and
"loss:mean" = loss:sum / sum of weights.
"""
from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from models import load_pretrained
from models.lora import LoraConfig, apply_lora, save_peft_adapter
from services.common import registry
from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.errors import FailedPrecondition, InvalidArgument, TrainyardError, Unavailable, not_found
from services.common.schema import Checkpoint, TrainingSession, new_id, utcnow
from services.trainer.sft_config import lora_settings, lora_target_problem
from services.trainer.logprobs import target_logprobs
from services.trainer.tensors import to_torch
from trainyard.v1 import trainer_pb2 as pb

LOSSES = ("cross_entropy",)


@dataclass
class Session:
    id: str
    account_id: str
    base_model: str
    model_path: str
    lora: LoraConfig
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    created_at: object
    optimizer: torch.optim.AdamW | None = None
    next_seq_id: int = 1
    optim_steps: int = 0
    error: str = ""
    closed: bool = False
    weight_version_id: str = ""
    cond: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class Batch:
    tokens_BT: torch.Tensor
    targets_BT: torch.Tensor
    weights_BT: torch.Tensor
    lengths: list[int]


def parse_batch(data, loss_fn: str, vocab_size: int) -> Batch:
    if loss_fn not in LOSSES:
        raise InvalidArgument(f"unknown loss {loss_fn!r}; available: {', '.join(LOSSES)}", field="loss_fn")
    if not data:
        raise InvalidArgument("at least one datum is required", field="data")
    rows = []
    for i, d in enumerate(data):
        T = len(d.tokens)
        if T == 0:
            raise InvalidArgument("model input is empty", field=f"data[{i}].tokens")
        tokens = torch.tensor(list(d.tokens), dtype=torch.int64)
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            raise InvalidArgument(f"token ids must be in [0, {vocab_size})", field=f"data[{i}].tokens")
        if "target_tokens" not in d.loss_fn_inputs:
            raise InvalidArgument("cross_entropy needs loss_fn_inputs['target_tokens']",
                                  field=f"data[{i}].loss_fn_inputs")
        targets = to_torch(d.loss_fn_inputs["target_tokens"], f"data[{i}].loss_fn_inputs['target_tokens']")
        if targets.dtype != torch.int64 or tuple(targets.shape) != (T,):
            raise InvalidArgument(f"must be int64 of shape [{T}] (one target per input token), got "
                                  f"{str(targets.dtype).removeprefix('torch.')} {list(targets.shape)}",
                                  field=f"data[{i}].loss_fn_inputs['target_tokens']")
        if int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
            raise InvalidArgument(f"token ids must be in [0, {vocab_size})",
                                  field=f"data[{i}].loss_fn_inputs['target_tokens']")
        if "weights" in d.loss_fn_inputs:
            w = to_torch(d.loss_fn_inputs["weights"], f"data[{i}].loss_fn_inputs['weights']")
            if w.dtype != torch.float32 or tuple(w.shape) != (T,):
                raise InvalidArgument(f"must be float32 of shape [{T}]", field=f"data[{i}].loss_fn_inputs['weights']")
            if not torch.isfinite(w).all():
                raise InvalidArgument("contains NaN or infinity", field=f"data[{i}].loss_fn_inputs['weights']")
        else:
            w = torch.ones(T)
        rows.append((tokens, targets, w))
    T = max(len(r[0]) for r in rows)
    tok = torch.zeros(len(rows), T, dtype=torch.int64)
    tgt = torch.zeros(len(rows), T, dtype=torch.int64)
    wts = torch.zeros(len(rows), T)
    for i, (a, b, c) in enumerate(rows):
        tok[i, :len(a)], tgt[i, :len(b)], wts[i, :len(c)] = a, b, c
    return Batch(tok, tgt, wts, [len(r[0]) for r in rows])


class SessionManager:
    def __init__(self, db: Database, blobs: BlobStore, publish, order_timeout_s: float = 600.0,
                 deterministic: bool = False):
        self.db = db
        self.blobs = blobs
        self.publish = publish  # (api_key, session, adapter_dir) -> version id
        self.order_timeout_s = order_timeout_s
        # Batch-invariant numerics (services/trainer/logprobs.py): logprobs bitwise the deterministic rollout's.
        self.deterministic = deterministic
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def create(self, account_id: str, base_model: str, rank: int | None, alpha: float | None,
               target_modules: list[str], seed: int) -> Session:
        lora, problems = lora_settings(rank, alpha, 0.0, target_modules, prefix="lora.")
        if problems:
            raise InvalidArgument(violations=problems)
        rank, alpha, targets = lora["rank"], lora["alpha"], lora["target_modules"]
        with self.db.session() as s:
            model_row = registry.require_model(s, account_id, base_model, field="base_model")
            name, path = model_row.name, model_row.path
        cfg = LoraConfig(rank=rank, alpha=alpha, target_modules=targets)
        problem = lora_target_problem(path, targets)
        if problem:
            raise InvalidArgument(problem, field="lora.target_modules")
        model = load_pretrained(path)
        params = apply_lora(model, cfg, seed=seed)
        model.train()
        row = TrainingSession(id=new_id("sess"), account_id=account_id, base_model=name, lora_rank=rank,
                              lora_alpha=alpha, target_modules=list(targets), seed=seed, created_at=utcnow())
        with self.db.session() as s:
            s.add(row)
        sess = Session(id=row.id, account_id=account_id, base_model=name, model_path=path, lora=cfg, model=model,
                       params=params, created_at=row.created_at)
        with self._lock:
            self._sessions[sess.id] = sess
        return sess

    def get(self, account_id: str, session_id: str) -> Session:
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is not None and sess.account_id == account_id:
            return sess
        with self.db.session() as s:
            row = s.get(TrainingSession, session_id) if session_id else None
        if row is None or row.account_id != account_id:
            raise not_found("session", session_id)
        raise FailedPrecondition(f"session '{session_id}' is no longer loaded (closed, or the trainer restarted); "
                                 "create a new session")

    def close(self, account_id: str, session_id: str) -> Session:
        sess = self.get(account_id, session_id)
        with sess.cond:
            sess.closed = True
            sess.cond.notify_all()
        with self._lock:
            self._sessions.pop(session_id, None)
        with self.db.session() as s:
            s.get(TrainingSession, session_id).closed_at = utcnow()
        return sess

    # -- ordered calls ---------------------------------------------------------------------------------------------
    def _in_order(self, sess: Session, seq_id: int, fn):
        with sess.cond:
            if seq_id == 0:
                seq_id = sess.next_seq_id
            if seq_id < sess.next_seq_id:
                raise InvalidArgument(f"seq_id {seq_id} was already used; the session expects {sess.next_seq_id}",
                                      field="seq_id")
            if not sess.cond.wait_for(lambda: sess.next_seq_id == seq_id or sess.closed, self.order_timeout_s):
                raise FailedPrecondition(f"seq_id {seq_id} waited {self.order_timeout_s:.0f}s for seq_id "
                                         f"{sess.next_seq_id}, which never arrived")
            if sess.closed:
                raise FailedPrecondition(f"session '{sess.id}' is closed")
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
                sess.next_seq_id = seq_id + 1
                sess.cond.notify_all()

    def forward(self, account_id: str, session_id: str, seq_id: int, data, loss_fn: str, backward: bool):
        sess = self.get(account_id, session_id)

        def run():
            batch = parse_batch(data, loss_fn or "cross_entropy", sess.model.args.vocab_size)
            with torch.set_grad_enabled(backward):
                logprobs_BT = target_logprobs(sess.model, batch.tokens_BT, batch.targets_BT,
                                              deterministic=self.deterministic)
                loss = -(batch.weights_BT * logprobs_BT).sum()
                if backward:
                    loss.backward()
            total_w = float(batch.weights_BT.sum())
            outputs = [logprobs_BT[i, :n].detach() for i, n in enumerate(batch.lengths)]
            metrics = {"loss:sum": float(loss), "loss:mean": float(loss) / total_w if total_w else 0.0}
            return outputs, metrics

        return self._in_order(sess, seq_id, run)

    def optim_step(self, account_id: str, session_id: str, seq_id: int, adam: dict) -> tuple[int, dict]:
        sess = self.get(account_id, session_id)
        lr, b1, b2 = adam["learning_rate"], adam["beta1"], adam["beta2"]
        checks = (("learning_rate", lr > 0 and lr < 1, "> 0 and < 1"), ("beta1", 0 <= b1 < 1, "in [0, 1)"),
                  ("beta2", 0 <= b2 < 1, "in [0, 1)"), ("eps", adam["eps"] >= 0, ">= 0"),
                  ("weight_decay", adam["weight_decay"] >= 0, ">= 0"),
                  ("grad_clip_norm", adam["grad_clip_norm"] >= 0, ">= 0 (0 = no clipping)"))

        def run():
            for name, ok, rule in checks:
                if not ok:
                    raise InvalidArgument(f"must be {rule}, got {adam[name]}", field=f"adam.{name}")
            if sess.optimizer is None:
                sess.optimizer = torch.optim.AdamW(sess.params, lr=lr)
            for g in sess.optimizer.param_groups:
                g.update(lr=lr, betas=(b1, b2), eps=adam["eps"], weight_decay=adam["weight_decay"])
            grads = [p.grad for p in sess.params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads \
                else torch.zeros(())
            if adam["grad_clip_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(sess.params, adam["grad_clip_norm"])
            sess.optimizer.step()
            sess.optimizer.zero_grad(set_to_none=True)
            sess.optim_steps += 1
            return sess.optim_steps, {"grad_norm": float(norm), "learning_rate": lr}

        return self._in_order(sess, seq_id, run)

    def save_weights(self, account_id: str, api_key: str, session_id: str, seq_id: int, name: str):
        sess = self.get(account_id, session_id)

        def run():
            if len(name) > 256:
                raise InvalidArgument("at most 256 characters", field="name")
            with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
                save_peft_adapter(sess.model, sess.lora, tmp, base_model_name_or_path=sess.base_model)
                files = [f.to_json() for f in self.blobs.put_tree(tmp)]
                try:
                    version_id = self.publish(api_key, sess, Path(tmp))
                except grpc.RpcError as exc:  # the session's state is intact: the caller can save again
                    raise Unavailable(f"the weights were not published to the weight-sync service: "
                                      f"{exc.details()}") from None
            ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, session_id=sess.id,
                              name=name or f"{sess.id}-step{sess.optim_steps}", step=sess.optim_steps,
                              kind="lora_adapter", base_model=sess.base_model, model_path=sess.model_path,
                              files=files, final=True, metrics={}, created_at=utcnow())
            with self.db.session() as s:
                s.add(ckpt)
            sess.weight_version_id = version_id
            return ckpt.id, version_id

        return self._in_order(sess, seq_id, run)

    def info(self, sess: Session) -> pb.Session:
        return pb.Session(id=sess.id, base_model=sess.base_model, lora_rank=sess.lora.rank,
                          lora_alpha=sess.lora.alpha, target_modules=list(sess.lora.target_modules),
                          next_seq_id=sess.next_seq_id, optim_steps=sess.optim_steps, closed=sess.closed,
                          error=sess.error, num_trainable_parameters=sum(p.numel() for p in sess.params))
