"""The trainer service on a torchrun group: rank 0 serves the Training API, every rank holds its shards of the
sessions' engines (docs/distributed.md, "The trainer service on a torchrun group").

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --nnodes N --nproc-per-node P
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id trainer --max-restarts R -m services.trainer

(or `python -m services.trainer` with trainer_nproc / trainer_nnodes set: `launch_argv` builds that command;
TORCHRUN_ENV says why the variable).

Roles. Every rank initializes the default process group from torchrun's environment (gloo on CPU, NCCL on CUDA),
then:
- rank 0 builds the usual server (services/trainer/app.py) around a SessionManager whose engines are GroupEngines,
  and drives the other ranks through parallel/controller.py's Controller;
- every other rank runs controller.serve(EngineHost): it waits for rank 0's commands and never decides anything.

EngineHost (every rank, the controller's target) holds one sharded TrainingEngine per session id: create loads it
with TrainingEngine.load(model_dir, parallel=...) on every rank, and loss_call / step / save / save_weights / restore /
release run the engine's method of that session. On a group every session owns its sharded model (the shared frozen
base of services/trainer/bases.py is a single-process economy): several LoRA sessions still run side by side, each
with its own FSDP-sharded copy of the base and its own adapter.

GroupEngine (rank 0) is what SessionManager holds as a session's engine: the engine's interface, each call a
Controller command. So sessions.py stays one code path: ordering, every check of the client's input (on rank 0,
before a command leaves it), failure handling, quotas, saved states and restore_all are the same as on one process;
reading the engine (its model's config, its parameters, its step count) reads rank 0's own shard-holding engine,
which runs every command too.

A Forward / ForwardBackward is one command. Its datums, checked on rank 0 as they arrive (a stream's as its
messages come), are gathered there; at the end rank 0 computes the call's batch factor over all of them
(losses.batch_scale) and sends each rank its data-parallel share (split_for_ranks, contiguous, in order; the cp ranks
of a group get the same share), and every rank runs the engine's LossCall on its share. A stream that fails or is
cancelled before its end therefore ran nothing (the gradients are unchanged), and the unary and the streamed call
send the same command: the same result. The logprobs come back from each data-parallel rank, in datum order; the
metrics are every rank's (the engine all-reduces their sums). A call with fewer datums than data-parallel ranks
leaves some ranks without any: they run padding micro-batches only (forward_backward.LossCall).

Failures. A command whose engine refuses it the same way on every rank (a non-finite gradient norm, a checkpoint
that does not fit) comes back as that refusal, raised on rank 0 from its own engine's exception; the group goes on.
Anything else is fatal for the group (controller.py's module docstring): a worker that fails exits, a worker that
dies breaks the group, and rank 0's call fails with UNAVAILABLE within seconds (gloo notices the closed connection).
Rank 0 then shuts its server down (calls waiting for their turn get UNAVAILABLE, unrun; no state is recorded, the
group cannot save) and exits non-zero, so torchrun (--max-restarts) restarts the whole group, and the sessions come
back from their records (session_states.py restore_all) as after any trainer crash. A rank 0 that stops gracefully
(SIGTERM) records the sessions first, then stops the workers, which ignore SIGTERM themselves until then (torchrun
signals every rank at once; rank 0 decides when they leave).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.errors import InvalidArgument, Unavailable
from services.trainer.engine import AdamW, TrainingEngine, losses
from services.trainer.engine.checkpoint import CheckpointMismatch, EngineCheckpoint
from services.trainer.engine.forward_backward import Datum, LossRequest, run_call, split_for_ranks
from services.trainer.engine.optim import NonFiniteGradient
from services.trainer.engine.parallel.controller import Controller, serve
from services.trainer.engine.parallel.dims import ParallelDims, join_torchrun_group

log = logging.getLogger("trainyard.trainer.group")

# A command every rank's engine refused alike: rank 0 raises its own engine's exception (never pickled).
REFUSED = "__refused__"
# Refusals that every rank reaches the same way, before changing anything: the group goes on after them.
SYMMETRIC = (NonFiniteGradient, CheckpointMismatch, InvalidArgument)


# What torchrun's agents need in their environment for this group. A restarted group must not meet in the store of
# the run before: torchrun's c10d rendezvous shares one TCP store across its rounds by default, and the new ranks
# then read the dead ranks' addresses (gloo's connectFullMesh fails, the restart with it). Without sharing, each
# round's rank 0 hosts a fresh store.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def in_group() -> bool:
    """Whether this process is one rank of a torchrun group of more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_argv(settings) -> list[str] | None:
    """The torchrun command that starts this trainer as a group, when the settings ask for more than one process and
    this process is not already one of a group's ranks; None otherwise (the trainer runs in this process)."""
    if in_group() or settings.trainer_nproc * settings.trainer_nnodes == 1:
        return None
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(settings.trainer_nnodes),
            "--nproc-per-node", str(settings.trainer_nproc), "--max-restarts", str(settings.trainer_max_restarts)]
    if settings.trainer_nnodes > 1:
        if not settings.trainer_rdzv_endpoint:
            raise InvalidArgument("required when trainer_nnodes > 1 (host:port of the c10d rendezvous every node "
                                  "reaches)", field="trainer_rdzv_endpoint")
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", settings.trainer_rdzv_endpoint, "--rdzv-id",
                 settings.trainer_rdzv_id]
    else:
        argv += ["--standalone"]
    return [*argv, "-m", "services.trainer"]


class EngineHost:
    """Every rank's sharded engines by session id: the controller's target (the module docstring)."""

    def __init__(self, parallel: ParallelDims, optimizer: AdamW, device: torch.device):
        self.parallel, self.optimizer, self.device = parallel, optimizer, device
        self.engines: dict[str, TrainingEngine] = {}
        self.refusal: BaseException | None = None  # rank 0: the refusal its own engine raised, for GroupEngine

    def _refusable(self, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SYMMETRIC as exc:
            self.refusal = exc
            return REFUSED

    def create(self, session_id: str, model_dir: str, lora, seed: int, saved: EngineCheckpoint | None,
               weights: bool, optimizer: bool, gradients: bool) -> tuple[int, int]:
        """Load the session's sharded engine (and restore a saved state into it); (this rank's dp rank, the
        session's trainable parameter count)."""
        engine = TrainingEngine.load(model_dir, lora=lora, seed=seed, optimizer=self.optimizer, device=self.device,
                                     parallel=self.parallel)
        if saved is not None:
            result = self._refusable(engine.restore, saved, weights=weights, optimizer=optimizer,
                                     gradients=gradients)
            if result == REFUSED:
                engine.release()
                return REFUSED
        self.engines[session_id] = engine
        return engine.dp_rank, self._num_trainable(engine)

    def _num_trainable(self, engine: TrainingEngine) -> int:
        """The whole model's trainable parameter count (what one process counts): every rank's local shards
        summed, once per replica (dense weights are sharded over dp_shard x cp, experts over ep x efsdp, the same
        ranks; only dp_replicate holds copies)."""
        from torch.distributed.tensor import DTensor

        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in engine.params)
        total = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(total)
        return int(total.item()) // self.parallel.dp_replicate

    def release(self, session_id: str) -> None:
        engine = self.engines.pop(session_id, None)
        if engine is not None:
            engine.release()

    def loss_call(self, session_id: str, req: LossRequest, backward: bool, deterministic: bool, batch_scale: float,
                  datums: list[Datum]):
        """This rank's share of one Forward / ForwardBackward: (its logprobs, the call's metrics)."""
        engine = self.engines[session_id]
        call = engine.loss_call(req, backward=backward, deterministic=deterministic, lock=contextlib.nullcontext,
                                batch_scale=batch_scale)
        return self._refusable(run_call, call, datums)

    def step(self, session_id: str, settings: AdamW):
        return self._refusable(lambda: float(self.engines[session_id].step(settings)))

    def save(self, session_id: str, root: Path, base_model: str, progress: dict) -> None:
        self.engines[session_id].save(root, base_model=base_model, progress=progress)

    def save_weights(self, session_id: str, out: Path, base_model: str) -> None:
        self.engines[session_id].save_weights(out, base_model=base_model)

    def restore(self, session_id: str, ckpt: EngineCheckpoint, weights: bool, optimizer: bool, rng: bool,
                gradients: bool):
        return self._refusable(self.engines[session_id].restore, ckpt, weights=weights, optimizer=optimizer,
                               rng=rng, gradients=gradients)


class EngineGroup:
    """Rank 0's handle on the group: runs EngineHost commands on every rank, and turns a broken group into
    Unavailable for the caller and a restart of the trainer (on_broken, once)."""

    def __init__(self, controller: Controller, host: EngineHost, on_broken: Callable[[], None] = lambda: None):
        self.controller, self.host, self.on_broken = controller, host, on_broken
        self.parallel = host.parallel
        self.broken = threading.Event()
        self._lock = threading.Lock()  # one command at a time, its refusal read before the next runs

    def run(self, name: str, *args, per_rank=None, **kwargs) -> list:
        with self._lock:
            return self._run(name, *args, per_rank=per_rank, **kwargs)

    def _run(self, name: str, *args, per_rank=None, **kwargs) -> list:
        if self.broken.is_set():
            raise Unavailable("the trainer's process group is broken; the trainer restarts")
        try:
            results = self.controller.run(name, *args, per_rank=per_rank, **kwargs)
        except BaseException as exc:
            # A worker died or failed (Unavailable), or rank 0's own engine failed half-way through a command the
            # workers ran: either way the group is out of step. Only a restart of the whole group mends it.
            self._break(f"{name}: {type(exc).__name__}: {exc}")
            if isinstance(exc, Unavailable):
                raise
            raise Unavailable(f"the trainer failed during {name} ({type(exc).__name__}: {exc}); it restarts") \
                from exc
        refused = [r for r in results if isinstance(r, str) and r == REFUSED]
        if refused:
            if len(refused) != len(results) or self.host.refusal is None:
                self._break(f"{name}: refused on {len(refused)} of {len(results)} ranks")
                raise Unavailable(f"the trainer's ranks disagreed during {name}; it restarts")
            exc, self.host.refusal = self.host.refusal, None
            raise exc
        return results

    def _break(self, why: str) -> None:
        if not self.broken.is_set():
            log.error("the trainer's process group is broken (%s); the trainer exits for torchrun to restart it",
                      why)
            self.broken.set()
            self.on_broken()

    def create(self, session_id: str, model_dir: str, *, lora, seed: int, saved: EngineCheckpoint | None = None,
               weights: bool = True, optimizer: bool = True, gradients: bool = False) -> GroupEngine:
        """The session's engine on every rank (its state restored from saved when given); its GroupEngine."""
        created = self.run("create", session_id, str(model_dir), lora, seed, saved, weights, optimizer, gradients)
        return GroupEngine(self, session_id, [dp_rank for dp_rank, _ in created], created[0][1])

    def stop(self) -> None:
        """End the workers' loops (a graceful stop: the group is whole)."""
        if not self.broken.is_set():
            self.controller.stop()


class GroupEngine:
    """A session's engine on the group, seen from rank 0 (the module docstring): TrainingEngine's interface as
    SessionManager uses it; what it reads is rank 0's own engine, what it does runs on every rank."""

    def __init__(self, group: EngineGroup, session_id: str, dp_ranks: list[int], num_trainable: int):
        self.group, self.session_id, self.dp_ranks = group, session_id, dp_ranks
        self.num_trainable = num_trainable
        self.local = group.host.engines[session_id]
        self.dp_size = max(dp_ranks) + 1

    # What sessions.py reads of an engine: rank 0's, which runs every command too.
    model = property(lambda self: self.local.model)
    params = property(lambda self: self.local.params)
    optimizer = property(lambda self: self.local.optimizer)
    lora = property(lambda self: self.local.lora)
    seed = property(lambda self: self.local.seed)
    steps = property(lambda self: self.local.steps)
    device = property(lambda self: self.local.device)

    def loss_call(self, req: LossRequest, *, backward: bool, deterministic: bool, lock,
                  batch_scale: float | None = None) -> GroupCall:
        return GroupCall(self, req, backward=backward, deterministic=deterministic)

    def step(self, settings: AdamW) -> float:
        return self.group.run("step", self.session_id, settings)[0]

    def save(self, root: Path, *, base_model: str, progress: dict) -> None:
        self.group.run("save", self.session_id, root, base_model, progress)

    def save_weights(self, out: Path, *, base_model: str) -> None:
        self.group.run("save_weights", self.session_id, out, base_model)

    def restore(self, ckpt: EngineCheckpoint, *, weights: bool = True, optimizer: bool = True, rng: bool = False,
                gradients: bool = False) -> None:
        self.group.run("restore", self.session_id, ckpt, weights, optimizer, rng, gradients)

    def release(self) -> None:
        """Free the session's engine on every rank (nothing to free where the group is already broken)."""
        if not self.group.broken.is_set():
            self.group.run("release", self.session_id)


class GroupCall:
    """A Forward / ForwardBackward on the group, with LossCall's interface for run_call: datums are gathered as they
    come (begin / add), and finish() runs the whole call as one command; abort() has nothing to undo, since nothing
    ran before finish()."""

    def __init__(self, engine: GroupEngine, req: LossRequest, *, backward: bool, deterministic: bool):
        self.engine, self.req, self.backward, self.deterministic = engine, req, backward, deterministic
        self.datums: list[Datum] = []

    def begin(self) -> None:
        pass

    def add(self, datum: Datum) -> None:
        self.datums.append(datum)

    def abort(self) -> None:
        self.datums = []

    def finish(self) -> tuple[list[torch.Tensor], dict[str, float]]:
        engine = self.engine
        if not self.datums:
            raise InvalidArgument("at least one datum is required", field="data")
        c = losses.batch_scale(self.req.loss_fn, self.req.config, [d.inputs for d in self.datums])
        if not math.isfinite(c):
            raise InvalidArgument(f"the batch factor of loss '{self.req.loss_fn}' is {c}", field="loss_fn_config")
        shares = split_for_ranks(self.datums, engine.dp_size)
        results = engine.group.run("loss_call", engine.session_id, self.req, self.backward, self.deterministic, c,
                                   per_rank=[shares[d] for d in engine.dp_ranks])
        first_of = {}
        for rank, dp_rank in enumerate(engine.dp_ranks):
            first_of.setdefault(dp_rank, rank)
        logprobs = [lp for d in range(engine.dp_size) for lp in results[first_of[d]][0]]
        return logprobs, results[0][1]


# -- processes ---------------------------------------------------------------------------------------------------
def init_group(settings) -> tuple[ParallelDims, torch.device]:
    """The default process group from torchrun's environment (NCCL on CUDA, gloo otherwise) and the resolved layout
    (the setting checked against the world size)."""
    world = int(os.environ["WORLD_SIZE"])
    dims = settings.parallel_dims(world)  # checked before joining: a bad setting fails every rank alike
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS",
                                                                                       "0")):
        log.warning("torchrun shares its rendezvous store across restarts: a restarted group may fail to meet; "
                    "launch it with %s", " ".join(f"{k}={v}" for k, v in TORCHRUN_ENV.items()))
    return dims, join_torchrun_group(settings.trainer_group_timeout_s)


def run_worker(settings, host: EngineHost) -> None:
    """A worker rank: rank 0's commands until it stops the group (or leaves it: exit 1, see controller.serve)."""
    signal.signal(signal.SIGTERM, lambda *_: log.info("rank %d: SIGTERM; rank 0 decides when the group stops",
                                                       dist.get_rank()))
    serve(host)
    dist.destroy_process_group()
