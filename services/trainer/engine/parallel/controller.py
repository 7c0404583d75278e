"""Rank 0 drives the other ranks: the controller -> workers seam of the distributed trainer.

The trainer service runs as a torchrun group (one process per device, c10d rendezvous). Rank 0 serves gRPC and owns
every decision (which session, which datums, which loss); the other ranks hold their shards of the same engines and
run `serve(target)`: a loop that waits for rank 0's next command and runs it. No gRPC handler runs on a worker, and
no worker decides anything.

One command, in order:
1. rank 0 (Controller.run, one command at a time: a lock) broadcasts (name, shared args, kwargs) to every rank with
   broadcast_object_list over the control group (gloo, also when the engines' collectives run on NCCL), and
   scatters each rank's own part when the command has one (per_rank: e.g. a data-parallel rank's datums);
2. every rank, rank 0 included, calls target.<name>(*args, part, **kwargs): SPMD engine methods whose collectives
   (FSDP all-gathers and reduce-scatters, expert all_to_all, ring attention, pipeline sends) meet on all ranks;
3. rank 0 gathers every rank's result (gather_object) and returns them in rank order.

Failures: a command's checks of the client's input happen on rank 0 before step 1, so bad input never reaches the
workers. An exception on a worker while running a command cannot be answered in step with the others (its peers may
be blocked in a collective it will never enter), so the worker logs it and exits: its sockets close, rank 0's next
collective with it fails at once (gloo: "connection closed by peer"; NCCL: the process group's timeout), and torchrun
ends the group. The trainer then restarts as a whole and its sessions come back from their last records
(services/trainer/session_states.py), a managed job from its last checkpoint. Rank 0 turns a broken group into
Unavailable for the caller. A worker whose rank 0 disappears ends its loop the same way.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from services.common.errors import Unavailable

log = logging.getLogger(__name__)

STOP = "__stop__"


@dataclass
class Command:
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    has_parts: bool = False  # a per-rank part follows (scatter_object_list)


def control_group(timeout_s: float = 300.0):
    """A gloo group over every rank for the commands (objects travel on CPU whatever backend the engines use)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _exchange(command: Command | None, parts: Sequence[Any] | None, group) -> tuple[Command, Any]:
    """Step 1 on every rank: the command (from rank 0) and this rank's part of it."""
    box = [command]
    dist.broadcast_object_list(box, src=0, group=group)
    command = box[0]
    part = None
    if command.has_parts:
        out = [None]
        dist.scatter_object_list(out, list(parts) if dist.get_rank() == 0 else None, src=0, group=group)
        part = out[0]
    return command, part


def _call(target: Any, command: Command, part: Any):
    fn: Callable = getattr(target, command.name)
    args = (*command.args, part) if command.has_parts else command.args
    return fn(*args, **command.kwargs)


class Controller:
    """Rank 0's side: run(name, ...) runs target.<name> on every rank and returns each rank's result."""

    def __init__(self, target: Any, group=None):
        if dist.get_rank() != 0:
            raise RuntimeError("the controller runs on rank 0; other ranks run serve()")
        self.target = target
        self.group = group if group is not None else control_group()
        self.world_size = dist.get_world_size(self.group)
        self._lock = threading.Lock()
        self.broken: str | None = None

    def run(self, name: str, *args, per_rank: Sequence[Any] | None = None, **kwargs) -> list:
        """target.<name>(*args, [part,] **kwargs) on every rank (part: per_rank[rank] when given, one per rank);
        each rank's result, rank order. Unavailable once any rank has failed: the group is not usable after that."""
        if per_rank is not None and len(per_rank) != self.world_size:
            raise ValueError(f"per_rank holds {len(per_rank)} parts for {self.world_size} ranks")
        with self._lock:
            if self.broken:
                raise Unavailable(f"the trainer's process group is broken ({self.broken}); it restarts")
            command = Command(name, tuple(args), dict(kwargs), has_parts=per_rank is not None)
            try:
                command, part = _exchange(command, per_rank, self.group)
                mine = _call(self.target, command, part)
                results = [None] * self.world_size
                dist.gather_object(mine, results, dst=0, group=self.group)
            except RuntimeError as exc:  # a collective failed: a rank died or hung past the timeout
                self.broken = str(exc).splitlines()[0][:300]
                log.error("the trainer's process group broke during %s: %s", name, self.broken)
                raise Unavailable(f"a trainer rank failed during {name}; the trainer restarts") from exc
            return results

    def stop(self) -> None:
        """End every worker's loop (at shutdown)."""
        with self._lock:
            if self.broken:
                return
            _exchange(Command(STOP), None, self.group)


def serve(target: Any, group=None, *, exit_on_error: Callable[[int], None] = os._exit) -> None:
    """A worker rank's loop: run rank 0's commands on target until it stops the group. An exception from a command
    is fatal for the process (see the module docstring): logged, then exit_on_error(1)."""
    group = group if group is not None else control_group()
    while True:
        try:
            command, part = _exchange(None, None, group)
        except RuntimeError:  # rank 0 went away
            log.error("rank %d: rank 0 left the group; stopping", dist.get_rank())
            exit_on_error(1)
            return
        if command.name == STOP:
            return
        try:
            result = _call(target, command, part)
            dist.gather_object(result, None, dst=0, group=group)
        except BaseException:  # noqa: BLE001 - see the module docstring
            log.exception("rank %d: %s failed; leaving the group", dist.get_rank(), command.name)
            exit_on_error(1)
            return
