"""The models a trainer holds for its sessions: one shared frozen base per model directory for all LoRA sessions on
it, and a private copy per full-parameter session.

A LoRA session is a named adapter (the session id) in its base; every use of the model takes the base's lock and
activates the session's adapter for its duration (`ModelHolder.use`), so sessions on one base run one call at a time,
each seeing only its own adapter. Adding or removing an adapter also happens under the lock. A shared base is
loaded when its first session is created and dropped when its last session closes.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from models import load_pretrained
from models.lora import set_active_adapter
from services.trainer.engine import training_dtype


@dataclass
class ModelHolder:
    path: str
    model: nn.Module
    shared: bool  # a LoRA base shared by its sessions (False: one full-parameter session's own model)
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def use(self, adapter: str | None) -> Iterator[nn.Module]:
        """The model with this session's adapter active (None: a full-parameter model), held exclusively."""
        with self.lock:
            if self.shared:
                set_active_adapter(self.model, adapter)
            yield self.model


class ModelPool:
    def __init__(self, device: torch.device):
        self.device = device
        self._bases: dict[str, ModelHolder] = {}
        self._lock = threading.Lock()

    def acquire_base(self, path: str, session_id: str) -> ModelHolder:
        """The shared base of model directory `path` (loaded now if no session uses it), counted as used by
        session_id until release()."""
        with self._lock:  # loading under the pool lock: concurrent creates on one path load it once
            holder = self._bases.get(path)
            if holder is None:
                holder = ModelHolder(path, self.load(path, full_parameter=False).train(), shared=True)
                self._bases[path] = holder
            holder.users.add(session_id)
            return holder

    def private(self, path: str, session_id: str, model: nn.Module | None = None) -> ModelHolder:
        """A model of the session's own (loaded from path unless given)."""
        model = self.load(path, full_parameter=True) if model is None else model
        return ModelHolder(path, model.train(), shared=False, users={session_id})

    def release(self, holder: ModelHolder, session_id: str) -> None:
        with self._lock:
            holder.users.discard(session_id)
            if holder.shared and not holder.users and self._bases.get(holder.path) is holder:
                del self._bases[holder.path]

    def load(self, path: str, *, full_parameter: bool) -> nn.Module:
        """The model directory's weights in the engine's training dtype (a frozen LoRA base vs trained weights)."""
        return load_pretrained(path, dtype=training_dtype(self.device, full_parameter=full_parameter),
                               device=self.device)

    def loaded_bases(self) -> dict[str, set[str]]:
        """Model directory -> ids of the sessions sharing it (for tests and status)."""
        with self._lock:
            return {path: set(h.users) for path, h in self._bases.items()}
