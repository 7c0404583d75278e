"""Helpers for the Training API tests: an in-process platform (SQLite, a real blob store, the tiny model registered,
two accounts), datums (the core's DatumInput, and on the wire), and snapshots of a session's weights and
gradients."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.lora import lora_state_dict
from services.common import registry
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.schema import SHARED_SCOPE
from services.trainer.datums import DatumInput
from services.trainer.engine import AdamW
from services.trainer.servicer import from_torch, stream_request
from services.trainer.session_spec import CreateSpec, LoraSpec
from services.trainer.sessions import SessionManager
from trainyard.v1 import trainer_pb2 as pb

VOCAB = 1024  # the tiny model's
ADAM = AdamW(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


class ApiEnv:
    """A database with accounts alice and bob and the shared model "tiny"; managers over a real blob store."""

    def __init__(self, root: Path, model_dir: Path):
        root.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{root / 'trainyard.db'}"
        migrate(url)
        self.db = Database(url)
        self.alice = create_account(self.db, "alice")[0].id
        self.bob = create_account(self.db, "bob")[0].id
        with self.db.session() as s:
            registry.register_model(s, SHARED_SCOPE, "tiny", str(model_dir))
        self.blobs = BlobStore(root / "blobs")
        self.model_dir = model_dir

    def manager(self, **kw) -> SessionManager:
        return SessionManager(self.db, self.blobs, kw.pop("publish", None), device="cpu", **kw)

    def close(self) -> None:
        self.db.dispose()


def lora(**kw) -> CreateSpec:
    seed = kw.pop("seed", 0)
    return CreateSpec(base_model="tiny", lora=LoraSpec(**kw), seed=seed)


def tensor(values, dtype: str = "float32") -> pb.TensorData:
    arr = np.asarray(values, dtype="<i8" if dtype == "int64" else "<f4")
    kind = pb.TensorData.DTYPE_INT64 if dtype == "int64" else pb.TensorData.DTYPE_FLOAT32
    return pb.TensorData(dtype=kind, shape=list(arr.shape), data=arr.tobytes())


def to_numpy(t: pb.TensorData) -> np.ndarray:
    dtype = "<i8" if t.dtype == pb.TensorData.DTYPE_INT64 else "<f4"
    return np.frombuffer(t.data, dtype=dtype).reshape(list(t.shape))


def random_tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def sft_datum(tokens: list[int], weights=None, k_targets=None) -> DatumInput:
    """Next-token targets (or the [T, K] targets given), weights optional."""
    inputs = {"target_tokens": torch.tensor(tokens[1:] if k_targets is None else k_targets, dtype=torch.int64)}
    if weights is not None:
        inputs["weights"] = torch.tensor(weights, dtype=torch.float32)
    return DatumInput(torch.tensor(tokens[:-1], dtype=torch.int64), inputs)


def rl_datum(gen: torch.Generator, n: int, mask: bool = False) -> DatumInput:
    """A sampled sequence of n + 1 tokens with sampling logprobs near the tiny model's and random advantages."""
    tokens = random_tokens(gen, n + 1)
    inputs = {"target_tokens": torch.tensor(tokens[1:], dtype=torch.int64),
              "logprobs": -7.0 + 0.3 * torch.randn(n, generator=gen),
              "advantages": torch.randn(n, generator=gen)}
    if mask:
        inputs["mask"] = (torch.arange(n) >= n // 3).float()
    return DatumInput(torch.tensor(tokens[:-1], dtype=torch.int64), inputs)


def wire(d: DatumInput | pb.Datum) -> pb.Datum:
    """A datum as a client sends it (pb.Datum passes through)."""
    if isinstance(d, pb.Datum):
        return d
    return pb.Datum(tokens=d.tokens.tolist(), loss_fn_inputs={k: from_torch(v) for k, v in d.loss_fn_inputs.items()})


def stream(header: pb.ForwardBackwardRequest, batches: list[list]) -> list[pb.ForwardBackwardStreamRequest]:
    return [pb.ForwardBackwardStreamRequest(header=header),
            *(pb.ForwardBackwardStreamRequest(datums=pb.DatumBatch(data=[wire(d) for d in b])) for b in batches)]


def forward_stream(manager: SessionManager, account_id: str, messages) -> tuple[list[torch.Tensor], dict]:
    """A ForwardBackwardStream's messages into the core, as the servicer hands them over."""
    header, datums = stream_request(messages)
    return manager.forward(account_id, header.session_id, header.seq_id, datums, header.loss_fn,
                           dict(header.loss_fn_config), backward=True, micro_batch_tokens=header.micro_batch_tokens,
                           streamed=True)


def weights(sess) -> dict[str, torch.Tensor]:
    """The session's trainable tensors, copied (adapter tensors by PEFT key; full-parameter: the state dict)."""
    with sess.use() as model:
        state = model.state_dict() if sess.full_parameter else lora_state_dict(model, sess.id)
        return {k: v.detach().clone() for k, v in state.items()}


def grads(sess) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in sess.params]


def same(a, b) -> bool:
    """Bitwise equality of tensors, lists and dicts of tensors (None matches None)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
