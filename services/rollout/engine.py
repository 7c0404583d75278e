"""The sampling engine: base models, LoRA adapters on them, and continuous batching with the trainer's model code.

Interface (docs/rollout.md):
    engine = Engine(EngineConfig(...))             # or Engine(max_loaded_adapters=..., dtype=..., device=...)
    engine.base(model_dir)                         # load a base model (tokenizer, eos ids, its engine loop)
    engine.unload_base(model_dir)                  # free it once its running requests finish
    engine.load_adapter(adapter_id, model_dir, adapter_dir, eager=True) / engine.unload_adapter(adapter_id)
    handle = engine.submit(model_dir, adapter_id | None, prompt_ids, params)
    for out in handle: ...                         # RequestOutput per engine step (incremental), the last finished
    handle.result() -> Generation                  # or wait for the whole result; handle.cancel() aborts
    engine.generate(...) -> list[SampledSequence]  # submit(...).result().sequences

Each base model has one EngineCore (services/rollout/engine_core.py: schedule -> execute -> update) and one loop
thread that runs its steps while it has requests. Requests from any thread join the running batch between steps
(continuous batching); requests for different adapters of one base and for the base itself share every step.

KV memory: one pool (services/rollout/kv_blocks.py's KVArena, kv_cache_mb) per KV layout, shared by every base model
that caches that layout: a base and the full-weight versions or deployments of it (each its own model and loop) draw
blocks from the same bounded pool, which holds memory only while some request holds blocks. A loop whose requests
find no free block waits until another returns some (a request that could never fit is refused at submit).

Adapters are opaque slots: an adapter id (a deployment id, or one per weight version of a deployment) names a PEFT
directory; its weights live in the base model under an internal slot name while loaded. At most
max_loaded_adapters hold weights at once: loading another evicts the least recently used adapter that no unfinished
request uses, or waits until one is free. An evicted adapter stays known and is loaded again on its next use;
unload_adapter forgets it at once for new requests, and frees its weights when its last running request finishes,
so a new weight version can be loaded under a new id while requests on the old one finish.

Locking: `_lock` guards the base-model dictionary and is held briefly; `_cv` (a Condition) guards adapter state and
is held while loading or dropping adapter weights; a base model's `lock` guards its module tree (adding, removing
adapters) and its engine steps. Order: _cv, then a base lock, then _lock; the loop thread holds only its base lock
during a step and unpins adapters after releasing it, so there is no cycle.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from models import load_pretrained
from models.lora import load_peft_adapter, remove_adapter, set_active_adapter
from models.tokenizer import eos_token_ids, load_tokenizer
from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.rollout import sampling
from services.rollout.engine_core import EngineConfig, EngineCore, RequestOutput, new_arena
from services.rollout.kv_blocks import KVArena, KVLayout
from services.rollout.sampling import SampledSequence, SamplingParams

log = logging.getLogger("trainyard.rollout.engine")

__all__ = ["BaseModel", "Engine", "EngineConfig", "Generation", "RequestHandle", "RequestOutput"]


@dataclass
class Generation:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None  # logprob of prompt token i + 1 given tokens 0..i, when asked for


class RequestHandle:
    """A submitted request: iterate for its outputs step by step, or wait for result(). Thread-safe."""

    def __init__(self, request_id: str, n: int, cancel: Callable[[], None]):
        self.request_id, self.n = request_id, n
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._cancel = cancel
        self._done = False

    def deliver(self, out: RequestOutput) -> None:
        self._queue.put(out)

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._done:
            out = self._queue.get()
            if out.finished:
                self._done = True
            if out.error is not None:
                raise out.error
            yield out

    def result(self) -> Generation:
        sequences = [SampledSequence() for _ in range(self.n)]
        prompt_logprobs = None
        for out in self:
            for d in out.sequences:
                s = sequences[d.index]
                s.tokens += d.tokens
                s.logprobs += d.logprobs
                s.top_logprobs += d.top_logprobs
                s.text += d.text
                s.finish_reason = d.finish_reason or s.finish_reason
                s.router_ids = d.router_ids if d.router_ids is not None else s.router_ids
            prompt_logprobs = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_logprobs
        return Generation(sequences, prompt_logprobs)

    def cancel(self) -> None:
        """Abort the request (its blocks are freed); iteration ends. A no-op once it finished."""
        if not self._done:
            self._cancel()


@dataclass
class BaseModel:
    model_dir: str
    model: torch.nn.Module
    tokenizer: object
    eos_ids: tuple[int, ...]
    core: EngineCore
    lock: threading.Lock = field(default_factory=threading.Lock)
    loop: _Loop | None = None

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def max_context(self) -> int:
        return self.model.args.max_position_embeddings


@dataclass(eq=False)
class _Adapter:
    adapter_id: str
    model_dir: str
    adapter_dir: Path
    slot: str | None = None  # its name inside the base model while its weights are loaded
    users: int = 0  # unfinished requests using it
    forgotten: bool = False  # unloaded: no new requests; weights go when the last user finishes


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = replace(config or EngineConfig(), **overrides)
        assert self.config.max_loaded_adapters >= 1
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # base-model loads are rare and slow; one at a time
        self._cv = threading.Condition()
        self._bases: dict[str, BaseModel] = {}
        self._arenas: dict[KVLayout, KVArena] = {}  # one KV pool per layout, shared by its bases
        self._adapters: dict[str, _Adapter] = {}
        self._lru: OrderedDict[_Adapter, None] = OrderedDict()  # adapters holding weights, least recent first
        self._slots = itertools.count()
        self._closed = False

    @property
    def max_loaded_adapters(self) -> int:
        return self.config.max_loaded_adapters

    # ---- base models -------------------------------------------------------------------------------------------

    def base(self, model_dir: str) -> BaseModel:
        """The base model for a directory, loaded on first use."""
        with self._lock:
            if model_dir in self._bases:
                return self._bases[model_dir]
        with self._load_lock:
            with self._lock:
                if model_dir in self._bases:
                    return self._bases[model_dir]
                if self._closed:
                    raise Unavailable("the rollout engine is shutting down")
            cfg = self.config
            log.info("loading base model %s (%s on %s)", model_dir, cfg.dtype, cfg.device)
            try:
                tokenizer = load_tokenizer(model_dir)
                model = load_pretrained(model_dir, cfg.dtype, cfg.device)
                eos_ids = tuple(eos_token_ids(tokenizer, model_dir))
            except (OSError, ValueError) as exc:  # ModelDirError is a ValueError: the directory is not usable
                raise FailedPrecondition(f"cannot load the base model in {model_dir}: {exc}") from None
            layout = KVLayout.of(model.args)
            with self._lock:
                arena = self._arenas.get(layout) or self._arenas.setdefault(layout, new_arena(layout, cfg))
            base = BaseModel(model_dir=model_dir, model=model, tokenizer=tokenizer, eos_ids=eos_ids,
                             core=EngineCore(model, tokenizer, cfg, arena))
            base.loop = _Loop(base)
            base.loop.start()
            with self._lock:
                self._bases[model_dir] = base
            return base

    def unload_base(self, model_dir: str) -> bool:
        """Free a base model: the next request for model_dir loads it again; requests running on it finish first
        (its loop stops once it has no work left). Callers make sure no request is being submitted to it meanwhile
        (one that is fails with Unavailable). False when it was not loaded."""
        with self._lock:
            base = self._bases.pop(model_dir, None)
        if base is None:
            return False
        log.info("unloading base model %s once its running requests finish", model_dir)
        base.loop.stop_when_idle()
        return True

    def loaded_models(self) -> list[str]:
        with self._lock:
            return list(self._bases)

    def kv_arenas(self) -> list[KVArena]:
        with self._lock:
            return list(self._arenas.values())

    def kv_usage(self) -> dict[str, tuple[int, int]]:
        """KV pool -> (blocks in use, blocks in the pool), for every pool (one per model shape, shared by the bases
        and full-weight versions of that shape), named by the model directories on it. Read without the arenas'
        locks: a scrape may see a count one step old."""
        with self._lock:
            bases, arenas = list(self._bases.values()), list(self._arenas.items())
        names: dict[int, list[str]] = {}
        for b in bases:
            names.setdefault(id(b.core.scheduler.blocks), []).append(b.model_dir)
        return {", ".join(sorted(names.get(id(a), [str(layout)]))): (a.num_blocks - a.num_free, a.num_blocks)
                for layout, a in arenas}

    # ---- adapters ----------------------------------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, model_dir: str, adapter_dir: str | Path, *, eager: bool = True) -> None:
        """Know adapter_id by its PEFT directory; eager: load its weights now rather than on first use (a no-op when
        they are loaded already; waits for a free slot when every loaded adapter is in use). Raises
        FailedPrecondition when the files do not fit the base model."""
        entry = _Adapter(adapter_id, model_dir, Path(adapter_dir))
        with self._cv:
            known = self._adapters.setdefault(adapter_id, entry)
        assert (known.model_dir, known.adapter_dir) == (entry.model_dir, entry.adapter_dir), (
            f"adapter {adapter_id} is known as {known}, not {entry}")
        if eager:
            base = self.base(model_dir)
            with self._cv:
                self._make_resident(base, known, pin=False)

    def unload_adapter(self, adapter_id: str) -> bool:
        """Forget an adapter: refused to new requests now, weights freed once no running request uses them. False
        when it was not known."""
        with self._cv:
            entry = self._adapters.pop(adapter_id, None)
            if entry is None:
                return False
            entry.forgotten = True
            if entry.slot is not None and entry.users == 0:
                self._drop_weights(entry)
            self._cv.notify_all()
        return True

    def known_adapters(self) -> list[str]:
        """Ids of every adapter known (loaded now or on first use), in no particular order."""
        with self._cv:
            return list(self._adapters)

    def loaded_adapters(self) -> list[str]:
        """Ids of the adapters whose weights are loaded now, least recently used first."""
        with self._cv:
            return [a.adapter_id for a in self._lru if not a.forgotten]

    def _make_resident(self, base: BaseModel, entry: _Adapter, *, pin: bool) -> str:
        """Under _cv: load the adapter's weights unless they are loaded (evicting the least recently used unused
        adapter, or waiting for one), pin it for a request if asked, mark it most recent; returns its slot."""
        while entry.slot is None:
            if self._closed:
                raise Unavailable("the rollout engine is shutting down")
            if entry.forgotten or self._adapters.get(entry.adapter_id) is not entry:
                raise NotFound(f"adapter '{entry.adapter_id}' is not loaded")
            if len(self._lru) < self.config.max_loaded_adapters:
                self._load_weights(base, entry)
                break
            victim = next((a for a in self._lru if a.users == 0), None)
            if victim is not None:
                log.info("evicting adapter %s (least recently used)", victim.adapter_id)
                self._drop_weights(victim)
            else:
                self._cv.wait()  # every loaded adapter serves a running request; one finishes eventually
        if pin:
            entry.users += 1
        self._lru.move_to_end(entry)
        return entry.slot

    def _load_weights(self, base: BaseModel, entry: _Adapter) -> None:
        slot = f"slot{next(self._slots)}"
        log.info("loading adapter %s from %s", entry.adapter_id, entry.adapter_dir)
        with base.lock:
            try:
                load_peft_adapter(base.model, entry.adapter_dir, slot)
                set_active_adapter(base.model, None)  # requests pick adapters per row; a plain forward is the base
            except ValueError as exc:  # files that do not fit the base model: forget them
                self._adapters.pop(entry.adapter_id, None)
                raise FailedPrecondition(
                    f"cannot load adapter '{entry.adapter_id}' on {base.model_dir}: {exc}") from None
            finally:
                base.core.runner.refresh_lora()
        entry.slot = slot
        self._lru[entry] = None

    def _drop_weights(self, entry: _Adapter) -> None:
        """Under _cv, for an adapter no request uses."""
        with self._lock:
            base = self._bases.get(entry.model_dir)
        if base is not None:  # None: the engine closed
            with base.lock:
                remove_adapter(base.model, entry.slot)
                base.core.runner.refresh_lora()
        entry.slot = None
        self._lru.pop(entry, None)

    def _unpin(self, entry: _Adapter) -> None:
        with self._cv:
            entry.users -= 1
            if entry.users == 0 and entry.forgotten and entry.slot is not None:
                self._drop_weights(entry)
            self._cv.notify_all()

    # ---- base weights ------------------------------------------------------------------------------------------

    def update_base_weights(self, model_dir: str, state: dict[str, torch.Tensor]) -> None:
        """Write new values into a base model's parameters (our names; any subset) between two engine steps, and
        return once they are in. Requests in flight go on with the new weights (their earlier positions' keys and
        values stay as computed): a full-weight update is not pinned per request, unlike an adapter version.
        Raises FailedPrecondition, with nothing written, when a name or shape does not fit the model."""
        base = self.base(model_dir)
        tensors = dict(base.model.named_parameters()) | dict(base.model.named_buffers())
        unknown = sorted(set(state) - set(tensors))
        wrong = [f"{k}: {tuple(v.shape)} vs {tuple(tensors[k].shape)}" for k, v in state.items()
                 if k in tensors and v.shape != tensors[k].shape]
        if unknown or wrong:
            raise FailedPrecondition(f"new weights do not fit {model_dir}: unknown {unknown[:5]}; shapes {wrong[:5]}")

        def write() -> None:  # in the loop thread, between steps, under the base lock
            with torch.no_grad():
                for name, value in state.items():
                    tensors[name].copy_(value)

        base.loop.call(write)

    # ---- generation --------------------------------------------------------------------------------------------

    def submit(self, model_dir: str, adapter_id: str | None, prompt_ids: Sequence[int],
               params: SamplingParams) -> RequestHandle:
        """Queue params.n samples of the prompt from the base model, or from it with adapter adapter_id (which must
        have been given to load_adapter). Raises InvalidArgument for params that do not fit the model."""
        sampling.validate_params(params)
        base = self.base(model_dir)
        sampling.validate_prompt(prompt_ids, params, vocab_size=base.vocab_size, max_context=base.max_context)
        base.core.check(len(prompt_ids), params)
        entry, slot = None, None
        if adapter_id is not None:
            with self._cv:
                entry = self._adapters.get(adapter_id)
                if entry is None or entry.model_dir != model_dir:
                    raise NotFound(f"adapter '{adapter_id}' is not loaded on {model_dir}")
                slot = self._make_resident(base, entry, pin=True)
        request_id = uuid.uuid4().hex
        handle = RequestHandle(request_id, params.n, lambda: base.loop.abort(request_id))
        stop_ids = {*(() if params.ignore_eos else base.eos_ids), *params.stop_token_ids}

        def add() -> None:  # in the loop thread
            try:
                base.core.add_request(request_id, list(prompt_ids), params, stop_ids=stop_ids, adapter=slot,
                                      sink=base.loop.collect)
            except Exception as exc:  # noqa: BLE001 - checked in submit already; the request fails, not the loop
                base.loop.collect(RequestOutput(request_id, finished=True, error=exc))

        def finished() -> None:
            if entry is not None:
                self._unpin(entry)

        try:
            base.loop.submit(request_id, add, handle, finished)
        except BaseException:
            finished()
            raise
        return handle

    def generate(self, model_dir: str, adapter_id: str | None, prompt_ids: Sequence[int],
                 params: SamplingParams) -> list[SampledSequence]:
        return self.submit(model_dir, adapter_id, prompt_ids, params).result().sequences

    def close(self) -> None:
        with self._lock:
            self._closed = True
            bases = list(self._bases.values())
            self._bases.clear()
        for base in bases:
            base.loop.stop()
        with self._cv:
            self._adapters.clear()
            self._lru.clear()
            self._cv.notify_all()  # loads waiting for a free slot give up


class _Loop:
    """The engine loop of one base model: runs core.step() while there are requests; requests and aborts queue in
    an inbox and are applied in this thread between steps, so the core stays single-threaded."""

    def __init__(self, base: BaseModel):
        self.base, self.core = base, base.core
        self._cv = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._handles: dict[str, tuple[RequestHandle, Callable[[], None]]] = {}
        self._collected: list[RequestOutput] = []
        self._stopped = False
        self._draining = False  # stop once there is no work left
        self._freed = 0  # times another core (or this one) returned KV blocks to the shared arena
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"rollout-loop-{id(self):x}")

    def start(self) -> None:
        self.core.arena.listen(self._on_free)
        self._thread.start()

    def _on_free(self) -> None:
        with self._cv:
            self._freed += 1
            self._cv.notify()

    def submit(self, request_id: str, add: Callable[[], None], handle: RequestHandle,
               finished: Callable[[], None]) -> None:
        with self._cv:
            if self._stopped:
                raise Unavailable("the rollout engine is shutting down")
            self._handles[request_id] = (handle, finished)
            self._inbox.append(add)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        def do() -> None:
            if self.core.abort(request_id):
                self.collect(RequestOutput(request_id, finished=True))

        with self._cv:
            self._inbox.append(do)
            self._cv.notify()

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn in this loop's thread between two steps (under the base lock) and wait for it; re-raises."""
        done, failure = threading.Event(), []

        def action() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                failure.append(exc)
            finally:
                done.set()

        with self._cv:
            if self._stopped:
                raise Unavailable("the rollout engine is shutting down")
            self._inbox.append(action)
            self._cv.notify()
        while not done.wait(0.5):
            if not self._thread.is_alive():  # stopped before it got to the action
                raise Unavailable("the rollout engine is shutting down")
        if failure:
            raise failure[0]

    def collect(self, out: RequestOutput) -> None:
        """The core's sink (called in this thread): delivered after the step, outside the base lock."""
        self._collected.append(out)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    def stop_when_idle(self) -> None:
        with self._cv:
            self._draining = True
            self._cv.notify()

    def _run(self) -> None:
        starved_at = None  # _freed when the last step found every KV block held by other cores
        while True:
            with self._cv:
                while not self._inbox and not self._stopped:
                    if self.core.has_work() and starved_at != self._freed:
                        break
                    if self._draining and not self.core.has_work():
                        self._stopped = True
                        break
                    self._cv.wait()  # for requests, or for blocks another core returns
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
                freed = self._freed
            with self.base.lock:
                for action in inbox:
                    action()
                try:
                    self.core.step()
                except Exception as exc:  # the step's requests fail with it; the loop goes on
                    log.exception("engine step failed; failing its requests")
                    self.core.fail_all(exc)
            starved_at = freed if self.core.has_work() and self.core.last_batch_size == 0 else None
            self._deliver()
        self.core.arena.unlisten(self._on_free)
        shutting_down = Unavailable("the rollout engine is shutting down")
        self.core.fail_all(shutting_down)
        self._deliver()
        with self._cv:  # requests still in the inbox never reached the core
            left, self._handles = self._handles, {}
        for request_id, (handle, finished) in left.items():
            finished()
            handle.deliver(RequestOutput(request_id, finished=True, error=shutting_down))

    def _deliver(self) -> None:
        collected, self._collected = self._collected, []
        for out in collected:
            with self._cv:
                handle, finished = (self._handles.pop(out.request_id) if out.finished
                                    else (self._handles[out.request_id][0], None))
            if finished is not None:
                finished()  # unpin the adapter before the caller sees the end
            handle.deliver(out)
